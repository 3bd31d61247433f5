"""The torch references of the tests on every supported torch (>= 2.5): functions that newer
releases have and older ones spell differently or lack.

- ``get_total_norm(tensors, norm_type=2.0)``: ``torch.nn.utils.get_total_norm`` (torch >= 2.6);
  before it, the same norm: the ``norm_type``-norm of the per-tensor norms.
- ``fully_shard``: FSDP2's entry point, ``torch.distributed.fsdp.fully_shard`` (torch >= 2.6),
  ``torch.distributed._composable.fsdp.fully_shard`` before.
- ``needs_fsdp2_on_cpu``: a skip marker for tests that run FSDP2 on CPU tensors over gloo. torch
  2.5's FSDP2 raises "FSDP requires CUDA for streams" there; torch 2.7.1's sums the gradients
  over the data-parallel ranks instead of averaging them (pytorch/pytorch#162338: gloo had no
  AVG reduce-scatter), measured with plain FSDP2 and no tpx. 2.13 and 2.15 average; the
  releases between 2.7 and 2.13 were not run, so the tests ask for 2.13.
- ``torch_replicated_io_style()``: a PyTorch style that leaves a module's replicated input and
  output as they are: ``PrepareModuleInputOutput`` (torch >= 2.6), ``PrepareModuleInput`` of
  the input alone before. ``needs_prepare_module_input_output``: a skip marker for tests that
  need the former.
- ``SHARD_HAS_LOCAL_SIZE``: whether torch's ``Shard`` has ``local_shard_size_and_offset``
  (torch >= 2.6). transformers 5.18 (the newest whose models import on torch 2.5) calls it
  to load weights into ``DTensor`` parameters (peft's ``load_adapter`` on a TP model), so
  that fails on torch 2.5 with PyTorch's TP and tpx alike.
- ``norm_partial_adds_scalar_per_rank(mesh)``: whether this torch adds a Python scalar to each
  rank's partial of a sharded ``DTensor``'s norm instead of once to the norm (torch 2.5;
  pytorch/pytorch#149768, fixed later), a collective over ``mesh``. Its
  ``clip_grad_norm_`` then scales a tensor-parallel model's gradients by
  ``max_norm / (norm + e)`` with ``e`` a little more than its ``1e-6`` (PyTorch's TP and tpx
  alike, both measured on torch 2.5.1: 1.5e-8 relative from one device at a norm of 27).
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["TORCH_VERSION", "get_total_norm", "fully_shard", "needs_fsdp2_on_cpu",
           "torch_replicated_io_style", "needs_prepare_module_input_output",
           "norm_partial_adds_scalar_per_rank", "SHARD_HAS_LOCAL_SIZE"]


def _total_norm(tensors, norm_type: float = 2.0) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(t, float(norm_type)) for t in tensors]
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), float(norm_type))


get_total_norm = getattr(torch.nn.utils, "get_total_norm", _total_norm)

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

# (major, minor) of the installed torch.
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

needs_fsdp2_on_cpu = pytest.mark.skipif(
    TORCH_VERSION < (2, 13),
    reason=f"torch {torch.__version__}: FSDP2 (fully_shard) on CPU/gloo before torch 2.13 "
           "either needs CUDA streams (2.5) or sums the data-parallel gradients instead of "
           "averaging them (2.7.1, pytorch/pytorch#162338), without tpx too")


def _torch_tp():
    import torch.distributed.tensor.parallel as tp

    return tp


needs_prepare_module_input_output = pytest.mark.skipif(
    not hasattr(_torch_tp(), "PrepareModuleInputOutput"),
    reason=f"torch {torch.__version__} has no PrepareModuleInputOutput (torch >= 2.6)")


def torch_replicated_io_style():
    from torch.distributed.tensor import Replicate as R

    tp = _torch_tp()
    if hasattr(tp, "PrepareModuleInputOutput"):
        return tp.PrepareModuleInputOutput(input_layouts=R(), desired_input_layouts=R(),
                                           use_local_input=True, output_layouts=R(),
                                           desired_output_layouts=R(), use_local_output=True)
    return tp.PrepareModuleInput(input_layouts=R(), desired_input_layouts=R(),
                                 use_local_output=True)


def _shard_has_local_size() -> bool:
    from torch.distributed.tensor import Shard

    return hasattr(Shard, "local_shard_size_and_offset")


SHARD_HAS_LOCAL_SIZE = _shard_has_local_size()


def norm_partial_adds_scalar_per_rank(mesh) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor

    if mesh.size() < 2:
        return False
    x = distribute_tensor(torch.ones(2 * mesh.size(), dtype=torch.float64), mesh, [Shard(0)])
    norm = torch.linalg.vector_norm(x)
    return abs(float((norm + 1.0).full_tensor()) - (float(norm.full_tensor()) + 1.0)) > 1e-9
