"""The package imports and describes its build."""

import torch

import tpx


def test_version_and_build_info():
    assert isinstance(tpx.__version__, str) and tpx.__version__.count(".") == 2
    info = tpx.build_info()
    assert set(info) >= {"cuda", "torch_version", "default_chunks", "version"}
    assert isinstance(info["cuda"], bool)
    assert info["default_chunks"] >= 1
    # The extension was compiled against the torch that runs it (same major.minor).
    assert torch.__version__.startswith(".".join(info["torch_version"].split(".")[:2]))


def test_ops_are_registered():
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                 "replicated_matmul", "all_gather_matmul_backward",
                 "matmul_reduce_scatter_backward", "replicated_matmul_backward"):
        assert hasattr(torch.ops.tpx, name), name
