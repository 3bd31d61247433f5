"""The boundary with ``torch.distributed.tensor``: DTensors in, DTensors out.

tpx computes on local tensors. A ``DTensor`` handed to a tpx layer is redistributed to the
placement the layer needs and made local (both differentiable, so its gradient comes back as a
``DTensor`` with the input's placement); a style with ``use_local_output=False`` wraps the
layer's local output into a ``DTensor`` with ``DTensor.from_local`` (no communication).

The placements are torch's own classes (``Replicate``, ``Shard``, ``Partial``). tpx splits an
uneven dimension as ``torch.chunk`` does (``tpx.shard_range``: the first ranks hold
``ceil(size / P)``), which is the layout ``Shard(d)`` describes, so the local blocks of a tpx
layer and of a DTensor agree.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.groups import group_ranks, mesh_for_group, remember_mesh  # noqa: F401  (re-exported)

try:  # public since torch 2.5
    from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
except ImportError:  # pragma: no cover - older layout of the same classes
    from torch.distributed._tensor import DTensor, Partial, Placement, Replicate, Shard  # type: ignore

__all__ = ["DTensor", "Partial", "Placement", "Replicate", "Shard", "local_input",
           "mesh_for_group", "remember_mesh", "wrap_output"]


def local_input(x, placement: Placement, pg: dist.ProcessGroup, who: str):
    """``x`` as the local tensor of ``placement`` over ``pg``: a plain tensor is returned as it
    is (it already is this rank's part); a ``DTensor`` on a 1-D mesh over the ranks of ``pg`` is
    redistributed to ``placement`` and made local."""
    if not isinstance(x, DTensor):
        return x
    mesh = x.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"tpx.{who}: the input is a DTensor on a {mesh.ndim}-D mesh; a 1-D tpx layer takes a "
            "DTensor on the 1-D TP mesh it was built on (take the TP sub-mesh, e.g. mesh['tp'], "
            "or pass x.to_local())")
    if tuple(mesh.mesh.flatten().tolist()) != group_ranks(pg):
        raise ValueError(
            f"tpx.{who}: the input DTensor lives on the ranks {mesh.mesh.flatten().tolist()}, but "
            f"the layer is sharded over the ranks {list(group_ranks(pg))}; redistribute the "
            "input onto the layer's mesh first")
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim % x.dim())
    if tuple(x.placements) != (placement,):
        full = gathered_local(x, placement, pg)
        if full is not None:
            return full
        x = x.redistribute(mesh, [placement])
    twin = getattr(x, "_tpx_partial_grad_input", None)
    y = _ContiguousGrad.apply(x.to_local())
    if twin is not None:
        y._tpx_partial_grad_input = twin
    return y


def gathered_local(x, placement: Placement, pg: dist.ProcessGroup):
    """``Shard(d) -> Replicate()`` of a ``DTensor`` on the 1-D mesh over ``pg`` through tpx's
    own gather, as the local full tensor (or ``None`` where this does not apply: another
    redistribution, an uneven split, another mesh). The result carries the handle the
    column-parallel layers use to reduce-scatter their partial input gradients once
    (:func:`tpx.mappings.gather_dim_for_partial_grads`), where ``DTensor.redistribute``
    would leave them an all-reduce each."""
    from .. import mappings

    if not (isinstance(x, DTensor) and isinstance(placement, Replicate)
            and x.device_mesh.ndim == 1 and len(x.placements) == 1
            and isinstance(x.placements[0], Shard)):
        return None
    d = x.placements[0].dim
    if x.shape[d] % pg.size() or \
            tuple(x.device_mesh.mesh.flatten().tolist()) != group_ranks(pg):
        return None
    return mappings.gather_dim_for_partial_grads(x.to_local(), d, pg)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. The gradient a tpx layer
    computes for its input can be a strided view (e.g. the blocks of a sequence all-gather);
    ``DTensor.to_local``'s backward gives the gradient ``DTensor`` that local tensor's strides,
    and ops of torch < 2.6's DTensor then call ``view`` on it (a RuntimeError)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def wrap_output(y: Tensor, placement: Placement, pg: dist.ProcessGroup, global_shape: Sequence[int],
                mesh=None) -> Tensor:
    """The local tensor ``y`` as a ``DTensor`` with ``placement`` and ``global_shape`` over
    ``pg`` (no communication). The gradient flowing back is made local with the same
    placement."""
    if not isinstance(y, Tensor) or isinstance(y, DTensor):
        return y
    if isinstance(placement, Shard) and placement.dim < 0:
        placement = Shard(placement.dim % y.dim())
    shape = torch.Size(global_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(y, mesh_for_group(pg, y.device.type, mesh), [placement],
                              run_check=False, shape=shape, stride=stride)
