"""The GEMM under every tpx op (csrc/common/gemm.cpp): oneDNN's matmul for float32 CPU
tensors by default, ATen's with TPX_CPU_GEMM=aten. Both against float64 in every operand
layout the engine passes, the choice itself, and the engine's ops and layers at sizes that
take the oneDNN path, under both backends, against nn.Linear."""

import itertools
import os
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tpx
from harness import local_part, run_ranks

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["aten", "auto"]


@pytest.fixture
def gemm_env(monkeypatch):
    def set_backend(value):
        if value is None:
            monkeypatch.delenv("TPX_CPU_GEMM", raising=False)
        else:
            monkeypatch.setenv("TPX_CPU_GEMM", value)
    return set_backend


def test_backend_choice(gemm_env):
    gemm_env(None)
    default = tpx.ops.cpu_gemm_backend()
    assert default in ("onednn", "aten")
    assert tpx.build_info()["cpu_gemm"] == default
    gemm_env("auto")
    assert tpx.ops.cpu_gemm_backend() == default
    gemm_env("aten")
    assert tpx.ops.cpu_gemm_backend() == "aten"
    gemm_env(None)
    with torch.backends.mkldnn.flags(enabled=False):
        assert tpx.ops.cpu_gemm_backend() == "aten"
    gemm_env("blas")
    with pytest.raises(ValueError, match="TPX_CPU_GEMM must be 'auto', 'aten' or 'onednn'"):
        tpx.ops.cpu_gemm_backend()
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    with pytest.raises(ValueError, match="TPX_CPU_GEMM"):
        tpx.ops.local_matmul(a, b)
    gemm_env("onednn")
    if default == "onednn":
        assert tpx.ops.cpu_gemm_backend() == "onednn"
    else:
        with pytest.raises(RuntimeError, match="TPX_CPU_GEMM=onednn"):
            tpx.ops.cpu_gemm_backend()


def test_auto_takes_aten_for_small_products(gemm_env):
    """Under ``auto`` a product under 2**22 multiply-adds is ATen's, bit for bit (oneDNN's call
    overhead would outweigh its kernel); from there on it is the backend ``auto`` reports."""
    gemm_env(None)
    default = tpx.ops.cpu_gemm_backend()
    gen = torch.Generator().manual_seed(5)
    for m, k, n in ((8, 64, 128), (64, 256, 255)):  # 65536 and 4177920 multiply-adds
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        assert torch.equal(tpx.ops.local_matmul(a, b), torch.mm(a, b)), (m, k, n)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 257, generator=gen)
    out = tpx.ops.local_matmul(a, b)  # 4210688 multiply-adds
    gemm_env(default)
    assert torch.equal(out, tpx.ops.local_matmul(a, b))


def _operand(rows, cols, layout, gen):
    """A [rows, cols] float32 matrix stored row-major, transposed, as a row slice of a larger
    matrix, or with a stride oneDNN cannot read in place (a column slice)."""
    if layout == "row-major":
        return torch.randn(rows, cols, generator=gen)
    if layout == "transposed":
        return torch.randn(cols, rows, generator=gen).t()
    if layout == "row-slice":
        return torch.randn(rows + 5, cols, generator=gen)[3:3 + rows]
    assert layout == "column-slice"
    return torch.randn(rows, cols + 4, generator=gen)[:, 2:2 + cols]


LAYOUTS = ["row-major", "transposed", "row-slice", "column-slice"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,k,n", [(96, 80, 72), (257, 131, 65), (5, 3, 4), (1, 300, 200),
                                   (64, 0, 32)])
def test_local_matmul_matches_float64(gemm_env, backend, m, k, n):
    gemm_env(backend)
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    for la, lb, with_bias in itertools.product(LAYOUTS, LAYOUTS, (False, True)):
        a, b = _operand(m, k, la, gen), _operand(k, n, lb, gen)
        bias = torch.randn(n, generator=gen) if with_bias else None
        out = tpx.ops.local_matmul(a, b, bias)
        ref = a.double() @ b.double() + (0 if bias is None else bias.double())
        # fp32 accuracy: each output is a k-term sum of products of N(0, 1) values.
        tol = 4 * max(k, 1) ** 0.5 * torch.finfo(torch.float32).eps * (1 + ref.abs().max())
        assert out.dtype == torch.float32 and out.shape == (m, n)
        err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        assert err <= tol, f"{backend} a {la} b {lb} bias {with_bias}: error {err} > {tol}"
    # 3-D input, as the layers pass it.
    a3 = torch.randn(2, m, k, generator=gen)
    torch.testing.assert_close(tpx.ops.local_matmul(a3, b), (a3.double() @ b.double()).float(),
                               rtol=1e-5, atol=1e-4)


def test_other_dtypes_and_large_values_use_a_correct_path(gemm_env):
    gemm_env(None)
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(64, 48, generator=gen), torch.randn(48, 40, generator=gen)
    for dtype in (torch.float64, torch.bfloat16):
        out = tpx.ops.local_matmul(a.to(dtype), b.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), a @ b, rtol=2e-2, atol=2e-1)
    # Values far from 1: no scaling or reduced precision inside.
    big = tpx.ops.local_matmul(a * 1e20, b * 1e-18)
    torch.testing.assert_close(big.double(), (a.double() * 1e20) @ (b.double() * 1e-18),
                               rtol=1e-5, atol=1e-3)


