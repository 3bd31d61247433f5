"""``python -m tpx.selfcheck``: does tpx work on this machine?

Prints the versions (tpx, torch, CUDA, NCCL), the GPUs and how tpx was built, then checks:

- on a GPU: every CUDA kernel of tpx (``tpx.build_info()["cuda_kernels"]``) against the ATen
  computation (``torch.nn.functional``) on odd shapes in fp32, bf16 and fp16 (max error,
  pass/fail), and its achieved memory bandwidth (GB/s) at one large shape;
- every op of ``tpx.ops`` and every layer of ``tpx.nn`` against the unsharded PyTorch
  computation, forward and all gradients, on fresh random inputs, over the process group:
  world size 1 as a single process, N ranks under ``torchrun --nproc-per-node N`` (NCCL on
  N GPUs; gloo on the CPU when there is no GPU per rank);
- on 2 or more GPUs: the fraction of the communication hidden by the overlapped all-gather +
  GEMM and GEMM + reduce-scatter at one mid-size shape (bf16).

A table goes to stdout (rank 0); ``--json PATH`` also writes the results as JSON. The exit
status is 1 if any check fails on any rank, 0 otherwise.

    python -m tpx.selfcheck                                # one process: world size 1
    torchrun --nproc-per-node 8 -m tpx.selfcheck --json selfcheck.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
from tpx.sharding import local_of

NO_GPU = "no GPU found: CUDA kernels not checked"

# (rtol, atol) of the comparisons with the unsharded computation.
_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1.6e-2, 1e-2),
        torch.float16: (1e-3, 1e-3)}
_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


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
        rtol, atol = (0.0, 0.0) if exact else _TOL[dtype]
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


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------
# Ops (tpx.ops) against the unsharded computation, at the world size of the group.

def _check_all_gather_matmul(c: Comparison, inp: Inputs, pg, chunks) -> None:
    world, rank = pg.size(), dist.get_rank(pg)
    k, n, s = 16, 5 * world + 1, 3  # n does not divide: uneven column shards
    c0, c1 = tpx.shard_range(n, pg)
    full_a, B, bias = inp.randn(2, world * s, k), inp.randn(k, n), inp.randn(n)
    gy, gag = inp.randn(2, world * s, n), inp.randn(2, world * s, k)
    fa, fB, fb = _leaf(full_a), _leaf(B), _leaf(bias)
    ref = fa @ fB + fb
    ((ref * gy).sum() + world * (fa * gag).sum()).backward()
    a, w, b = _leaf(full_a[:, rank * s:(rank + 1) * s]), _leaf(B[:, c0:c1].t()), _leaf(bias[c0:c1])
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
    fA, fB, fb = _leaf(A), _leaf(B), _leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = _leaf(A[..., k0:k1]), _leaf(B[k0:k1]), _leaf(bias)
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
    fA, fB, fb = _leaf(A), _leaf(B), _leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = _leaf(A[..., k0:k1]), _leaf(B[k0:k1].t()), _leaf(bias)
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
    fA, fB, fb = _leaf(A), _leaf(B), _leaf(bias)
    ref = fA @ fB + fb
    (ref * gy).sum().backward()
    a, w, b = _leaf(A), _leaf(B[:, c0:c1]), _leaf(bias[c0:c1])
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
    ref_in = _leaf(full)
    ref = F.cross_entropy(ref_in, target, reduction="none", label_smoothing=eps)
    ref.backward(g)
    leaf = _leaf(full[:, v0:v1])
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
    ref_w = _leaf(table)
    ref = F.embedding(ids, ref_w)
    (ref * gy).sum().backward()
    w = _leaf(table[v0:v1])
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
    fh, fw, fb = _leaf(hidden), _leaf(weight), _leaf(bias)
    ref = F.cross_entropy(fh @ fw.t() + fb, target, reduction="none", label_smoothing=0.05)
    ref.backward(g)
    h, w, b = _leaf(hidden), _leaf(weight[v0:v1]), _leaf(bias[v0:v1])
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
    fx = _leaf(x)
    ref = ref_layer(fx)
    (ref * gy).sum().backward()
    o0, o1 = tpx.shard_range(fout, pg)
    mine = slice(rank * 2, rank * 2 + 2)
    xl = _leaf(x[:, mine] if mode == "sequence_parallel" else x)
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
    fx = _leaf(x)
    ref = ref_layer(fx)
    (ref * gy).sum().backward()
    i0, i1 = tpx.shard_range(fin, pg)
    xl = _leaf(x[..., i0:i1])
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
    fx, xl = _leaf(x), _leaf(x)
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
    ref_in = _leaf(full)
    ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), label_smoothing=0.1)
    ref.backward()
    x = _leaf(full[..., v0:v1])
    loss = tpx.VocabParallelCrossEntropyLoss(label_smoothing=0.1, group=pg, vocab_size=V)(
        x, target)
    c.close("loss", loss, ref)
    loss.backward()
    c.close("grad logits", x.grad, ref_in.grad[..., v0:v1])


def _check_linear_ce(c: Comparison, inp: Inputs, pg) -> None:
    V, d = 47 * pg.size() + 5, 8
    v0, v1 = tpx.shard_range(V, pg)
    hidden, weight, target = inp.randn(2, 6, d), inp.randn(V, d, scale=0.5), inp.randint(V, 2, 6)
    fh, fw = _leaf(hidden), _leaf(weight)
    ref = F.cross_entropy((fh @ fw.t()).reshape(-1, V), target.reshape(-1))
    ref.backward()
    h, w = _leaf(hidden), _leaf(weight[v0:v1])
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
# CUDA kernels (GPU only): each rank checks its own GPU through a group of its own (world 1),
# so the ops run their per-shard kernels on the whole vocabulary.

def _gbps(fn: Callable[[], object], nbytes: int, repeats: int = 10) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    return f"{nbytes / seconds / 1e9:.0f} GB/s"


def _kernel_ce(c: Comparison, inp: Inputs, pg, dtype, which: str, V: int) -> Optional[str]:
    N, eps = 37, 0.1
    full = inp.randn(N, V, scale=3.0)
    full[0] = torch.linspace(-20, 20, V, device=full.device)  # the max grows at every column
    target, g = inp.randint(V, N), inp.randn(N)
    target[::5] = -100
    # Row stride V + 3, rows starting one element into the buffer: no row 16-byte aligned.
    buf = torch.zeros(N, V + 3, device=full.device, dtype=dtype)
    x = buf[:, 1:V + 1]
    x.copy_(full)
    ref_in = _leaf(x.float())
    ref = F.cross_entropy(ref_in, target, reduction="none", label_smoothing=eps)
    ref.backward(g)
    if which == "vocab_parallel_cross_entropy":
        loss, lse = tpx.ops.vocab_parallel_cross_entropy_rows(x, target, 0, V, pg,
                                                              label_smoothing=eps)
        c.close("loss", loss, ref)  # fp32 arithmetic on the rounded logits: fp32 tolerance
        c.close("lse", lse, torch.logsumexp(x.float(), 1))
    elif which.endswith("_"):  # in place: contiguous logits, overwritten by their gradient
        leaf = _leaf(x.contiguous())
        loss, _ = tpx.ops.vocab_parallel_cross_entropy_rows(
            leaf * 1, target, 0, V, pg, label_smoothing=eps, inplace_backward=True)
        loss.backward(g)
        c.close("grad logits", leaf.grad, ref_in.grad, dtype)
    else:  # out of place, on the strided logits themselves
        leaf = _leaf(buf)
        loss, _ = tpx.ops.vocab_parallel_cross_entropy_rows(leaf[:, 1:V + 1], target, 0, V, pg,
                                                            label_smoothing=eps)
        loss.backward(g)
        c.close("grad logits", leaf.grad[:, 1:V + 1], ref_in.grad, dtype)
    return None


def _kernel_ce_bandwidth(inp: Inputs, pg, dtype, which: str) -> str:
    N, V = 4096, 32000
    dev = inp.device  # drawn on the GPU: only the timing matters here
    x = torch.randn(N, V, device=dev, dtype=dtype)
    x.requires_grad_(which != "vocab_parallel_cross_entropy")
    target, g = torch.randint(0, V, (N,), device=dev), torch.randn(N, device=dev)
    nbytes = N * V * x.element_size()
    if which == "vocab_parallel_cross_entropy":
        with torch.no_grad():
            return _gbps(lambda: tpx.ops.vocab_parallel_cross_entropy_rows(x, target, 0, V, pg),
                         nbytes) + f" ({N}x{V})"
    loss, _ = tpx.ops.vocab_parallel_cross_entropy_rows(x, target, 0, V, pg)
    # Out of place: the logits read and the gradient written.
    return _gbps(lambda: torch.autograd.grad(loss, x, g, retain_graph=True),
                 2 * nbytes) + f" ({N}x{V})"


def _kernel_embedding(c: Comparison, inp: Inputs, pg, dtype, which: str, D: int,
                      deterministic: bool) -> None:
    V = 1003
    table = inp.randn(V, D + 3, dtype=dtype)[:, 1:D + 1]  # strided rows
    ids = inp.randint(40, 6, 35)  # few distinct ids: many repeats per row
    ids.view(-1)[::7] = inp.randint(V, ids.view(-1)[::7].numel())
    ids.view(-1)[1::5] = 5
    gy = inp.randn(6, 35, D, dtype=dtype)
    if which == "vocab_parallel_embedding":
        c.close("out", tpx.ops.vocab_parallel_embedding(table, ids, 0, pg), F.embedding(ids, table),
                exact=True)
        return
    ref_w = _leaf(table.float())
    F.embedding(ids, ref_w, padding_idx=5).backward(gy.float())
    w = _leaf(table)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        tpx.ops.vocab_parallel_embedding(w, ids, 0, pg, padding_idx=5).backward(gy)
    finally:
        torch.use_deterministic_algorithms(was)
    c.close("grad weight", w.grad, ref_w.grad, dtype)


def _kernel_embedding_bandwidth(inp: Inputs, pg, dtype, which: str) -> str:
    V, D, T = 32000, 4096, 8192
    dev = inp.device  # drawn on the GPU: only the timing matters here
    table = torch.randn(V, D, device=dev, dtype=dtype)
    table.requires_grad_(which != "vocab_parallel_embedding")
    ids = torch.randint(0, V, (T,), device=dev)
    esize = table.element_size()
    if which == "vocab_parallel_embedding":
        with torch.no_grad():  # rows read and written
            return _gbps(lambda: tpx.ops.vocab_parallel_embedding(table, ids, 0, pg),
                         2 * T * D * esize) + f" ({T} ids, D={D})"
    out = tpx.ops.vocab_parallel_embedding(table, ids, 0, pg)
    gy = torch.randn_like(out)
    # The output gradient read and the whole table gradient written.
    return _gbps(lambda: torch.autograd.grad(out, table, gy, retain_graph=True),
                 (T * D + V * D) * esize) + f" ({T} ids, V={V}, D={D})"


def _kernel_linear_ce(c: Comparison, inp: Inputs, pg, dtype, which: str) -> None:
    V, N, d = 1003, 29, 64
    hidden, weight = inp.randn(N, d, dtype=dtype), inp.randn(V, d, dtype=dtype, scale=0.2)
    target, g = inp.randint(V, N), inp.randn(N)
    target[::6] = -100
    fh, fw = _leaf(hidden), _leaf(weight)
    ref = F.cross_entropy((fh @ fw.t()).float(), target, reduction="none")
    ref.backward(g)
    h, w = _leaf(hidden), _leaf(weight)
    loss, _ = tpx.ops.linear_cross_entropy_rows(h, w, target, 0, V, pg, chunk_size=8)
    if which == "linear_cross_entropy":
        c.close("loss", loss, ref, dtype)
    else:
        loss.backward(g)
        c.close("grad hidden", h.grad, fh.grad, dtype)
        c.close("grad weight", w.grad, fw.grad, dtype)


def kernel_checks(rep: Report, inp: Inputs, pg, device: str, kernels: List[str]) -> None:
    sec = "CUDA kernel"
    for which in kernels:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            dn = _DTYPE_NAME[dtype]
            if which.startswith("vocab_parallel_cross_entropy"):
                for V in (1003, 5001):  # the warp-per-row and the block-per-row kernels
                    def fn(c, dtype=dtype, V=V, which=which):
                        _kernel_ce(c, inp, pg, dtype, which, V)
                        if V == 5001 and not which.endswith("_"):
                            return _kernel_ce_bandwidth(inp, pg, dtype, which)
                    rep.run(sec, f"{which} V={V}", device, dn, fn)
            elif which.startswith("vocab_parallel_embedding"):
                modes = (False, True) if which.endswith("backward") else (False,)
                for deterministic in modes:
                    for D in (7, 64, 256):
                        def fn(c, dtype=dtype, D=D, det=deterministic, which=which):
                            _kernel_embedding(c, inp, pg, dtype, which, D, det)
                            if D == 256 and not det:
                                return _kernel_embedding_bandwidth(inp, pg, dtype, which)
                        name = f"{which} D={D}" + (" deterministic" if deterministic else "")
                        rep.run(sec, name, device, dn, fn)
            elif which.startswith("linear_cross_entropy"):
                # GEMM-bound: checked for its numbers, no bandwidth reported.
                rep.run(sec, which, device, dn,
                        lambda c, dtype=dtype, which=which: _kernel_linear_ce(c, inp, pg, dtype,
                                                                              which))
            else:
                rep.add(sec, which, device, dn, status="skip",
                        note="no check for this kernel in this tpx.selfcheck")


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


# ---------------------------------------------------------------------------------------------
# The environment, the process group, the table.

def environment(backend: str, device: str, world: int) -> dict:
    info = tpx.build_info()
    env = dict(tpx=tpx.__version__, tpx_path=os.path.dirname(os.path.abspath(tpx.__file__)),
               tpx_build=info, torch=torch.__version__, torch_cuda=torch.version.cuda,
               nccl=None, python=platform.python_version(), platform=platform.platform(),
               backend=backend, device=device, world_size=world, gpus=[])
    if torch.version.cuda is not None and dist.is_nccl_available():
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append(dict(index=i, name=p.name, capability=f"{p.major}.{p.minor}",
                                    memory_gib=round(p.total_memory / 2 ** 30, 1)))
    return env


def _init_group(timeout_s: float):
    """Joins torchrun's group, or creates a world-1 group of this process. Returns
    ``(backend, device, created, note)``."""
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=timeout_s)
    note = ""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if cuda and torch.cuda.device_count() >= local_world:
            torch.cuda.set_device(local_rank)
            backend, device = "nccl", f"cuda:{local_rank}"
        else:
            if cuda:
                note = (f"{local_world} ranks on this node but {torch.cuda.device_count()} GPUs: "
                        "running on the CPU over gloo")
            backend, device = "gloo", "cpu"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout)
            return backend, device, True, note
        return dist.get_backend(), device, False, note
    if dist.is_initialized():
        return dist.get_backend(), "cuda" if cuda else "cpu", False, note
    backend, device = ("nccl", "cuda:0") if cuda else ("gloo", "cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)
    return backend, device, True, note


def _merge(all_rows: List[List[dict]]) -> List[dict]:
    """One row per check: the worst status and largest error over the ranks."""
    merged: dict = {}
    for rank, rows in enumerate(all_rows):
        for r in rows:
            key = (r["section"], r["check"], r["device"], r["dtype"])
            m = merged.get(key)
            if m is None:
                m = merged[key] = dict(r, failed_ranks=[])
            else:
                if r["max_err"] is not None:
                    m["max_err"] = max(m["max_err"] or 0.0, r["max_err"])
                if r["status"] == "FAIL" and m["status"] != "FAIL":
                    m["status"], m["note"] = "FAIL", r["note"]
            if r["status"] == "FAIL":
                m["failed_ranks"].append(rank)
    return list(merged.values())


def format_table(rows: List[dict]) -> str:
    headers = ["section", "check", "device", "dtype", "max err", "tolerance", "measured",
               "result"]
    cells = [[r["section"], r["check"], r["device"], r["dtype"],
              "" if r["max_err"] is None else f"{r['max_err']:.2e}", r["tol"], r["measure"],
              r["status"] + (f" on ranks {r['failed_ranks']}" if r.get("failed_ranks") and
                             len(r["failed_ranks"]) < 64 and r["status"] == "FAIL" else "")]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *cells)]

    def line(cs):
        return "  ".join(str(x).ljust(w) for x, w in zip(cs, widths)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])] + [line(cs) for cs in cells]
    for r in rows:
        if r["status"] == "FAIL" and r["note"]:
            out.append(f"FAIL {r['section']} / {r['check']} ({r['dtype']}): {r['note']}")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tpx.selfcheck", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random inputs (default: a fresh one, printed)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for the other ranks (default 300)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    backend, device, created, note = _init_group(args.timeout)
    try:
        code = _run(args, backend, device, note, t0)
        if created:
            tpx.end_run()  # barrier, a pause for gloo's threads, then the groups destroyed
        return code
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run(args, backend: str, device: str, note: str, t0: float) -> int:
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = [args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")]
    dist.broadcast_object_list(seed, src=0)
    seed = seed[0]
    env = environment(backend, device, world)
    notes = [note] if note else []
    rep = Report()
    info = env["tpx_build"]
    dev_kind = "cuda" if device.startswith("cuda") else "cpu"
    inp = Inputs(seed, torch.device(device))

    # The kernels: on every GPU, each rank in a world-1 group of its own.
    kernels_checked = False
    if dev_kind == "cuda":
        mine, _ = dist.new_subgroups(1) if world > 1 else (pg, None)
        if not info["cuda"]:
            notes.append("this tpx was built without its CUDA kernels (CPU-only build): the "
                         "ops run ATen kernels on the GPU; rebuild with TPX_CUDA=1")
            rep.add("CUDA kernel", "(not built)", device, status="skip",
                    note="tpx built without CUDA")
        else:
            kernel_checks(rep, Inputs(seed + 1, torch.device(device)), mine, device,
                          list(info["cuda_kernels"]))
            kernels_checked = True
    else:
        notes.append(NO_GPU)

    op_checks(rep, inp, pg, dev_kind)
    layer_checks(rep, inp, pg, dev_kind)
    if dev_kind == "cuda" and world > 1 and backend == "nccl":
        overlap_checks(rep, pg, dev_kind)
    else:
        why = "needs 2 or more GPUs under torchrun (NCCL)"
        notes.append(f"communication overlap not measured: {why}")

    gathered: List = [None] * world
    dist.all_gather_object(gathered, rep.rows)
    rows = _merge(gathered)
    ok = all(r["status"] != "FAIL" for r in rows)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        _print_report(env, rows, notes, seed, ok, elapsed, kernels_checked)
        if args.json:
            payload = dict(ok=ok, seed=seed, elapsed_s=round(elapsed, 2), environment=env,
                           cuda_kernels_checked=kernels_checked, notes=notes, checks=rows)
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
            print(f"results written to {args.json}")
    return 0 if ok else 1


def _print_report(env, rows, notes, seed, ok, elapsed, kernels_checked) -> None:
    info = env["tpx_build"]
    gpus = ", ".join(f"{g['index']}: {g['name']} (sm_{g['capability'].replace('.', '')}, "
                     f"{g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
    print(f"tpx {env['tpx']} ({env['tpx_path']})")
    print(f"  built: {'with CUDA kernels' if info['cuda'] else 'CPU-only (no CUDA kernels)'}"
          f" against torch {info['torch_version']}; CUDA kernels: "
          f"{', '.join(info['cuda_kernels']) or 'none'}")
    print(f"torch {env['torch']}  CUDA {env['torch_cuda'] or 'none (CPU build of torch)'}  "
          f"NCCL {env['nccl'] or 'none'}  Python {env['python']}  {env['platform']}")
    print(f"GPUs: {gpus}")
    print(f"process group: {env['backend']}, world size {env['world_size']}, "
          f"device {env['device']}; inputs seed {seed} (rerun with --seed {seed})")
    print()
    print(format_table(rows))
    print()
    for n in notes:
        print(n)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "skip")}
    checked = ("CUDA kernels, ops and layers" if kernels_checked else "ops and layers")
    print(f"{'OK' if ok else 'MISMATCH'}: {counts['pass']} passed, {counts['FAIL']} failed, "
          f"{counts['skip']} skipped ({checked} checked at world size {env['world_size']}) "
          f"in {elapsed:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
