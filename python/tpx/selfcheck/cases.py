"""The checks of ``python -m tpx.selfcheck``: each op, layer and CUDA kernel of tpx against
the unsharded PyTorch computation, and the overlap of the collective matmuls, recorded in a
:class:`Report`."""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpx
from ..layout.param_dtensors import local_of


NO_GPU = "no GPU found: CUDA kernels not checked"

# (rtol, atol) of the comparisons with the unsharded computation.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1e-2),
        torch.float16: (1e-3, 1e-3)}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class Report:
    """The result rows of one rank: ``section``, ``check``, ``device``, ``dtype``, ``max_err``
    (the largest ``|got - expected|`` over every output and gradient compared), ``tol`` (the
    allowed ``atol + rtol * |expected|``), ``measure`` (GB/s, fraction hidden), ``status``
    (``pass``, ``FAIL``, ``skip``) and ``note``."""

    def __init__(self) -> None:
        self.rows: List[dict] = []

    def add(self, section: str, check: str, device: str, dtype: str = "", *,
            max_err: Optional[float] = None, tol: str = "", measure: str = "",
            status: str = "pass", note: str = "") -> dict:
        row = dict(section=section, check=check, device=device, dtype=dtype, max_err=max_err,
                   tol=tol, measure=measure, status=status, note=note)
        self.rows.append(row)
        return row

    def run(self, section: str, check: str, device: str, dtype: str,
            fn: Callable[["Comparison"], Optional[str]]) -> dict:
        """Runs ``fn(comparison)``; the row fails if a comparison failed or ``fn`` raised."""
        cmp = Comparison()
        try:
            measure = fn(cmp) or ""
        except Exception as e:  # noqa: BLE001 - every error becomes a failed row
            traceback.print_exc(file=sys.stderr)
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if "no kernel image" in str(e):
                msg += " (rebuild tpx with TORCH_CUDA_ARCH_LIST naming this GPU's architecture)"
            return self.add(section, check, device, dtype, max_err=cmp.max_err, tol=cmp.tol,
                            status="FAIL", note=msg[:300])
        return self.add(section, check, device, dtype, max_err=cmp.max_err, tol=cmp.tol,
                        measure=measure, status="pass" if not cmp.failed else "FAIL",
                        note="; ".join(cmp.failed)[:300])


class Comparison:
    """Accumulates element-wise comparisons of one check."""

    def __init__(self) -> None:
        self.max_err = 0.0
        self.tol = ""
        self.failed: List[str] = []

    def close(self, what: str, got, expected, dtype=torch.float32, exact: bool = False) -> None:
        if got is None or expected is None:
            if (got is None) != (expected is None):
                self.failed.append(f"{what}: one side is None")
            return
        got = local_of(got)  # a DTensor parameter's gradient: this rank's part
        if got.shape != expected.shape:
            self.failed.append(f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}")
            return
        rtol, atol = (0.0, 0.0) if exact else TOL[dtype]
        if not exact:  # the row shows the tolerance of its inexact comparisons
            self.tol = f"{atol:g}+{rtol:g}|x|"
        elif not self.tol:
            self.tol = "exact"
        g, e = got.detach().double(), expected.detach().double()
        same = (g == e) | (torch.isnan(g) & torch.isnan(e))
        diff = torch.where(same, torch.zeros_like(g), (g - e).abs())
        diff = torch.nan_to_num(diff, nan=float("inf"))
        err = float(diff.max()) if diff.numel() else 0.0
        self.max_err = max(self.max_err, err)
        bad = diff > atol + rtol * e.abs().nan_to_num(posinf=0.0, neginf=0.0)
        if bool(bad.any()):
            self.failed.append(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ "
                               f"(max {err:.3g})")


# Inputs: drawn on the CPU from a generator all ranks seed alike, so every rank holds the
# same full tensors and takes its own shard of them.

class Inputs:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device

    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=self.gen)).to(self.device, dtype)

    def randint(self, high: int, *shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen).to(self.device)

    def seed_torch(self) -> None:
        """Seeds torch's default generators alike on every rank, so that the reference modules
        (``nn.Linear``, ``nn.Embedding``) are initialised with the same weights everywhere."""
        torch.manual_seed(int(torch.randint(0, 2 ** 31, (), generator=self.gen)))


def fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# Ops (tpx.ops) against the unsharded computation, at the world size of the group.

def _check_all_gather_matmul(c: Comparison, inp: Inputs, pg, chunks) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    k, n, s = 16, 5 * world + 1, 3  # n does not divide: uneven column shards
    c0, c1 = tpx.shard_range(n, pg)
    full_a, B, bias = inp.randn(2, world * s, k), inp.randn(k, n), inp.randn(n)
    gy, gag = inp.randn(2, world * s, n), inp.randn(2, world * s, k)
    fa, fB, fb = fresh_leaf(full_a), fresh_leaf(B), fresh_leaf(bias)
    ref = fa @ fB + fb
    ((ref * gy).sum() + world * (fa * gag).sum()).backward()
    a, w, b = fresh_leaf(full_a[:, rank * s:(rank + 1) * s]), fresh_leaf(B[:, c0:c1].t()), fresh_leaf(bias[c0:c1])
    gathered, out = tpx.ops.all_gather_matmul(a, w.t(), 1, pg, chunks, bias=b)
    c.close("a_gathered", gathered, full_a, exact=True)
    c.close("out", out, ref[..., c0:c1])
    ((out * gy[..., c0:c1]).sum() + (gathered * gag).sum()).backward()
    c.close("grad a", a.grad, fa.grad[:, rank * s:(rank + 1) * s])
    c.close("grad b", w.grad.t(), fB.grad[:, c0:c1])
    c.close("grad bias", b.grad, fb.grad[c0:c1])


def _check_matmul_reduce_scatter(c: Comparison, inp: Inputs, pg, chunks) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    k, n, s = 4 * world + 1, 7, 3
    k0, k1 = tpx.shard_range(k, pg)
    A, B, bias, gy = inp.randn(2, world * s, k), inp.randn(k, n), inp.randn(n), inp.randn(
        2, world * s, n)
    fA, fB, fb = fresh_leaf(A), fresh_leaf(B), fresh_leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = fresh_leaf(A[..., k0:k1]), fresh_leaf(B[k0:k1]), fresh_leaf(bias)
    out = tpx.ops.matmul_reduce_scatter(a, w, 1, pg, chunks, bias=b)
    mine = slice(rank * s, (rank + 1) * s)
    c.close("out", out, ref[:, mine])
    (out * gy[:, mine]).sum().backward()
    c.close("grad a", a.grad, fA.grad[..., k0:k1])
    c.close("grad b", w.grad, fB.grad[k0:k1])
    c.close("grad bias", b.grad, fb.grad)


def _check_matmul_all_reduce(c: Comparison, inp: Inputs, pg, chunks) -> None:
    world = pg.size()
    k, n = 4 * world + 1, 7
    k0, k1 = tpx.shard_range(k, pg)
    A, B, bias, gy = inp.randn(2, 5, k), inp.randn(k, n), inp.randn(n), inp.randn(2, 5, n)
    fA, fB, fb = fresh_leaf(A), fresh_leaf(B), fresh_leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = fresh_leaf(A[..., k0:k1]), fresh_leaf(B[k0:k1].t()), fresh_leaf(bias)
    out = tpx.ops.matmul_all_reduce(a, w.t(), pg, chunks, bias=b)
    c.close("out", out, ref)
    (out * gy).sum().backward()
    c.close("grad a", a.grad, fA.grad[..., k0:k1])
    c.close("grad b", w.grad.t(), fB.grad[k0:k1])
    c.close("grad bias", b.grad, fb.grad)


def _check_replicated_matmul(c: Comparison, inp: Inputs, pg, chunks) -> None:
    world = pg.size()
    k, n = 6, 5 * world + 1
    c0, c1 = tpx.shard_range(n, pg)
    A, B, bias, gy = inp.randn(9, k), inp.randn(k, n), inp.randn(n), inp.randn(9, n)
    fA, fB, fb = fresh_leaf(A), fresh_leaf(B), fresh_leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = fresh_leaf(A), fresh_leaf(B[:, c0:c1]), fresh_leaf(bias[c0:c1])
    out = tpx.ops.replicated_matmul(a, w, pg, chunks, bias=b)
    c.close("out", out, ref[:, c0:c1])
    (out * gy[:, c0:c1]).sum().backward()
    c.close("grad a (all-reduced)", a.grad, fA.grad)
    c.close("grad b", w.grad, fB.grad[:, c0:c1])
    c.close("grad bias", b.grad, fb.grad[c0:c1])


