"""Layout changes with autograd: the Functions that move a tensor between placements at the
edges of the parallel layers (gather / split along one dimension, with uneven shards; the
all-reduces of gradients and of partial sums; the shared reduce-scatter of partial input
gradients). Each is ``S(d) -> R``, ``R -> S(d)``, ``P -> R`` or an identity whose backward
sums over the group, and each says so. The collectives run on tpx's own copy of the group
(:mod:`tpx.comm.owned`) and are counted by :func:`tpx.comm_stats`.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .comm import collectives
from .comm.guard import guarded
from .ops import mesh_all_gather, mesh_all_reduce, sum_by_name
from .run import run_cache

__all__ = ["all_reduce_grad", "all_reduce_grad_over", "all_reduce_grads", "all_reduce_sum",
           "all_reduce_sum_over", "sum_over_names", "gather_over_names", "split_blocks",
           "gather_blocks",
           "depend_on", "gather_dim", "gather_dim_for_partial_grads", "gather_last_dim", "partial_grad_input",
           "reduce_scatter_dim", "scale_forward", "split_dim", "split_last_dim",
           "sum_grad_over_holders", "sum_over_group"]


@guarded
def _gather(x: Tensor, dim: int, sizes: List[int], pg: dist.ProcessGroup) -> Tensor:
    if x.is_complex():  # sent as its real and imaginary parts (a trailing dimension of 2)
        return torch.view_as_complex(_gather(torch.view_as_real(x), dim % x.dim(), sizes, pg))
    width = max(sizes)
    local = x.movedim(dim, -1)
    if local.shape[-1] != width:
        local = F.pad(local, (0, width - local.shape[-1]))
    pieces = mesh_all_gather(local, pg.group_name)  # [world, ..., width], one flat all-gather
    # Concatenated along `dim` itself, so the result is contiguous (consumers that reshape it,
    # as a linear layer does with 3-D inputs, need no copy of it).
    return torch.cat([p[..., :s].movedim(-1, dim) for p, s in zip(pieces, sizes)], dim=dim)


class _GatherDim(torch.autograd.Function):
    """S(dim) -> R forward; backward keeps this rank's slice of the replicated gradient."""

    @staticmethod
    @guarded
    def forward(ctx, x, dim, sizes, start, pg):
        ctx.dim, ctx.start, ctx.width = dim, start, x.shape[dim]
        return _gather(x, dim, sizes, pg)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.width).contiguous(), None, None, None, None


class _SplitDim(torch.autograd.Function):
    """R -> S(dim) forward (this rank's slice); backward gathers the gradient back to R."""

    @staticmethod
    @guarded
    def forward(ctx, x, dim, sizes, start, pg):
        ctx.dim, ctx.sizes, ctx.pg = dim, sizes, pg
        return x.narrow(dim, start, sizes[dist.get_rank(pg)]).contiguous()

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.sizes, ctx.pg), None, None, None, None


def gather_dim(x: Tensor, dim: int, sizes: List[int], start: int, pg: dist.ProcessGroup) -> Tensor:
    """``x S(dim) -> R``: concatenates every rank's ``x`` along ``dim``; rank ``r`` holds
    ``sizes[r]`` entries, this rank's starting at ``start``."""
    if pg.size() == 1:
        return x
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _gather(x, dim % x.dim(), sizes, pg)  # no gradient wanted: no autograd node
    return _GatherDim.apply(x, dim % x.dim(), sizes, start, pg)