def test_every_cpu_gemm_goes_through_the_helper():
    """No translation unit outside csrc/common/gemm.cpp calls ATen's GEMMs directly (the CUDA
    kernels' own launchers excepted): every product of the engine, the fused loss and the
    multi-dimensional layouts uses the selected backend."""
    direct = re.compile(r"at::(mm|addmm|matmul|mm_out|addmm_out|linear)\(|\.(addmm_|mm)\(")
    offenders = []
    for path in sorted((ROOT / "csrc").rglob("*.cpp")):
        if path.name == "gemm.cpp" or path.parent.name == "cuda":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if direct.search(code):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "direct ATen GEMM calls:\n" + "\n".join(offenders)


def _engine_routes(rank, world, backend):
    """The engine's outputs are bit-for-bit those of the selected GEMM."""
    if backend is not None:
        os.environ["TPX_CPU_GEMM"] = backend
    gen = torch.Generator().manual_seed(11)
    a, w = torch.randn(48, 64, generator=gen), torch.randn(40, 64, generator=gen)
    bias = torch.randn(40, generator=gen)
    out = tpx.ops.replicated_matmul(a, w.t(), bias=bias)
    expect = torch.addmm(bias, a, w.t()) if backend == "aten" else \
        tpx.ops.local_matmul(a, w.t(), bias)
    assert torch.equal(out, expect), f"backend {backend}: engine output is not the helper's"


@pytest.mark.parametrize("backend", ["aten", None])
def test_engine_uses_the_selected_gemm(backend):
    run_ranks(_engine_routes, 2, backend)


def _mlp_both_backends(rank, world, backend):
    """column -> ReLU -> row at sizes above the oneDNN threshold, against nn.Linear, every
    combination of gradients, with and without sequence parallelism."""
    os.environ["TPX_CPU_GEMM"] = backend
    torch.manual_seed(5)
    d, h, tokens = 48, 40 * world + 3, 8 * world  # uneven hidden split
    ref1, ref2 = nn.Linear(d, h), nn.Linear(h, d)
    gen = torch.Generator().manual_seed(17)
    x_full, gy = torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen)
    tol = dict(rtol=1e-5, atol=2e-5)
    for sp, chunks, frozen, x_grad in itertools.product((False, True), (1, 2, None),
                                                        (False, True), (True, False)):
        if frozen and not x_grad:
            continue  # nothing to differentiate
        case = f"backend={backend} sp={sp} chunks={chunks} frozen={frozen} x_grad={x_grad}"
        col = tpx.ColumnParallelLinear.from_linear(ref1, sequence_parallel=sp, sequence_dim=0,
                                                   chunks=chunks)
        row = tpx.RowParallelLinear.from_linear(ref2, sequence_parallel=sp, sequence_dim=0,
                                                chunks=chunks)
        for p in list(col.parameters()) + list(row.parameters()):
            p.requires_grad_(not frozen)
        xr = x_full.clone().requires_grad_(True)
        for p in list(ref1.parameters()) + list(ref2.parameters()):
            p.grad = None
        y_ref = ref2(torch.relu(ref1(xr)))
        (y_ref * gy).sum().backward()
        rows = slice(None)
        if sp:
            s = tokens // world
            rows = slice(rank * s, (rank + 1) * s)
        x = x_full[rows].clone().requires_grad_(x_grad)
        y = row(torch.relu(col(x)))
        torch.testing.assert_close(y, y_ref[rows].detach(), **tol, msg=lambda m: f"{case}: {m}")
        (y * gy[rows]).sum().backward()
        if x_grad:
            torch.testing.assert_close(x.grad, xr.grad[rows], **tol)
        else:
            assert x.grad is None
        if frozen:
            assert col.weight.grad is None and row.weight.grad is None
        else:
            c0, c1 = col.out_start, col.out_end
            torch.testing.assert_close(local_part(col.weight.grad), ref1.weight.grad[c0:c1], **tol)
            torch.testing.assert_close(local_part(col.bias.grad), ref1.bias.grad[c0:c1], **tol)
            torch.testing.assert_close(local_part(row.weight.grad), ref2.weight.grad[:, c0:c1], **tol)
            torch.testing.assert_close(local_part(row.bias.grad), ref2.bias.grad, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 3])
def test_layers_match_nn_linear_on_both_gemms(backend, world):
    run_ranks(_mlp_both_backends, world, backend)


def test_local_ops_opcheck():
    """The fake implementations of the two group-free ops agree with their kernels (shapes,
    strides, dtypes; torch.compile traces them)."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 40, 32, generator=gen), torch.randn(32, 24, generator=gen)
    g = torch.randn(6, 40, 24, generator=gen)
    torch.library.opcheck(torch.ops.tpx.local_matmul.default, (a, b, torch.randn(24)))
    torch.library.opcheck(torch.ops.tpx.local_matmul.default, (a[0], b.t().contiguous().t()))
    for need_a, need_b, need_bias in itertools.product((False, True), repeat=3):
        torch.library.opcheck(torch.ops.tpx.matmul_all_reduce_backward.default,
                              (g, a, b, need_a, need_b, need_bias))
    grad_a, grad_b, grad_bias = torch.ops.tpx.matmul_all_reduce_backward(g, a, b, True, True,
                                                                         True)
    g2, a2 = g.reshape(-1, 24).double(), a.reshape(-1, 32).double()
    torch.testing.assert_close(grad_a.double(), (g2 @ b.double().t()).view(a.shape),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_b.double(), a2.t() @ g2, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_bias.double(), g2.sum(0), rtol=1e-5, atol=1e-4)
