"""Gradient clipping of models sharded by tpx: the norm of the FULL model's gradients.

``torch.nn.utils.clip_grad_norm_`` on a sharded model computes each rank's norm of its own
shards: a different number on every rank, none of them the model's norm, and every rank
scales by a different factor, so parameters that should stay identical across ranks (a
row-parallel bias, norm weights) drift apart. :func:`clip_grad_norm_` here has torch's
signature and return value but computes the norm of the full model, the same on every rank
and equal to one device's, and scales every rank by the same factor.

How each gradient counts is read from its parameter's description (:mod:`tpx.layout.sharding`):

- a sharded parameter of a 1-D layer: its shards add up over the layer's group; rows held by
  several ranks (replicated KV heads) count once;
- a block of a multi-dimensional layer: the blocks add up over the mesh dimensions that
  split the parameter; replicas (over the other mesh dimensions) count once;
- a ``DTensor`` (``fully_shard``'s parameters, PyTorch tensor parallelism): its local parts
  add up over the mesh dimensions it is ``Shard``-ed on, on top of the tpx description of the
  tensor it shards;
- any other parameter is replicated (identical on every rank) and counts once.

Collectives: one all-reduce per process group that some gradient is spread over (not one
per parameter), issued in the order the groups first appear in ``parameters``, so every rank
must pass its parameters in the same order, with the same ones having gradients (as
``model.parameters()`` after a backward does). They are counted in :func:`tpx.comm_stats`.
"""

from __future__ import annotations

import math
import types
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._foreach_utils import (_device_has_foreach_support,
                                        _group_tensors_by_device_and_dtype,
                                        _has_foreach_support)

from .comm import collectives
from .layout.initial import comm_device
from .layout.sharding import GroupSharding, MeshSharding, sharding_of

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"]

TensorOrTensors = Union[Tensor, Iterable[Tensor]]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]


def _as_list(tensors: TensorOrTensors, who: str, what: str) -> List[Tensor]:
    if isinstance(tensors, Tensor):
        return [tensors]
    is_generator = isinstance(tensors, types.GeneratorType)
    try:
        out = list(tensors)
    except TypeError:
        raise TypeError(f"tpx.{who}: `{what}` must be a Tensor or an iterable of Tensors; got "
                        f"{type(tensors).__name__}") from None
    if is_generator and not out:
        warnings.warn(f"tpx.{who}: `{what}` is an empty generator, no gradient clipping will "
                      "occur.", stacklevel=3)
    for i, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"tpx.{who}: `{what}` must hold Tensors; item {i} is a "
                            f"{type(t).__name__}")
    return out


def _norm_type(norm_type, who: str) -> float:
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"tpx.{who}: `norm_type` must be a positive number or inf; got "
                         f"{norm_type!r}") from None
    if not (p > 0):  # also rejects nan
        raise ValueError(f"tpx.{who}: `norm_type` must be a positive number or inf (the p of "
                         f"the p-norm); got {norm_type!r}. Norms of order <= 0 are not "
                         "supported on sharded gradients")
    return p


def _local(t: Tensor) -> Tensor:
    """The part of ``t`` this rank stores (the local tensor of a DTensor)."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def _dtensor_layout(t: Tensor, who: str, index: int
                    ) -> Tuple[List[dist.ProcessGroup], Tuple[int, ...]]:
    """For a DTensor: the groups of the mesh dims it is sharded on, and the offset of its
    local part in its global shape."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    groups = []
    for i, pl in enumerate(placements):
        if pl.is_partial():
            raise ValueError(f"tpx.{who}: tensor {index} is a DTensor with a Partial placement "
                             f"({placements}); its local values are not its values. "
                             "Redistribute it to Shard/Replicate placements first")
        if not pl.is_replicate():  # Shard, and FSDP2's _StridedShard over a TP Shard
            g = mesh.get_group(i)
            if g.size() > 1:
                groups.append(g)
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return groups, tuple(int(o) for o in offset)


class _Piece:
    __slots__ = ("tensor", "key")

    def __init__(self, tensor: Tensor, key: Tuple[dist.ProcessGroup, ...]):
        self.tensor, self.key = tensor, key