class _PartialGradView(torch.autograd.Function):
    """The gathered tensor again (no communication), for consumers whose input gradients are
    partial sums over the group: the gradients of all of them are summed by autograd, then
    reduce-scattered ONCE back to this rank's shard (S(dim) -> R forward's conjugate)."""

    @staticmethod
    @guarded
    def forward(ctx, x, box, dim, pg):
        ctx.dim, ctx.pg, ctx.shape = dim, pg, x.shape
        full = box[0]
        return full.view_as(full)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        dim, pg = ctx.dim, ctx.pg
        g = grad.movedim(dim, 0).contiguous()
        out = g.new_empty((g.shape[0] // pg.size(), *g.shape[1:]))
        collectives.reduce_scatter(out, g, pg)
        return out.movedim(0, dim), None, None, None


def gather_dim_for_partial_grads(x: Tensor, dim: int, pg: dist.ProcessGroup) -> Tensor:
    """``x S(dim) -> R`` as :func:`gather_dim` (equal shards), and on the result a second
    handle to the same values, ``result._tpx_partial_grad_input``, for the consumers that
    know how to use it: the column-parallel layers, whose input gradient is a partial sum over
    the group. They feed it instead of the result, so that autograd sums all their partial
    gradients and one reduce-scatter returns the sum to the shards, where each of them would
    otherwise all-reduce its own. Consumers of the result itself (any other op) hand it a
    replicated gradient, as before; both paths add up in ``x``'s gradient."""
    world = pg.size()
    full = gather_dim(x, dim, [x.shape[dim]] * world, dist.get_rank(pg) * x.shape[dim], pg)
    if world > 1 and x.requires_grad and torch.is_grad_enabled() and \
            not torch.compiler.is_compiling():
        twin = _PartialGradView.apply(x, [full.detach()], dim % x.dim(), pg)
        full._tpx_partial_grad_input = (twin, pg.group_name)
    return full


def partial_grad_input(x: Tensor, pg: dist.ProcessGroup):
    """The handle :func:`gather_dim_for_partial_grads` left on ``x`` for consumers over ``pg``
    whose input gradient is partial (or ``None``). A view of the whole of such a tensor (a
    model that keeps every position, ``x[:, 0:, :]``) holds the same values: its handle
    serves the view too."""
    twin = getattr(x, "_tpx_partial_grad_input", None)
    base = x._base if twin is None and not torch.compiler.is_compiling() else None
    if base is not None and x.shape == base.shape and x.stride() == base.stride() and \
            x.storage_offset() == base.storage_offset() and x.dtype == base.dtype:
        twin = getattr(base, "_tpx_partial_grad_input", None)
    if twin is None or twin[1] != pg.group_name or torch.compiler.is_compiling():
        return None
    return twin[0]


class _ReduceScatterDim(torch.autograd.Function):
    """P -> S(dim) forward, in equal blocks (the sum over the group, this rank's block);
    backward gathers the gradient back to R."""

    @staticmethod
    @guarded
    def forward(ctx, x, dim, pg):
        world = pg.size()
        per = x.shape[dim] // world
        ctx.dim, ctx.sizes, ctx.pg = dim, [per] * world, pg
        src = x.movedim(dim, 0).contiguous()
        out = src.new_empty((per,) + tuple(src.shape[1:]))
        collectives.reduce_scatter(out, src, pg)
        return out.movedim(0, dim).contiguous()

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.sizes, ctx.pg), None, None


def reduce_scatter_dim(x: Tensor, dim: int, pg: dist.ProcessGroup) -> Tensor:
    """``x P -> S(dim)``: the sum of every rank's ``x``, split along ``dim`` in equal blocks
    (``x.shape[dim]`` must divide by the group's size), this rank's block."""
    if pg.size() == 1:
        return x
    dim %= x.dim()
    if x.shape[dim] % pg.size():
        raise ValueError(f"tpx: reduce-scatter along dim {dim} of shape {tuple(x.shape)} needs "
                         f"a size that divides by the group's {pg.size()} ranks")
    return _ReduceScatterDim.apply(x, dim, pg)


class _DependOn(torch.autograd.Function):
    """``out`` itself (a view), recorded as depending on ``tensors``: the backward hands them
    zeros, so that the backward of what produced them runs whether or not this rank's
    computation used them."""

    @staticmethod
    def forward(ctx, out, *tensors):
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device)
                         for shape, dtype, device in ctx.meta))


def depend_on(out: Tensor, tensors: List[Tensor]) -> Tensor:
    """``out``, with a backward that reaches every tensor of ``tensors`` that needs a gradient
    (with zeros where ``out`` did not use it). For a tensor whose backward is a collective
    (:func:`all_reduce_grads`' outputs) that a rank may not use (expert parallelism: no token
    routed to this rank's experts): every rank then takes part in the collective."""
    needed = [t for t in tensors if isinstance(t, Tensor) and t.requires_grad]
    if not needed or not torch.is_grad_enabled():
        return out
    return _DependOn.apply(out, *needed)


def split_dim(x: Tensor, dim: int, sizes: List[int], start: int, pg: dist.ProcessGroup) -> Tensor:
    """``x R -> S(dim)``: keeps this rank's ``sizes[rank]`` entries from ``start``."""
    if pg.size() == 1:
        return x
    return _SplitDim.apply(x, dim % x.dim(), sizes, start, pg)


def gather_last_dim(x: Tensor, sizes: List[int], start: int, pg: dist.ProcessGroup) -> Tensor:
    """``x S(-1) -> R`` (see :func:`gather_dim`)."""
    return gather_dim(x, -1, sizes, start, pg)


def split_last_dim(x: Tensor, sizes: List[int], start: int, pg: dist.ProcessGroup) -> Tensor:
    """``x R -> S(-1)`` (see :func:`split_dim`)."""
    return split_dim(x, -1, sizes, start, pg)


