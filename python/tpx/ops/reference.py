"""tpx's operators decomposed into torch ops and PyTorch's functional collectives, for
PyTorch's tools that watch collectives.

``torch.distributed.tensor.debug.CommDebugMode`` counts the collectives that go through
PyTorch's dispatcher; tpx's C++ engine issues its own on the process group and the mode
cannot see them. While such a mode is active (the classes in
:data:`tpx.comm.collectives.WATCHING_MODES`), every ``torch.ops.tpx`` operator that communicates
runs the decomposition below instead (a ``torch.library.register_torch_dispatch`` rule for
the mode's class): the same result (to rounding: the GEMMs are torch's), its collectives
issued once each through ``torch.ops._c10d_functional`` with the mode watching, which is
how PyTorch's TP issues them. The mode then counts, per module, the collectives PyTorch's
own TP would issue for the same layout:

=============================  ==============================================================
operator                       collectives (forward; backward)
=============================  ==============================================================
replicated_matmul              none; all_reduce of the input gradient
matmul_all_reduce              all_reduce; none
all_gather_matmul              all_gather_into_tensor; reduce_scatter_tensor
matmul_reduce_scatter          reduce_scatter_tensor; all_gather_into_tensor
vocab_parallel_embedding       all_reduce (reduce_scatter_tensor when scattered); none
                               (all_gather_into_tensor when scattered)
vocab_parallel_cross_entropy   all_reduce x3 (row max, sum of exp, target logit; a fourth
                               with label smoothing); none
linear_cross_entropy           as the cross-entropy; all_reduce of the hidden gradient
mesh_all_reduce, _all_gather   all_reduce, all_gather_into_tensor
=============================  ==============================================================

Outside such a mode the engine issues the same collectives pipelined in chunks (one per
chunk), and the cross-entropy sends its three statistics in two all-reduces; ``tpx.comm_stats``
counts what the engine issues. The multi-dimensional operators (``linear_2d``, ``linear_3d``)
have no decomposition here: under the mode they run the engine, unseen by it.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from .. import _ext
from ..comm.collectives import (
    WATCHING_MODES, functional_all_gather, functional_all_reduce, functional_reduce_scatter)

_KERNELS: Dict[str, Callable] = {}


def _kernel(fn: Callable) -> Callable:
    _KERNELS[fn.__name__] = fn
    return fn


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _mm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``a [..., k] @ b [k, n] (+ bias)``."""
    out = torch.matmul(a, b)
    return out if bias is None else out + bias


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grad(g: Tensor, a: Tensor) -> Tensor:
    """The gradient of ``b`` in ``a @ b``: ``(g2.T @ a2).T``, ``[k, n]`` as the engine returns it."""
    return (_rows(g).t() @ _rows(a)).t()


def _gather_along(t: Tensor, dim: int, pg) -> Tensor:
    return functional_all_gather(t.movedim(dim, 0), pg).movedim(0, dim)


def _scatter_along(t: Tensor, dim: int, pg) -> Tensor:
    return functional_reduce_scatter(t.movedim(dim, 0), pg).movedim(0, dim).contiguous()


def _staged_order(a_shape, gather_dim: int, world: int, chunks, element_size: int) -> Optional[Tensor]:
    """The gathered input of ``all_gather_matmul`` as the engine stages it: with a pipeline of
    more than one chunk, chunk ``j`` of every rank is one block (chunk-major). Returns, for
    each staged position along ``gather_dim``, its position in rank order (``None``: the same)."""
    extent = a_shape[gather_dim]
    numel = 1
    for s in a_shape:
        numel *= s
    depth = 1 if world == 1 else _ext.pipeline_depth(chunks, extent, numel * element_size)
    if depth == 1:
        return None
    base, extra = divmod(extent, depth)
    order: List[int] = []
    lo = 0
    for j in range(depth):
        length = base + (1 if j < extra else 0)
        for r in range(world):
            order.extend(range(r * extent + lo, r * extent + lo + length))
        lo += length
    return torch.tensor(order, dtype=torch.long)


# the collective matmuls ----------------------------------------------------------------------


@_kernel
def replicated_matmul(a, b, group_name, chunks=None, bias=None):
    return _mm(a, b, bias)


@_kernel
def replicated_matmul_backward(grad_out, a, b, group_name, chunks, need_a, need_b, bias_grad):
    grad_a = functional_all_reduce(_mm(grad_out, b.t()), _group(group_name)) if need_a else None
    grad_b = _weight_grad(grad_out, a) if need_b else None
    grad_bias = _rows(grad_out).sum(0) if bias_grad else None
    return grad_a, grad_b, grad_bias


@_kernel
def matmul_all_reduce(a, b, group_name, chunks=None, bias=None):
    out = functional_all_reduce(_mm(a, b), _group(group_name))
    return out if bias is None else out + bias