def _pieces(tensors: Sequence[Tensor], descs: Sequence[object], who: str) -> List[_Piece]:
    """Each tensor's local part cut to what this rank counts, with the groups it is summed
    over. Validates every tensor against its description first (nothing is modified)."""
    out: List[_Piece] = []
    for i, (t, desc) in enumerate(zip(tensors, descs)):
        groups: List[dist.ProcessGroup] = []
        offset: Tuple[int, ...] = (0,) * t.dim()
        if getattr(desc, "in_dtensor", False) and DTensor is not None and isinstance(t, DTensor):
            if tuple(t.shape) != tuple(desc.full_shape):
                raise ValueError(
                    f"tpx.{who}: tensor {i} has global shape {tuple(t.shape)}, but its parameter "
                    f"is described as a tensor of {tuple(desc.full_shape)} (tpx.layout.sharding); pass "
                    "the parameters in the same order as their gradients")
            desc = None  # a DTensor parameter of a tpx layer: its placements say it all
        elif isinstance(desc, MeshSharding) and DTensor is not None and isinstance(t, DTensor):
            if tuple(t.shape) != tuple(desc.full_shape):
                raise ValueError(
                    f"tpx.{who}: tensor {i} has global shape {tuple(t.shape)}, but its parameter "
                    f"is described as a tensor of {tuple(desc.full_shape)} (tpx.layout.sharding); pass "
                    "the parameters in the same order as their gradients")
            desc = None  # a block of a multi-dimensional layer, as a DTensor over its mesh
        if desc is not None:
            groups += desc.reduce_groups()
            if tuple(t.shape) != tuple(desc.local_shape):
                raise ValueError(
                    f"tpx.{who}: tensor {i} has shape {tuple(t.shape)}, but its parameter is "
                    f"described as this rank's part {tuple(desc.local_shape)} of a tensor of "
                    f"{tuple(desc.full_shape)} (tpx.layout.sharding); pass the parameters in the same "
                    "order as their gradients, or the gradients of tpx's own parameters")
        if DTensor is not None and isinstance(t, DTensor):
            dgroups, offset = _dtensor_layout(t, who, i)
            groups += [g for g in dgroups if all(g is not o for o in groups)]
        local = _local(t)
        key = tuple(groups)
        owned = desc.owned() if isinstance(desc, GroupSharding) else None
        if owned is None:
            out.append(_Piece(local, key))
            continue
        d, start, n = desc.dim, offset[desc.dim], local.shape[desc.dim]
        mine = 0
        for s, e in owned:
            a, b = max(s, start) - start, min(e, start + n) - start
            if b > a:
                out.append(_Piece(local.narrow(d, a, b - a), key))
                mine += 1
        if not mine:  # nothing counts here, but the groups' all-reduces must still match
            out.append(_Piece(local.new_zeros(1), key))
    return out


def _piece_norms(pieces: List[Tensor], p: float, foreach: Optional[bool]) -> List[Tensor]:
    """The p-norm of each tensor (torch's grouping by device and dtype, foreach when it can)."""
    norms: List[Optional[Tensor]] = [None] * len(pieces)
    grouped = _group_tensors_by_device_and_dtype([pieces], with_indices=True)
    for (device, _), ([group], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(group, device)) or (
                foreach and _device_has_foreach_support(device)):
            result = torch._foreach_norm(group, p)
        elif foreach:
            raise RuntimeError(f"tpx.get_total_norm: foreach=True was passed, but the foreach API "
                               f"is not available for {device.type} tensors; pass foreach=None")
        else:
            result = [torch.linalg.vector_norm(g, p) for g in group]
        for i, n in zip(indices, result):
            norms[i] = n
    return norms  # type: ignore[return-value]


def _all_reduce(values: List[Tensor], group: dist.ProcessGroup, use_max: bool) -> List[Tensor]:
    buf = torch.stack(values)
    if use_max:
        # A max all-reduce may drop NaN; carry it as a flag so every rank sees it.
        nan = torch.isnan(buf)
        buf = torch.cat([torch.where(nan, torch.zeros_like(buf), buf), nan.to(buf.dtype)])
    dev = comm_device(group, buf.device)
    wire = buf.to(dev)
    collectives.all_reduce(wire, group, op=dist.ReduceOp.MAX if use_max else dist.ReduceOp.SUM)
    buf = wire.to(buf.device)
    if use_max:
        n = len(values)
        buf = torch.where(buf[n:] > 0, torch.full_like(buf[:n], float("nan")), buf[:n])
    return list(buf.unbind(0))