def sum_over_group(t: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """``t`` summed over the ranks of ``pg`` (out of place, no autograd): ``P -> R``."""
    if pg.size() == 1:
        return t
    return mesh_all_reduce(t.contiguous(), pg.group_name)


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over each of the groups named (a
    replicated tensor whose consumers each saw only part of the data: sequence parallelism,
    a parameter replicated over the batch-splitting groups of a 2-D / 2.5-D / 3-D layout)."""

    @staticmethod
    @guarded
    def forward(ctx, x, names):
        ctx.names = names
        return x.view_as(x)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return sum_over_names(grad.contiguous(), ctx.names), None


def all_reduce_grad(x: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Identity whose backward all-reduces the gradient over ``pg``."""
    if pg.size() == 1:
        return x
    return _AllReduceGrad.apply(x, (pg.group_name,))


def all_reduce_grad_over(x: Tensor, names: Sequence[str]) -> Tensor:
    """Identity whose backward sums the gradient over each group of ``names`` in turn (group
    names, as the multi-dimensional layers hold them): ``R -> R`` forward, ``P -> R``
    backward."""
    if not names:
        return x
    return _AllReduceGrad.apply(x, tuple(names))


def sum_over_names(t: Tensor, names: Sequence[str]) -> Tensor:
    """``t`` summed over each group of ``names`` in turn (out of place, no autograd)."""
    for name in names:
        t = sum_by_name(t, name)
    return t


class _AllReduceGrads(torch.autograd.Function):
    """Identity forward on several tensors; backward sums all their gradients over the group
    with ONE all-reduce (the gradients of a dtype flattened into one buffer)."""

    @staticmethod
    @guarded
    def forward(ctx, pg, *xs):
        ctx.pg = pg
        ctx.meta = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @guarded
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.meta)]
        out: List[Tensor] = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads):
            idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
            flat = torch.cat([grads[i].reshape(-1) for i in idx])
            flat = sum_by_name(flat, ctx.pg.group_name)
            offset = 0
            for i in idx:
                n = grads[i].numel()
                out[i] = flat[offset:offset + n].view(grads[i].shape)
                offset += n
        return (None, *out)


def all_reduce_grads(xs: List[Tensor], pg: dist.ProcessGroup) -> Tuple[Tensor, ...]:
    """Identity on each tensor of ``xs``; backward sums their gradients over ``pg`` in one
    all-reduce per dtype (the inputs of a block whose every consumer computes a partial sum,
    as the sharded experts of a mixture of experts): ``R -> R`` forward, ``P -> R`` backward."""
    if pg.size() == 1 or not torch.is_grad_enabled() or \
            not any(x.requires_grad for x in xs):
        return tuple(xs)
    return _AllReduceGrads.apply(pg, *xs)


class _AllReduceSum(torch.autograd.Function):
    """``P -> R`` forward (all-reduce over each group named); backward passes the replicated
    gradient through."""

    @staticmethod
    @guarded
    def forward(ctx, x, names):
        return sum_over_names(x.contiguous(), names)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return grad, None


