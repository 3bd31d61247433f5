"""The same numerics on CUDA tensors. Skipped where torch sees no GPU.

World size 1 runs over NCCL; larger world sizes run several ranks on the one GPU over gloo
with CUDA tensors (NCCL refuses two ranks on one device), which exercises the CUDA code paths
and stream ordering, not speed."""

import pytest
import torch

import tpx
from harness import run_ranks
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
        ref_in = full.float().requires_grad_(True)
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