def _check_vocab_ce_rows(c: Comparison, inp: Inputs, pg, inplace: bool) -> None:
    V, N, eps = 211 * pg.size() + 5, 13, 0.1
    v0, v1 = tpx.shard_range(V, pg)
    full, target, g = inp.randn(N, V, scale=3.0), inp.randint(V, N), inp.randn(N)
    target[::4] = -100
    ref_in = fresh_leaf(full)
    ref = F.cross_entropy(ref_in, target, reduction="none", label_smoothing=eps)
    ref.backward(g)
    leaf = fresh_leaf(full[:, v0:v1])
    x = leaf * 1 if inplace else leaf  # the in-place backward overwrites its input
    loss, lse = tpx.ops.vocab_parallel_cross_entropy_rows(
        x, target, v0, V, pg, label_smoothing=eps, inplace_backward=inplace)
    c.close("loss", loss, ref)
    c.close("lse", lse, torch.logsumexp(full, 1))
    loss.backward(g)
    c.close("grad logits", leaf.grad, ref_in.grad[:, v0:v1])


def _check_vocab_embedding_op(c: Comparison, inp: Inputs, pg, sequence_parallel: bool) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    V, D, S = 101 * world + 3, 12, 2 * world
    v0, v1 = tpx.shard_range(V, pg)
    table, ids = inp.randn(V, D), inp.randint(V, 3, S)
    gy = inp.randn(3, S, D)
    ref_w = fresh_leaf(table)
    ref = F.embedding(ids, ref_w)
    (ref * gy).sum().backward()
    w = fresh_leaf(table[v0:v1])
    if sequence_parallel:
        out = tpx.ops.vocab_parallel_embedding(w, ids, v0, pg, scatter_dim=1)
        mine = slice(rank * 2, rank * 2 + 2)
        c.close("out", out, ref[:, mine])
        (out * gy[:, mine]).sum().backward()
    else:
        out = tpx.ops.vocab_parallel_embedding(w, ids, v0, pg)
        c.close("out", out, ref)
        (out * gy).sum().backward()
    c.close("grad weight", w.grad, ref_w.grad[v0:v1])


def _check_linear_ce_rows(c: Comparison, inp: Inputs, pg) -> None:
    V, N, d = 97 * pg.size() + 3, 11, 16
    v0, v1 = tpx.shard_range(V, pg)
    hidden, weight, bias = inp.randn(N, d), inp.randn(V, d, scale=0.3), inp.randn(V)
    target, g = inp.randint(V, N), inp.randn(N)
    target[::5] = -100
    fh, fw, fb = fresh_leaf(hidden), fresh_leaf(weight), fresh_leaf(bias)
    ref = F.cross_entropy(fh @ fw.t() + fb, target, reduction="none", label_smoothing=0.05)
    ref.backward(g)
    h, w, b = fresh_leaf(hidden), fresh_leaf(weight[v0:v1]), fresh_leaf(bias[v0:v1])
    loss, _ = tpx.ops.linear_cross_entropy_rows(h, w, target, v0, V, pg, bias=b, chunk_size=4,
                                                label_smoothing=0.05)
    c.close("loss", loss, ref)
    loss.backward(g)
    c.close("grad hidden", h.grad, fh.grad)
    c.close("grad weight", w.grad, fw.grad[v0:v1])
    c.close("grad bias", b.grad, fb.grad[v0:v1])