@_kernel
def matmul_all_reduce_backward(grad_out, a, b, need_a, need_b, bias_grad):
    grad_a = _mm(grad_out, b.t()) if need_a else None
    grad_b = _weight_grad(grad_out, a) if need_b else None
    grad_bias = _rows(grad_out).sum(0) if bias_grad else None
    return grad_a, grad_b, grad_bias


@_kernel
def all_gather_matmul(a, b, gather_dim, group_name, chunks=None, bias=None):
    pg = _group(group_name)
    gd = gather_dim % a.dim()
    gathered = _gather_along(a, gd, pg)
    out = _mm(gathered, b, bias).contiguous()
    order = _staged_order(a.shape, gd, pg.size(), chunks, a.element_size())
    staged = gathered if order is None else gathered.index_select(gd, order.to(a.device))
    return staged, out


@_kernel
def all_gather_matmul_backward(grad_out, grad_a_gathered, a_gathered, b, gather_dim,
                               group_name, chunks, need_a, need_b, bias_grad):
    pg = _group(group_name)
    world = pg.size()
    gd = gather_dim % a_gathered.dim()
    shard = list(a_gathered.shape)
    shard[gd] //= world
    order = _staged_order(shard, gd, world, chunks, a_gathered.element_size())
    if order is not None:  # back to rank order
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        inverse = inverse.to(a_gathered.device)
        a_gathered = a_gathered.index_select(gd, inverse)
        if grad_a_gathered is not None:
            grad_a_gathered = grad_a_gathered.index_select(gd, inverse)
    grad_a = None
    if need_a:
        full = _mm(grad_out, b.t())
        if grad_a_gathered is not None:
            full = full + grad_a_gathered
        grad_a = _scatter_along(full, gd, pg)
    grad_b = _weight_grad(grad_out, a_gathered) if need_b else None
    grad_bias = _rows(grad_out).sum(0) if bias_grad else None
    return grad_a, grad_b, grad_bias


@_kernel
def matmul_reduce_scatter(a, b, scatter_dim, group_name, chunks=None, bias=None):
    out = _scatter_along(_mm(a, b), scatter_dim % a.dim(), _group(group_name))
    return out if bias is None else out + bias


@_kernel
def matmul_reduce_scatter_backward(grad_out, a, b, scatter_dim, group_name, chunks, need_a,
                                   need_b, bias_grad):
    pg = _group(group_name)
    if not (need_a or need_b):
        grad_bias = functional_all_reduce(_rows(grad_out).sum(0), pg) if bias_grad else None
        return None, None, grad_bias
    g = _gather_along(grad_out, scatter_dim % a.dim(), pg)
    grad_a = _mm(g, b.t()) if need_a else None
    grad_b = _weight_grad(g, a) if need_b else None
    grad_bias = _rows(g).sum(0) if bias_grad else None
    return grad_a, grad_b, grad_bias


# the vocabulary-parallel operators -----------------------------------------------------------


def _held(ids: Tensor, vocab_start: int, width: int):
    local = ids - vocab_start
    held = (local >= 0) & (local < width)
    return local.clamp(0, max(width - 1, 0)), held


@_kernel
def vocab_parallel_embedding(weight, ids, vocab_start, group_name, scatter_dim, padding_idx):
    pg = _group(group_name)
    idx, held = _held(ids, vocab_start, weight.shape[0])
    if weight.shape[0] == 0:
        partial = weight.new_zeros((*ids.shape, weight.shape[1]))
    else:
        partial = weight[idx] * held.unsqueeze(-1).to(weight.dtype)
    if scatter_dim is None:
        return functional_all_reduce(partial, pg)
    return _scatter_along(partial, scatter_dim % ids.dim(), pg)


