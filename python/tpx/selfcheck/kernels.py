"""The CUDA-kernel checks of ``python -m tpx.selfcheck``: each kernel of tpx against the ATen
computation in fp32, bf16 and fp16, and its achieved memory bandwidth."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

import tpx

from .cases import DTYPE_NAME, Comparison, Inputs, Report, fresh_leaf


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
    ref_in = fresh_leaf(x.float())
    ref = F.cross_entropy(ref_in, target, reduction="none", label_smoothing=eps)
    ref.backward(g)
    if which == "vocab_parallel_cross_entropy":
        loss, lse = tpx.ops.vocab_parallel_cross_entropy_rows(x, target, 0, V, pg,
                                                              label_smoothing=eps)
        c.close("loss", loss, ref)  # fp32 arithmetic on the rounded logits: fp32 tolerance
        c.close("lse", lse, torch.logsumexp(x.float(), 1))
    elif which.endswith("_"):  # in place: contiguous logits, overwritten by their gradient
        leaf = fresh_leaf(x.contiguous())
        loss, _ = tpx.ops.vocab_parallel_cross_entropy_rows(
            leaf * 1, target, 0, V, pg, label_smoothing=eps, inplace_backward=True)
        loss.backward(g)
        c.close("grad logits", leaf.grad, ref_in.grad, dtype)
    else:  # out of place, on the strided logits themselves
        leaf = fresh_leaf(buf)
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
    ref_w = fresh_leaf(table.float())
    F.embedding(ids, ref_w, padding_idx=5).backward(gy.float())
    w = fresh_leaf(table)
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
    fh, fw = fresh_leaf(hidden), fresh_leaf(weight)
    ref = F.cross_entropy((fh @ fw.t()).float(), target, reduction="none")
    ref.backward(g)
    h, w = fresh_leaf(hidden), fresh_leaf(weight)
    loss, _ = tpx.ops.linear_cross_entropy_rows(h, w, target, 0, V, pg, chunk_size=8)
    if which == "linear_cross_entropy":
        c.close("loss", loss, ref, dtype)
    else:
        loss.backward(g)
        c.close("grad hidden", h.grad, fh.grad, dtype)
        c.close("grad weight", w.grad, fw.grad, dtype)


def kernel_checks(rep: Report, inp: Inputs, pg, device: str, kernels: List[str], *,
                  bandwidth: bool = True) -> None:
    """Each kernel of ``kernels`` against ATen in fp32, bf16 and fp16; with ``bandwidth`` also
    its achieved memory bandwidth at one large shape (a GPU timing: ``False`` runs only the
    numerics, e.g. on CPU tensors through the ATen path)."""
    sec = "CUDA kernel"
    for which in kernels:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            dn = DTYPE_NAME[dtype]
            if which.startswith("vocab_parallel_cross_entropy"):
                for V in (1003, 5001):  # the warp-per-row and the block-per-row kernels
                    def fn(c, dtype=dtype, V=V, which=which):
                        _kernel_ce(c, inp, pg, dtype, which, V)
                        if bandwidth and V == 5001 and not which.endswith("_"):
                            return _kernel_ce_bandwidth(inp, pg, dtype, which)
                    rep.run(sec, f"{which} V={V}", device, dn, fn)
            elif which.startswith("vocab_parallel_embedding"):
                modes = (False, True) if which.endswith("backward") else (False,)
                for deterministic in modes:
                    for D in (7, 64, 256):
                        def fn(c, dtype=dtype, D=D, det=deterministic, which=which):
                            _kernel_embedding(c, inp, pg, dtype, which, D, det)
                            if bandwidth and D == 256 and not det:
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