def op_checks(rep: Report, inp: Inputs, pg, device: str) -> None:
    w = pg.size()
    for chunks in (1, None):
        tag = f"chunks={'default' if chunks is None else chunks}"
        for name, fn in (("all_gather_matmul", _check_all_gather_matmul),
                         ("matmul_reduce_scatter", _check_matmul_reduce_scatter),
                         ("matmul_all_reduce", _check_matmul_all_reduce),
                         ("replicated_matmul", _check_replicated_matmul)):
            rep.run(f"op (world {w})", f"{name} {tag}", device, "fp32",
                    lambda c, fn=fn, chunks=chunks: fn(c, inp, pg, chunks))
    for inplace in (False, True):
        rep.run(f"op (world {w})", "vocab_parallel_cross_entropy_rows"
                + (" inplace_backward" if inplace else ""), device, "fp32",
                lambda c, inplace=inplace: _check_vocab_ce_rows(c, inp, pg, inplace))
    for sp in (False, True):
        rep.run(f"op (world {w})", "vocab_parallel_embedding" + (" scatter_dim=1" if sp else ""),
                device, "fp32", lambda c, sp=sp: _check_vocab_embedding_op(c, inp, pg, sp))
    rep.run(f"op (world {w})", "linear_cross_entropy_rows", device, "fp32",
            lambda c: _check_linear_ce_rows(c, inp, pg))


# ---------------------------------------------------------------------------------------------
# Layers (tpx.nn) against the torch module they replace.

def _check_column_linear(c: Comparison, inp: Inputs, pg, mode: str) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    fin, fout, S = 12, 4 * world + 3, 2 * world
    inp.seed_torch()
    ref_layer = nn.Linear(fin, fout, device=inp.device)
    kw = {"sequence_parallel": {"sequence_parallel": True},
          "gather_output": {"gather_output": True}}.get(mode, {})
    layer = tpx.ColumnParallelLinear.from_linear(ref_layer, pg, **kw)
    x, gy = inp.randn(3, S, fin), inp.randn(3, S, fout)
    fx = fresh_leaf(x)
    ref = ref_layer(fx)
    (ref * gy).sum().backward()
    o0, o1 = tpx.shard_range(fout, pg)
    mine = slice(rank * 2, rank * 2 + 2)
    xl = fresh_leaf(x[:, mine] if mode == "sequence_parallel" else x)
    y = layer(xl)
    want, gy_l = (ref, gy) if mode == "gather_output" else (ref[..., o0:o1], gy[..., o0:o1])
    c.close("out", y, want)
    (y * gy_l).sum().backward()
    c.close("grad input", xl.grad, fx.grad[:, mine] if mode == "sequence_parallel" else fx.grad)
    c.close("grad weight", layer.weight.grad, ref_layer.weight.grad[o0:o1])
    c.close("grad bias", layer.bias.grad, ref_layer.bias.grad[o0:o1])


def _check_row_linear(c: Comparison, inp: Inputs, pg, sequence_parallel: bool) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    fin, fout, S = 4 * world + 3, 10, 2 * world
    inp.seed_torch()
    ref_layer = nn.Linear(fin, fout, device=inp.device)
    layer = tpx.RowParallelLinear.from_linear(ref_layer, pg, sequence_parallel=sequence_parallel)
    x, gy = inp.randn(3, S, fin), inp.randn(3, S, fout)
    fx = fresh_leaf(x)
    ref = ref_layer(fx)
    (ref * gy).sum().backward()
    i0, i1 = tpx.shard_range(fin, pg)
    xl = fresh_leaf(x[..., i0:i1])
    y = layer(xl)
    mine = slice(rank * 2, rank * 2 + 2) if sequence_parallel else slice(None)
    c.close("out", y, ref[:, mine])
    (y * gy[:, mine]).sum().backward()
    c.close("grad input", xl.grad, fx.grad[..., i0:i1])
    c.close("grad weight", layer.weight.grad, ref_layer.weight.grad[:, i0:i1])
    c.close("grad bias", layer.bias.grad, ref_layer.bias.grad)