@_kernel
def vocab_parallel_embedding_backward(grad_out, ids, vocab_start, num_local, padding_idx,
                                      group_name, scatter_dim):
    if scatter_dim is not None:
        grad_out = _gather_along(grad_out, scatter_dim % ids.dim(), _group(group_name))
    idx, held = _held(ids, vocab_start, num_local)
    if padding_idx >= 0:
        held = held & (idx != padding_idx)
    g = _rows(grad_out)
    rows = held.reshape(-1).nonzero().squeeze(1)
    grad_weight = g.new_zeros((num_local, g.shape[-1]))
    return grad_weight.index_add_(0, idx.reshape(-1)[rows], g[rows])


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@_kernel
def vocab_parallel_cross_entropy(logits, target, vocab_start, vocab_size, group_name,
                                 ignore_index, label_smoothing, inplace_backward):
    """PyTorch's loss parallelism's three all-reduces: the row maxima, the sums of exp, the
    target logits (and the sums of the logits with label smoothing)."""
    pg = _group(group_name)
    x = logits.to(_accumulate_dtype(logits.dtype))
    width = x.shape[1]
    ninf = float("-inf")
    local_max = x.amax(1) if width else x.new_full((x.shape[0],), ninf)
    m = functional_all_reduce(local_max, pg, "max")
    shift = torch.where(m == ninf, torch.zeros_like(m), m)
    sum_exp = functional_all_reduce((x - shift.unsqueeze(1)).exp().sum(1), pg)
    lse = shift + sum_exp.log()
    idx, held = _held(target, vocab_start, width)
    held = held & (target != ignore_index)
    if width:
        picked = x.gather(1, idx.unsqueeze(1)).squeeze(1)
        picked = torch.where(held, picked, torch.zeros_like(picked))
    else:
        picked = x.new_zeros((x.shape[0],))
    target_logit = functional_all_reduce(picked, pg)
    loss = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing > 0:
        loss = loss - (label_smoothing / vocab_size) * functional_all_reduce(x.sum(1), pg)
    return loss.masked_fill(target == ignore_index, 0), lse


def _ce_grad(grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
             label_smoothing) -> Tensor:
    x = logits.to(_accumulate_dtype(logits.dtype))
    g = grad_loss.to(x.dtype).masked_fill(target == ignore_index, 0)
    grad = (x - lse.to(x.dtype).unsqueeze(1)).exp() * g.unsqueeze(1)
    if label_smoothing > 0:
        grad = grad - (g * (label_smoothing / vocab_size)).unsqueeze(1)
    if x.shape[1]:
        idx, held = _held(target, vocab_start, x.shape[1])
        held = held & (target != ignore_index)
        grad = grad.scatter_add(1, idx.unsqueeze(1),
                                (-(1.0 - label_smoothing) * g * held).unsqueeze(1))
    return grad


@_kernel
def vocab_parallel_cross_entropy_backward(grad_loss, logits, target, lse, vocab_start,
                                          vocab_size, ignore_index, label_smoothing):
    return _ce_grad(grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                    label_smoothing).to(logits.dtype)


@_kernel
def vocab_parallel_cross_entropy_backward_(grad_loss, logits, target, lse, vocab_start,
                                           vocab_size, ignore_index, label_smoothing):
    logits.copy_(_ce_grad(grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                          label_smoothing))


@_kernel
def linear_cross_entropy(hidden, weight, bias, target, vocab_start, vocab_size, group_name,
                         chunk_size, ignore_index, label_smoothing):
    logits = _mm(hidden, weight.t(), bias)
    return vocab_parallel_cross_entropy(logits, target, vocab_start, vocab_size, group_name,
                                        ignore_index, label_smoothing, False)


@_kernel
def linear_cross_entropy_backward(grad_loss, hidden, weight, bias, target, lse, vocab_start,
                                  vocab_size, group_name, chunk_size, ignore_index,
                                  label_smoothing, need_hidden, need_weight, need_bias):
    logits = _mm(hidden, weight.t(), bias)
    g = _ce_grad(grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                 label_smoothing).to(logits.dtype)
    grad_hidden = (functional_all_reduce(g @ weight, _group(group_name)) if need_hidden
                   else None)
    grad_weight = g.t() @ hidden if need_weight else None
    grad_bias = g.sum(0) if need_bias and bias is not None else None
    return grad_hidden, grad_weight, grad_bias


# the mesh collectives ------------------------------------------------------------------------


@_kernel
def mesh_all_reduce(x, group):
    return functional_all_reduce(x, _group(group))


@_kernel
def mesh_all_gather(x, group):
    pg = _group(group)
    return functional_all_gather(x.contiguous()[None], pg)


# the rules -----------------------------------------------------------------------------------


def _rule(mode, func, types, args, kwargs):
    """Runs ``func``'s decomposition with ``mode`` watching it (the dispatcher took the mode
    off its stack to call this rule)."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    kernel = _KERNELS[func._schema.name.split("::", 1)[1]]
    _push_mode(mode)
    try:
        return kernel(*args, **kwargs)
    finally:
        _pop_mode()


def _watching_modes() -> list:
    found = []
    try:
        from torch.distributed.tensor.debug import CommDebugMode

        found.append(CommDebugMode)
    except ImportError:  # a torch without DTensor's debug tools
        pass
    return found


def install() -> None:
    """Registers the rules (once, when :mod:`tpx.ops` is imported)."""
    for mode in _watching_modes():
        if mode in WATCHING_MODES:
            continue
        for op in _KERNELS:
            torch.library.register_torch_dispatch(f"tpx::{op}", mode, _rule, lib=_LIB)
        WATCHING_MODES.add(mode)


_LIB = torch.library.Library("tpx", "FRAGMENT")
