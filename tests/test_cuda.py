"""The same numerics on CUDA tensors. Skipped where torch sees no GPU.

World size 1 runs over NCCL; larger world sizes run several ranks on the one GPU over gloo
with CUDA tensors (NCCL refuses two ranks on one device), which exercises the CUDA code paths
and stream ordering, not speed."""

import pytest
import torch

import tpx
from harness import run_ranks
from test_autocast import _check_llama
from test_linear import _check_mlp
from test_ops import _check_all_ops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_cuda(check):
    def run(rank, world):
        torch.cuda.set_device(0)
        check(rank, world, "cuda")
    return run


def _ops_cuda(rank, world):
    _on_cuda(_check_all_ops)(rank, world)


def _mlp_cuda(rank, world):
    _on_cuda(_check_mlp)(rank, world)


def test_ops_cuda_nccl_world1():
    run_ranks(_ops_cuda, 1, backend="nccl")


def test_mlp_cuda_nccl_world1():
    run_ranks(_mlp_cuda, 1, backend="nccl")


@pytest.mark.parametrize("world", [2, 3])
def test_ops_cuda_gloo(world):
    run_ranks(_ops_cuda, world, backend="gloo")


@pytest.mark.parametrize("world", [2])
def test_mlp_cuda_gloo(world):
    run_ranks(_mlp_cuda, world, backend="gloo")


def _llama_cuda(rank, world):
    _on_cuda(_check_llama)(rank, world)


def test_llama_cuda_gloo_world2():
    """The decoder sharded by tpx.plans.auto against the unsharded one on the GPU, float32 and
    bf16 autocast (tests/test_autocast.py), two ranks on the one GPU."""
    run_ranks(_llama_cuda, 2, backend="gloo")


def test_llama_cuda_nccl_world1():
    run_ranks(_llama_cuda, 1, backend="nccl")


def test_build_has_cuda():
    assert tpx.build_info()["cuda"], "torch sees a GPU but tpx was built without CUDA"


def _vocab_ops_cuda(rank, world):
    """Cross-entropy, fused head + loss and embedding on CUDA tensors against torch."""
    import torch.nn.functional as F
    from torch import nn

    torch.cuda.set_device(0)
    dev = "cuda"
    V, d = 1003, 16
    v0, v1 = tpx.shard_range(V)
    gen = torch.Generator().manual_seed(5)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        full = torch.randn(12, V, generator=gen).to(dev, dtype)
        target = torch.randint(0, V, (12,), generator=gen).to(dev)
        target[::5] = -100
        # detach(): for float32, .float() is `full` itself, which must stay a plain input.
        ref_in = full.detach().float().requires_grad_(True)
        ref = F.cross_entropy(ref_in, target, label_smoothing=0.1)
        ref.backward()
        x = full[:, v0:v1].clone().requires_grad_(True)
        loss = tpx.vocab_parallel_cross_entropy(x, target, label_smoothing=0.1, vocab_size=V)
        loss.backward()
        torch.testing.assert_close(loss.float(), ref.detach(), rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.float(), ref_in.grad[:, v0:v1], rtol=tol, atol=tol)
    hidden = torch.randn(12, d, generator=gen).to(dev)
    weight = torch.randn(V, d, generator=gen).to(dev)
    ref = F.cross_entropy(hidden @ weight.t(), target)
    got = tpx.linear_cross_entropy(hidden, weight[v0:v1].contiguous(), target, chunk_size=5,
                                   vocab_size=V)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.manual_seed(0)
    emb_ref = nn.Embedding(V, d, padding_idx=2).to(dev)
    emb = tpx.VocabParallelEmbedding.from_embedding(emb_ref)
    ids = torch.randint(0, V, (3, 4), generator=gen).to(dev)
    torch.testing.assert_close(emb(ids), emb_ref(ids))


def test_vocab_ops_cuda_nccl_world1():
    run_ranks(_vocab_ops_cuda, 1, backend="nccl")


def test_vocab_ops_cuda_gloo_world2():
    run_ranks(_vocab_ops_cuda, 2, backend="gloo")


# The tpx CUDA kernels against torch, at world size 1 ----------------------------------------
#
# The checks take the device as an argument so that the same code can be run on CPU tensors
# (through the ATen path) to validate the references themselves.

_LOW_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
            torch.float16: dict(rtol=1e-3, atol=1e-5)}


def _strided_copy(x, pad_left=1, pad_right=2):
    """The same values with a row stride of width + 3 and rows starting 1 element past the
    buffer's start: no row is 16-byte aligned the same way as the next."""
    buf = torch.empty(x.shape[0], x.shape[1] + pad_left + pad_right, dtype=x.dtype,
                      device=x.device)
    buf.normal_()
    out = buf[:, pad_left:pad_left + x.shape[1]]
    out.copy_(x)
    return out