def _check_mlp(c: Comparison, inp: Inputs, pg) -> None:
    """Column -> GELU -> row, the Megatron MLP: replicated in and out."""
    world = pg.size()
    d, h = 8, 6 * world + 2
    inp.seed_torch()
    fc1, fc2 = nn.Linear(d, h, device=inp.device), nn.Linear(h, d, device=inp.device)
    t1 = tpx.ColumnParallelLinear.from_linear(fc1, pg)
    t2 = tpx.RowParallelLinear.from_linear(fc2, pg)
    x, gy = inp.randn(4, 5, d), inp.randn(4, 5, d)
    fx, xl = fresh_leaf(x), fresh_leaf(x)
    ref = fc2(F.gelu(fc1(fx)))
    (ref * gy).sum().backward()
    y = t2(F.gelu(t1(xl)))
    c.close("out", y, ref)
    (y * gy).sum().backward()
    o0, o1 = tpx.shard_range(h, pg)
    c.close("grad input", xl.grad, fx.grad)
    c.close("grad fc1.weight", t1.weight.grad, fc1.weight.grad[o0:o1])
    c.close("grad fc2.weight", t2.weight.grad, fc2.weight.grad[:, o0:o1])
    c.close("grad fc2.bias", t2.bias.grad, fc2.bias.grad)


def _check_embedding_layer(c: Comparison, inp: Inputs, pg, cls, mode: str) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    V, D, S = 61 * world + 2, 4 * world + 1, 2 * world
    inp.seed_torch()
    ref_emb = nn.Embedding(V, D, padding_idx=3, device=inp.device)
    kw = {"sequence_parallel": True} if mode == "sequence_parallel" else {}
    layer = cls.from_embedding(ref_emb, pg, **kw)
    ids = inp.randint(V, 3, S)
    ids[0, 0] = 3
    ref = ref_emb(ids)
    gy = inp.randn(*ref.shape)
    (ref * gy).sum().backward()
    y = layer(ids)
    mine = slice(rank * 2, rank * 2 + 2) if mode == "sequence_parallel" else slice(None)
    c.close("out", y, ref[:, mine])
    (y * gy[:, mine]).sum().backward()
    if cls is tpx.VocabParallelEmbedding:
        v0, v1 = tpx.shard_range(V, pg)
        c.close("grad weight", layer.weight.grad, ref_emb.weight.grad[v0:v1])
    else:
        d0, d1 = tpx.shard_range(D, pg)
        c.close("grad weight", layer.weight.grad, ref_emb.weight.grad[:, d0:d1])


def _check_ce_loss_layer(c: Comparison, inp: Inputs, pg) -> None:
    V = 53 * pg.size() + 4
    v0, v1 = tpx.shard_range(V, pg)
    full, target = inp.randn(2, 7, V, scale=2.0), inp.randint(V, 2, 7)
    target[0, ::3] = -100
    ref_in = fresh_leaf(full)
    ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), label_smoothing=0.1)
    ref.backward()
    x = fresh_leaf(full[..., v0:v1])
    loss = tpx.VocabParallelCrossEntropyLoss(label_smoothing=0.1, group=pg, vocab_size=V)(
        x, target)
    c.close("loss", loss, ref)
    loss.backward()
    c.close("grad logits", x.grad, ref_in.grad[..., v0:v1])


def _check_linear_ce(c: Comparison, inp: Inputs, pg) -> None:
    V, d = 47 * pg.size() + 5, 8
    v0, v1 = tpx.shard_range(V, pg)
    hidden, weight, target = inp.randn(2, 6, d), inp.randn(V, d, scale=0.5), inp.randint(V, 2, 6)
    fh, fw = fresh_leaf(hidden), fresh_leaf(weight)
    ref = F.cross_entropy((fh @ fw.t()).reshape(-1, V), target.reshape(-1))
    ref.backward()
    h, w = fresh_leaf(hidden), fresh_leaf(weight[v0:v1])
    loss = tpx.linear_cross_entropy(h, w, target, group=pg, chunk_size=5, vocab_size=V)
    c.close("loss", loss, ref)
    loss.backward()
    c.close("grad hidden", h.grad, fh.grad)
    c.close("grad weight", w.grad, fw.grad[v0:v1])