def _total_norm(tensors: List[Tensor], descs: List[object], norm_type, error_if_nonfinite: bool,
                foreach: Optional[bool], who: str) -> Tensor:
    p = _norm_type(norm_type, who)
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    out_dtype = tensors[0].dtype
    for t in tensors[1:]:
        out_dtype = torch.promote_types(out_dtype, t.dtype)
    acc_dtype = torch.promote_types(out_dtype, torch.float32)
    pieces = _pieces(tensors, descs, who)
    use_max = math.isinf(p)

    # Per set of groups (span): this rank's sum of |x|^p (or max |x|) over its pieces.
    norms = _piece_norms([pc.tensor for pc in pieces], p, foreach)
    by_key: Dict[Tuple, List[Tensor]] = {}
    for pc, n in zip(pieces, norms):
        v = n.to(device=first_device, dtype=acc_dtype)
        by_key.setdefault(pc.key, []).append(v if use_max else v ** p)
    spans = {k: (torch.stack(v).amax() if use_max else torch.stack(v).sum())
             for k, v in by_key.items()}

    # One all-reduce per group, in the order the groups first appear; a span over several
    # groups (mesh dimensions) is reduced over each in turn.
    order: List[dist.ProcessGroup] = []
    for pc in pieces:
        for g in pc.key:
            if all(g is not o for o in order):
                order.append(g)
    for g in order:
        keys = [k for k in spans if any(g is x for x in k)]
        for k, v in zip(keys, _all_reduce([spans[k] for k in keys], g, use_max)):
            spans[k] = v

    values = torch.stack(list(spans.values()))
    if use_max:
        total = values.amax()
    else:
        total = values.sum() ** (1.0 / p)
    total = total.to(out_dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"tpx.{who}: the total norm of order {p} of the gradients of `parameters` is "
            "non-finite, so it cannot be clipped (nothing was modified). To scale the gradients "
            "by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


@torch.no_grad()
def get_total_norm(tensors: TensorOrTensors, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                   parameters: Optional[TensorOrTensors] = None) -> Tensor:
    """The p-norm of ``tensors`` viewed as one vector, as ``torch.nn.utils.get_total_norm``,
    but of the FULL tensors when they are sharded by tpx: the same value on every rank.

    Each tensor's layout is read from its own description (pass parameters to get the norm of
    the model's weights) or, with ``parameters`` (same length and order), from the parameter
    in the same position (pass the gradients: ``get_total_norm([p.grad for p in ps],
    parameters=ps)``). ``DTensor`` s count by their placements.

    Placement: ``tensors`` are R, S(d) (per their descriptions) or DTensors; the result is a
    0-dim tensor, R (identical on every rank), on the first tensor's device. Collective over
    every group a tensor is sharded over (one all-reduce per group); ``norm_type`` ``inf`` is
    the largest absolute value; orders ``<= 0`` raise ``ValueError``."""
    who = "get_total_norm"
    ts = _as_list(tensors, who, "tensors")
    if parameters is None:
        descs = [sharding_of(t) for t in ts]
    else:
        ps = _as_list(parameters, who, "parameters")
        if len(ps) != len(ts):
            raise ValueError(f"tpx.{who}: `parameters` must match `tensors` one to one; got "
                             f"{len(ps)} parameters for {len(ts)} tensors")
        descs = [sharding_of(p) for p in ps]
    return _total_norm(ts, descs, norm_type, error_if_nonfinite, foreach, who)


@torch.no_grad()
def clip_grads_with_norm_(parameters: TensorOrTensors, max_norm: float, total_norm: Tensor,
                          foreach: Optional[bool] = None) -> None:
    """Scales the gradients of ``parameters`` in place by ``min(max_norm / (total_norm +
    1e-6), 1)``, as ``torch.nn.utils.clip_grads_with_norm_`` (a ``DTensor`` gradient is scaled
    in its local part). Local: no communication; ``total_norm`` must be the same on every rank
    (as :func:`get_total_norm` returns it) for replicated parameters to stay identical."""
    ps = _as_list(parameters, "clip_grads_with_norm_", "parameters")
    grads = [_local(p.grad) for p in ps if p.grad is not None]
    if not grads:
        return
    max_norm = float(max_norm)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grouped = _group_tensors_by_device_and_dtype([grads])
    for (device, _), ([group], _) in grouped.items():
        if (foreach is None and _has_foreach_support(group, device)) or (
                foreach and _device_has_foreach_support(device)):
            torch._foreach_mul_(group, coef.to(device))
        elif foreach:
            raise RuntimeError(f"tpx.clip_grads_with_norm_: foreach=True was passed, but the "
                               f"foreach API is not available for {device.type} tensors")
        else:
            c = coef.to(device)
            for g in group:
                g.mul_(c)


@torch.no_grad()
def clip_grad_norm_(parameters: TensorOrTensors, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None) -> Tensor:
    """Clips the gradient norm of ``parameters`` of a model sharded by tpx, as
    ``torch.nn.utils.clip_grad_norm_``: the norm is that of the FULL model's gradients viewed
    as one vector, the same on every rank and equal to the unsharded model's on one device,
    and every rank scales its gradients by the same factor ``min(max_norm / (norm + 1e-6),
    1)``.

    Sharded parameters' gradients count over their groups (their descriptions, see
    :mod:`tpx.layout.sharding`; ``DTensor`` gradients by their placements); rows or blocks held by
    several ranks and parameters without a description (replicated: a row-parallel bias,
    ``SequenceParallel`` norm weights) count once.

    Placement: gradients R / S(d) as their parameters; returns the total norm, a 0-dim
    tensor, R (identical on every rank). Collective: one all-reduce per process group some
    gradient is spread over, so every rank must call it with its parameters in the same
    order. With ``error_if_nonfinite=True`` a non-finite norm raises ``RuntimeError`` on
    every rank before any gradient is changed."""
    ps = _as_list(parameters, "clip_grad_norm_", "parameters")
    with_grad = [p for p in ps if p.grad is not None]
    total = _total_norm([p.grad for p in with_grad], [sharding_of(p) for p in with_grad],
                        norm_type, error_if_nonfinite, foreach, "clip_grad_norm_")
    clip_grads_with_norm_(with_grad, max_norm, total, foreach)
    return total