def _ce_reference(xs, target, v0, vocab_size, ignore_index, eps, g):
    """Per-row loss, lse and gradient of a shard xs [N, W] (columns [v0, v0 + W) of the
    vocabulary) at world size 1, in fp64: the statistics of this shard alone."""
    x = xs.double()
    lse = torch.logsumexp(x, 1)
    local = target - v0
    held = (local >= 0) & (local < x.shape[1]) & (target != ignore_index)
    idx = torch.where(held, local, torch.zeros_like(local))
    xt = torch.where(held, x.gather(1, idx[:, None])[:, 0], torch.zeros_like(lse))
    loss = lse - (1 - eps) * xt
    if eps > 0:
        loss = loss - eps / vocab_size * x.sum(1)
    ignored = target == ignore_index
    loss = loss.masked_fill(ignored, 0)
    gg = g.double().masked_fill(ignored, 0)
    onehot = torch.zeros_like(x).scatter_(1, idx[:, None], held.double()[:, None])
    grad = gg[:, None] * ((x - lse[:, None]).exp() - eps / vocab_size - (1 - eps) * onehot)
    return loss, lse, grad


def _check_ce_kernels(rank, world, dev):
    import torch.nn.functional as F
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(11)
    # 1003 and 5001 are no multiple of 8; 1003 takes the warp-per-row kernel, 5001 the
    # block-per-row one.
    for dtype, V, strided, eps, ignore_index in [
            (torch.float32, 1003, False, 0.0, -100), (torch.float32, 1003, True, 0.1, -100),
            (torch.float32, 5001, False, 0.1, 7), (torch.float32, 5001, True, 0.0, -100),
            (torch.bfloat16, 1003, True, 0.1, -100), (torch.bfloat16, 5001, False, 0.0, 7),
            (torch.float16, 1003, False, 0.0, -100), (torch.float16, 5001, True, 0.1, -100)]:
        case = f"dtype={dtype} V={V} strided={strided} eps={eps} ignore_index={ignore_index}"
        N = 37
        full = 3 * torch.randn(N, V, generator=gen)
        full[0] = torch.linspace(-20, 20, V)  # the max grows at every element
        full[1] = -torch.linspace(-20, 20, V)
        target = torch.randint(0, V, (N,), generator=gen)
        target[::5] = ignore_index
        target[2] = V - 1
        if eps == 0.0:  # masked logits (smoothing would make the loss infinite)
            full[3, 1::2] = float("-inf")
            target[3] = 0
        x = full.to(dev, dtype)
        target = target.to(dev)
        if strided:
            x = _strided_copy(x)
        g = torch.randn(N, generator=gen).to(dev)
        kw = dict(ignore_index=ignore_index, label_smoothing=eps)

        # The whole vocabulary: against F.cross_entropy on the same (rounded) logits.
        loss, lse = tpx.ops.vocab_parallel_cross_entropy_rows(x, target, 0, V, **kw)
        ref_in = x.detach().float().requires_grad_(True)  # not `x` itself when float32
        ref = F.cross_entropy(ref_in, target, reduction="none", **kw)
        ref.backward(g)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"loss {case}: {m}")
        torch.testing.assert_close(lse, torch.logsumexp(x.float(), 1), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"lse {case}: {m}")
        args = (target, lse, 0, V, ignore_index, eps)
        grad = torch.ops.tpx.vocab_parallel_cross_entropy_backward(g, x, *args)
        assert grad.dtype == dtype and grad.is_contiguous(), case
        torch.testing.assert_close(grad.float(), ref_in.grad, **_LOW_TOL[dtype],
                                   msg=lambda m: f"grad {case}: {m}")
        # In place, over a contiguous copy: the same numbers as out of place.
        y = x.contiguous().clone()
        torch.ops.tpx.vocab_parallel_cross_entropy_backward_(g, y, *args)
        assert torch.equal(y, grad), f"in-place grad differs from out-of-place grad: {case}"

        # A shard of the vocabulary (unaligned start column): targets outside it are not held.
        v0, v1 = 14, 14 + (V - 14) // 2
        xs = x[:, v0:v1]
        loss, lse = torch.ops.tpx.vocab_parallel_cross_entropy(
            xs, target, v0, V, name, ignore_index, eps, False)
        rl, rlse, rgrad = _ce_reference(xs, target, v0, V, ignore_index, eps, g)
        torch.testing.assert_close(loss.double(), rl, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"shard loss {case}: {m}")
        torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"shard lse {case}: {m}")
        grad = torch.ops.tpx.vocab_parallel_cross_entropy_backward(
            g, xs, target, lse, v0, V, ignore_index, eps)
        torch.testing.assert_close(grad.double(), rgrad, **_LOW_TOL[dtype],
                                   msg=lambda m: f"shard grad {case}: {m}")

    # Through the module-level function with a reduction, in place, bf16.
    V = 1003
    full = 3 * torch.randn(4, 9, V, generator=gen)
    target = torch.randint(0, V, (4, 9), generator=gen)
    target.view(-1)[::4] = -100
    x = full.to(dev, torch.bfloat16)
    target = target.to(dev)
    ref_in = x.float().requires_grad_(True)
    ref = F.cross_entropy(ref_in.view(-1, V), target.view(-1), label_smoothing=0.1)
    ref.backward()
    leaf = x.clone().requires_grad_(True)
    xin = leaf * 1
    loss = tpx.vocab_parallel_cross_entropy(xin, target, label_smoothing=0.1,
                                            inplace_backward=True, vocab_size=V)
    loss.backward()
    torch.testing.assert_close(loss.float(), ref.detach(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(leaf.grad.float(), ref_in.grad, rtol=1.6e-2, atol=1e-2)


def _check_embedding_kernels(rank, world, dev):
    import torch.nn.functional as F
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(12)
    V = 1003
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        for dtype, D, strided, padding_idx in [
                (torch.float32, 8, False, None), (torch.float32, 13, True, 5),
                (torch.float32, 256, False, 5), (torch.bfloat16, 13, False, 5),
                (torch.bfloat16, 256, True, None), (torch.float16, 64, False, 5),
                (torch.float16, 7, True, None)]:
            case = f"dtype={dtype} D={D} strided={strided} padding_idx={padding_idx}"
            full = torch.randn(V, D, generator=gen).to(dev, dtype)
            if strided:
                full = _strided_copy(full)
            # Few distinct ids: many repeats per row.
            ids = torch.randint(0, 40, (6, 35), generator=gen)
            ids.view(-1)[::7] = torch.randint(0, V, (ids.numel() // 7 + 1,),
                                              generator=gen)[: ids.view(-1)[::7].numel()]
            if padding_idx is not None:
                ids.view(-1)[1::5] = padding_idx
            ids = ids.to(dev)
            gy = torch.randn(6, 35, D, generator=gen).to(dev, dtype)
            pad = -1 if padding_idx is None else padding_idx

            out = torch.ops.tpx.vocab_parallel_embedding(full, ids, 0, name, None, pad)
            assert torch.equal(out, F.embedding(ids, full)), f"forward {case}"

            ref_w = full.float().requires_grad_(True)
            F.embedding(ids, ref_w, padding_idx=padding_idx).backward(gy.float())
            results = {}
            for deterministic in (False, True):
                torch.use_deterministic_algorithms(deterministic)
                gw = torch.ops.tpx.vocab_parallel_embedding_backward(gy, ids, 0, V, pad, name,
                                                                    None)
                assert gw.dtype == dtype and gw.shape == (V, D), case
                torch.testing.assert_close(
                    gw.float(), ref_w.grad, **_LOW_TOL[dtype],
                    msg=lambda m: f"grad {case} deterministic={deterministic}: {m}")
                if padding_idx is not None:
                    assert not gw[padding_idx].any(), f"padding row got a gradient: {case}"
                results[deterministic] = gw
            again = torch.ops.tpx.vocab_parallel_embedding_backward(gy, ids, 0, V, pad, name, None)
            assert torch.equal(again, results[True]), f"deterministic grad not reproducible: {case}"
            torch.use_deterministic_algorithms(False)

            # A shard of the table: rows [v0, v1); other ids give zeros and no gradient.
            v0, v1 = 20, 500
            shard = full[v0:v1]
            held = (ids >= v0) & (ids < v1)
            out = torch.ops.tpx.vocab_parallel_embedding(shard, ids, v0, name, None, -1)
            expect = torch.where(held[..., None], F.embedding(ids, full),
                                 torch.zeros((), dtype=dtype, device=dev))
            assert torch.equal(out, expect), f"shard forward {case}"
            local_pad = pad - v0 if padding_idx is not None else -1
            for deterministic in (False, True):
                torch.use_deterministic_algorithms(deterministic)
                gw = torch.ops.tpx.vocab_parallel_embedding_backward(gy, ids, v0, v1 - v0,
                                                                    local_pad, name, None)
                torch.testing.assert_close(
                    gw.float(), ref_w.grad[v0:v1], **_LOW_TOL[dtype],
                    msg=lambda m: f"shard grad {case} deterministic={deterministic}: {m}")
            torch.use_deterministic_algorithms(False)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _kernels_cuda(rank, world):
    torch.cuda.set_device(0)
    _check_ce_kernels(rank, world, "cuda")
    _check_embedding_kernels(rank, world, "cuda")


def test_vocab_kernels_cuda_nccl_world1():
    run_ranks(_kernels_cuda, 1, backend="nccl")


def test_build_reports_cuda_kernels():
    kernels = tpx.build_info()["cuda_kernels"]
    assert {"vocab_parallel_cross_entropy", "vocab_parallel_embedding",
            "vocab_parallel_embedding_backward"} <= set(kernels), kernels
