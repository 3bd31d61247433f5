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