def layer_checks(rep: Report, inp: Inputs, pg, device: str) -> None:
    sec = f"layer (world {pg.size()})"
    for mode in ("", "sequence_parallel", "gather_output"):
        rep.run(sec, "ColumnParallelLinear" + (f" {mode}" if mode else ""), device, "fp32",
                lambda c, mode=mode: _check_column_linear(c, inp, pg, mode))
    for sp in (False, True):
        rep.run(sec, "RowParallelLinear" + (" sequence_parallel" if sp else ""), device, "fp32",
                lambda c, sp=sp: _check_row_linear(c, inp, pg, sp))
    rep.run(sec, "MLP column -> GELU -> row", device, "fp32", lambda c: _check_mlp(c, inp, pg))
    for cls, mode in ((tpx.VocabParallelEmbedding, ""),
                      (tpx.VocabParallelEmbedding, "sequence_parallel"),
                      (tpx.ColumnParallelEmbedding, "")):
        rep.run(sec, cls.__name__ + (f" {mode}" if mode else ""), device, "fp32",
                lambda c, cls=cls, mode=mode: _check_embedding_layer(c, inp, pg, cls, mode))
    rep.run(sec, "VocabParallelCrossEntropyLoss", device, "fp32",
            lambda c: _check_ce_loss_layer(c, inp, pg))
    rep.run(sec, "linear_cross_entropy", device, "fp32", lambda c: _check_linear_ce(c, inp, pg))


# ---------------------------------------------------------------------------------------------
# The fraction of the communication hidden (NCCL, 2 or more GPUs).

def overlap_checks(rep: Report, pg, device: str) -> None:
    world = pg.size()
    M, K, N = 8192, 4096, 8192  # tokens, hidden, output features (a mid-size MLP layer)
    dtype = torch.bfloat16
    dev = torch.device(device)
    a = torch.randn(M // world, K, device=dev, dtype=dtype)
    b = torch.randn(K, N // world, device=dev, dtype=dtype) / K ** 0.5
    a_full = torch.empty(M, K, device=dev, dtype=dtype)
    c = torch.randn(M, N // world, device=dev, dtype=dtype)
    d = torch.randn(N // world, K, device=dev, dtype=dtype) / N ** 0.5
    partial = torch.empty(M, K, device=dev, dtype=dtype)
    out_rs = torch.empty(M // world, K, device=dev, dtype=dtype)
    cases = {
        "all_gather_matmul": {
            "serial": lambda: tpx.ops.all_gather_matmul(a, b, 0, pg, 1),
            "overlapped": lambda: tpx.ops.all_gather_matmul(a, b, 0, pg, None),
            "gemm": lambda: torch.matmul(a_full, b),
            "comm": lambda: dist.all_gather_into_tensor(a_full, a, group=pg)},
        "matmul_reduce_scatter": {
            "serial": lambda: tpx.ops.matmul_reduce_scatter(c, d, 0, pg, 1),
            "overlapped": lambda: tpx.ops.matmul_reduce_scatter(c, d, 0, pg, None),
            "gemm": lambda: torch.matmul(c, d, out=partial),
            "comm": lambda: dist.reduce_scatter_tensor(out_rs, partial, group=pg)},
    }
    for op, variants in cases.items():
        def fn(cmp, op=op, variants=variants):
            cmp.close("overlapped vs serial", _first(variants["overlapped"]()),
                      _first(variants["serial"]()), torch.bfloat16)
            times = {k: [] for k in variants}
            for fn_ in variants.values():
                fn_()
            for _ in range(10):  # round robin over the variants
                for key, fn_ in variants.items():
                    torch.cuda.synchronize()
                    dist.barrier(group=pg)
                    t0 = time.perf_counter()
                    fn_()
                    torch.cuda.synchronize()
                    t = torch.tensor([time.perf_counter() - t0], device=dev)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
                    times[key].append(float(t))
            med = {k: statistics.median(v) for k, v in times.items()}
            hidden = (med["serial"] - med["overlapped"]) / min(med["gemm"], med["comm"])
            return (f"hidden {hidden:.2f} (serial {med['serial'] * 1e3:.2f} ms, overlapped "
                    f"{med['overlapped'] * 1e3:.2f} ms, GEMM {med['gemm'] * 1e3:.2f} ms, "
                    f"collective {med['comm'] * 1e3:.2f} ms; M={M} K={K} N={N})")
        rep.run(f"overlap (world {world})", f"{op} default chunks", device, "bf16", fn)


def _first(x):
    return x[1] if isinstance(x, tuple) else x