def all_reduce_sum(x: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """The sum of ``x`` over ``pg`` with autograd: ``P -> R`` forward, identity backward
    (the gradient of a replicated result is the gradient of each partial sum)."""
    if pg.size() == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return sum_over_group(x, pg)
    return _AllReduceSum.apply(x, (pg.group_name,))


def all_reduce_sum_over(x: Tensor, names: Sequence[str]) -> Tensor:
    """:func:`all_reduce_sum` over each group of ``names`` in turn (the batch-splitting groups
    of a multi-dimensional layout): the same value on every rank, each partial's gradient the
    gradient of the sum."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return sum_over_names(x.contiguous(), names)
    return _AllReduceSum.apply(x, tuple(names))


class _ScaleForward(torch.autograd.Function):
    """``x * factor`` forward, identity backward: a replicated term added inside a block whose
    output is summed over the group (each rank adds ``x / P``; the sum's gradient with respect
    to ``x`` is the gradient itself)."""

    @staticmethod
    @guarded
    def forward(ctx, x, factor):
        return x * factor

    @staticmethod
    @guarded
    def backward(ctx, grad):
        return grad, None


def scale_forward(x: Tensor, factor: float) -> Tensor:
    """``x * factor`` whose backward is the identity (see :class:`_ScaleForward`)."""
    return _ScaleForward.apply(x, factor)


class _SumGradOverHolders(torch.autograd.Function):
    """Identity forward on a row-sharded parameter whose rows may be held by several ranks;
    backward sums each row's gradient over the ranks that hold it (one all-reduce of a
    full-size buffer, used for the small replicated KV projections)."""

    @staticmethod
    @guarded
    def forward(ctx, x, index, full_rows, pg):
        ctx.index, ctx.full_rows, ctx.pg = index, full_rows, pg
        return x.view_as(x)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        full = grad.new_zeros((ctx.full_rows,) + tuple(grad.shape[1:]))
        index = _holder_index(ctx.index, grad.device)
        full.index_copy_(0, index, grad)
        full = sum_by_name(full, ctx.pg.group_name)
        return full.index_select(0, index), None, None, None


def sum_grad_over_holders(x: Tensor, rows: List[List[Tuple[int, int]]],
                          pg: dist.ProcessGroup) -> Tensor:
    """Identity whose backward sums the gradient of every row over the ranks holding it;
    ``rows[r]`` lists the ``(start, end)`` ranges of the full tensor held by rank ``r`` (this
    rank's are the rows of ``x``, in order)."""
    if pg.size() == 1:
        return x
    mine = tuple(tuple(r) for r in rows[dist.get_rank(pg)])
    full_rows = max(e for r in rows for _, e in r)
    return _SumGradOverHolders.apply(x, mine, full_rows, pg)


# (row ranges, device) -> the index of those rows on that device. Built once per layout and
# device, so a backward copies no index from the host (a pageable copy on GPUs).
_HOLDER_INDEX: dict = run_cache({})


def _holder_index(ranges, device: torch.device) -> Tensor:
    key = (ranges, str(device))
    index = _HOLDER_INDEX.get(key)
    if index is None:
        index = (torch.cat([torch.arange(s, e) for s, e in ranges]) if ranges
                 else torch.zeros(0, dtype=torch.long)).to(device)
        _HOLDER_INDEX[key] = index
    return index


# The blocks of a 2-D / 2.5-D / 3-D layout: the batch (dim 0) and the hidden features (the last
# dim) each split over one or more mesh dims, given by their groups' names, outermost first.


def gather_over_names(t: Tensor, dim: int, names: Sequence[str]) -> Tensor:
    """The blocks of ``t`` along ``dim`` gathered over each group of ``names`` (outermost first;
    the innermost is gathered first), in block order (no autograd)."""
    for name in reversed(names):
        stacked = mesh_all_gather(t, name)  # [W, *t.shape]
        shape = list(t.shape)
        shape[dim] *= stacked.shape[0]
        t = stacked.movedim(0, dim).reshape(shape)
    return t


class _SplitBlocks(torch.autograd.Function):
    """R -> this rank's block (batch block ``bi`` of ``bn``, hidden block ``hi`` of ``hn``);
    backward all-gathers the gradient blocks back to R."""

    @staticmethod
    @guarded
    def forward(ctx, x, blocks, batch_names, hidden_names):
        ctx.names = (batch_names, hidden_names)
        (bi, bn), (hi, hn) = blocks
        b, h = x.shape[0] // bn, x.shape[-1] // hn
        return x.narrow(0, bi * b, b).narrow(-1, hi * h, h).contiguous()

    @staticmethod
    @guarded
    def backward(ctx, grad):
        batch_names, hidden_names = ctx.names
        g = gather_over_names(grad.contiguous(), grad.dim() - 1, hidden_names)
        return gather_over_names(g, 0, batch_names), None, None, None


class _GatherBlocks(torch.autograd.Function):
    """Every rank's block -> R (the inverse of :class:`_SplitBlocks`); backward keeps this
    rank's block of the replicated gradient."""

    @staticmethod
    @guarded
    def forward(ctx, y, blocks, batch_names, hidden_names):
        ctx.blocks, ctx.shape = blocks, y.shape
        g = gather_over_names(y.contiguous(), y.dim() - 1, hidden_names)
        return gather_over_names(g, 0, batch_names)

    @staticmethod
    @guarded
    def backward(ctx, grad):
        (bi, _), (hi, _) = ctx.blocks
        b, h = ctx.shape[0], ctx.shape[-1]
        return grad.narrow(0, bi * b, b).narrow(-1, hi * h, h).contiguous(), None, None, None


def split_blocks(x: Tensor, blocks, batch_names: Sequence[str],
                 hidden_names: Sequence[str]) -> Tensor:
    """``x R -> this rank's block``: ``blocks = ((bi, bn), (hi, hn))``, the batch (dim 0) in
    ``bn`` blocks over the groups ``batch_names``, the features (last dim) in ``hn`` over
    ``hidden_names``; the backward all-gathers the gradient."""
    return _SplitBlocks.apply(x, blocks, tuple(batch_names), tuple(hidden_names))


def gather_blocks(y: Tensor, blocks, batch_names: Sequence[str],
                  hidden_names: Sequence[str]) -> Tensor:
    """Every rank's block ``y`` -> the full tensor (R), the inverse of :func:`split_blocks`;
    the backward keeps this rank's block of the gradient."""
    return _GatherBlocks.apply(y, blocks, tuple(batch_names), tuple(hidden_names))
