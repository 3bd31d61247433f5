"""The vocabulary-parallel operators (cross-entropy over vocab-sharded logits, the fused LM
head + loss, the embedding over vocab-sharded rows): wrappers, fake implementations and
autograd side by side. Each backward is one fused pass (the cross-entropy's optionally over
the logits themselves; the fused loss recomputes each chunk's logits)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _ext
from ..comm.guard import guarded
from ..comm.groups import GroupLike
from .core import call, dim_first_shape, group_name, register, world


@guarded
def vocab_parallel_cross_entropy_rows(
    logits: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    group: GroupLike = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    inplace_backward: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Per-row cross-entropy of vocab-sharded logits, with ONE collective for the row
    statistics. Most users want :func:`tpx.vocab_parallel_cross_entropy` instead.

    Placement: ``logits S(1) [N, V_local]`` (columns ``[vocab_start, vocab_start + V_local)``
    of ``vocab_size``), ``target R [N]`` -> ``loss R [N] (fp32)``, ``lse R [N] (fp32)``.
    Ignored rows have loss 0. With ``inplace_backward`` the gradient is written over
    ``logits`` (which must not be used afterwards).
    """
    name = group_name("vocab_parallel_cross_entropy", group, target, vocab_size=vocab_size)
    return call("vocab_parallel_cross_entropy", logits, target, vocab_start, vocab_size, name,
                 ignore_index, label_smoothing, inplace_backward)


@guarded
def vocab_parallel_embedding(
    weight: Tensor,
    ids: Tensor,
    vocab_start: int,
    group: GroupLike = None,
    scatter_dim: Optional[int] = None,
    padding_idx: int = -1,
) -> Tensor:
    """Embedding lookup in a table whose rows are sharded over the group.

    Placement: ``weight S(0)`` (rows ``[vocab_start, vocab_start + V_local)``), ``ids R`` ->
    ``out R`` (``[*ids.shape, D]``), or ``out S(scatter_dim)`` when ``scatter_dim`` is given
    (sequence parallelism: the partial results are reduce-scattered instead of all-reduced).
    Ids outside this rank's rows contribute zeros; ``padding_idx`` (a LOCAL row index, -1
    for none) receives no gradient. Ids must lie in the vocabulary (not checked here).
    """
    name = group_name("vocab_parallel_embedding", group, ids, scatter_dim=scatter_dim,
                       dim=weight.shape[-1], weight_dtype=str(weight.dtype))
    return call("vocab_parallel_embedding", weight, ids, vocab_start, name, scatter_dim,
                 padding_idx)


def plain_embedding(weight: Tensor, ids: Tensor, vocab_start: int, group_name: str,
                    padding_idx: int = -1, num_embeddings: int = -1) -> Tensor:
    """:func:`vocab_parallel_embedding` (without ``scatter_dim``) on this rank's local table,
    nothing recorded: the lookup of a vocabulary-parallel embedding in
    :func:`tpx.ops.core.lean_mode` ``PLAIN``. ``group_name`` from
    :func:`tpx.ops.core.plain_group_name`; ``ids`` int64. With ``num_embeddings >= 0``, ids on
    the CPU are first checked to lie in ``[0, num_embeddings)`` in the same call (a
    ``ValueError`` naming the id, before any collective; ids on a GPU are not checked here).

    Placement: ``weight S(0)``, ``ids R`` -> ``out R``."""
    return _ext.direct.vocab_parallel_lookup(weight, ids, vocab_start, num_embeddings, group_name,
                                             padding_idx)


@guarded
def linear_cross_entropy_rows(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    vocab_start: int,
    vocab_size: int,
    group: GroupLike = None,
    bias: Optional[Tensor] = None,
    chunk_size: int = 1024,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """Per-row cross-entropy of ``hidden @ weight.T (+ bias)`` without the full logits: tokens
    are processed ``chunk_size`` at a time (one statistics all-gather per chunk). Most users
    want :func:`tpx.linear_cross_entropy` instead.

    Placement: ``hidden R [N, d]``, ``weight S(0) [V_local, d]`` (vocabulary rows from
    ``vocab_start``), ``bias S(0)``, ``target R [N]`` -> ``loss R [N]``, ``lse R [N]`` (fp32).
    """
    name = group_name("linear_cross_entropy", group, hidden, target, vocab_size=vocab_size,
                       chunk_size=chunk_size)
    return call("linear_cross_entropy", hidden, weight, bias, target, vocab_start, vocab_size,
                 name, chunk_size, ignore_index, label_smoothing)

@torch.library.register_fake("tpx::vocab_parallel_cross_entropy")
def _vocab_parallel_cross_entropy_fake(logits, target, vocab_start, vocab_size, group_name,
                                       ignore_index, label_smoothing, inplace_backward):
    rows = logits.shape[0]
    acc = loss_dtype(logits.dtype)
    return logits.new_empty((rows,), dtype=acc), logits.new_empty((rows,), dtype=acc)


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    # The loss ops compute (and return) float64 for float64 inputs, float32 otherwise.
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("tpx::vocab_parallel_cross_entropy_backward")
def _vocab_parallel_cross_entropy_backward_fake(grad_loss, logits, target, lse, vocab_start,
                                                vocab_size, ignore_index, label_smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("tpx::vocab_parallel_cross_entropy_backward_")
def _vocab_parallel_cross_entropy_backward_inplace_fake(grad_loss, logits, target, lse,
                                                        vocab_start, vocab_size, ignore_index,
                                                        label_smoothing):
    return None


@torch.library.register_fake("tpx::vocab_parallel_embedding")
def _vocab_parallel_embedding_fake(weight, ids, vocab_start, group_name, scatter_dim,
                                   padding_idx):
    dim = weight.shape[1]
    if scatter_dim is None:
        return weight.new_empty(list(ids.shape) + [dim])
    sd = scatter_dim % ids.dim()
    shape = dim_first_shape(ids, sd) + [dim]
    shape[0] = shape[0] // world(group_name)
    return weight.new_empty(shape).movedim(0, sd).contiguous()


@torch.library.register_fake("tpx::vocab_parallel_embedding_backward")
def _vocab_parallel_embedding_backward_fake(grad_out, ids, vocab_start, num_local, padding_idx,
                                            group_name, scatter_dim):
    return grad_out.new_empty((num_local, grad_out.shape[-1]))


@torch.library.register_fake("tpx::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, bias, target, vocab_start, vocab_size,
                               group_name, chunk_size, ignore_index, label_smoothing):
    rows = hidden.shape[0]
    return (hidden.new_empty((rows,), dtype=torch.float32),
            hidden.new_empty((rows,), dtype=torch.float32))


@torch.library.register_fake("tpx::linear_cross_entropy_backward")
def _linear_cross_entropy_backward_fake(grad_loss, hidden, weight, bias, target, lse,
                                        vocab_start, vocab_size, group_name, chunk_size,
                                        ignore_index, label_smoothing, need_hidden, need_weight,
                                        need_bias):
    grad_bias = torch.empty_like(bias) if bias is not None and need_bias else None
    grad_hidden = (torch.empty_like(hidden, memory_format=torch.contiguous_format)
                   if need_hidden else None)
    grad_weight = (torch.empty_like(weight, memory_format=torch.contiguous_format)
                   if need_weight else None)
    return grad_hidden, grad_weight, grad_bias

# vocab_parallel_cross_entropy: backward is one fused pass, optionally over the logits -------


def _vocab_ce_setup(ctx, inputs, output):
    logits, target, vocab_start, vocab_size, _, ignore_index, smoothing, inplace = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.args = (vocab_start, vocab_size, ignore_index, smoothing, inplace)


def _vocab_ce_backward(ctx, grad_loss, grad_lse):
    logits, target, lse = ctx.saved_tensors
    vocab_start, vocab_size, ignore_index, smoothing, inplace = ctx.args
    args = (grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index, smoothing)
    if inplace:
        torch.ops.tpx.vocab_parallel_cross_entropy_backward_(*args)
        grad = logits
    else:
        grad = torch.ops.tpx.vocab_parallel_cross_entropy_backward(*args)
    return grad, None, None, None, None, None, None, None


register("vocab_parallel_cross_entropy", _vocab_ce_backward, _vocab_ce_setup)


# linear_cross_entropy: the backward recomputes each chunk's logits ---------------------------


def _linear_ce_setup(ctx, inputs, output):
    hidden, weight, bias, target, *rest = inputs
    ctx.save_for_backward(hidden, weight, bias, target, output[1])
    ctx.args = tuple(rest)


def _linear_ce_backward(ctx, grad_loss, grad_lse):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad_hidden, grad_weight, grad_bias = torch.ops.tpx.linear_cross_entropy_backward(
        grad_loss, hidden, weight, bias, target, lse, *ctx.args, need[0], need[1],
        bias is not None and need[2])
    return (grad_hidden, grad_weight, grad_bias) + (None,) * 7


register("linear_cross_entropy", _linear_ce_backward, _linear_ce_setup)


# vocab_parallel_embedding -------------------------------------------------------------------


def _embedding_setup(ctx, inputs, output):
    weight, ids, vocab_start, group_name, scatter_dim, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.args = (vocab_start, weight.shape[0], padding_idx, group_name, scatter_dim)


def _embedding_backward(ctx, grad_out):
    (ids,) = ctx.saved_tensors
    grad_weight = torch.ops.tpx.vocab_parallel_embedding_backward(grad_out, ids, *ctx.args)
    return grad_weight, None, None, None, None, None


register("vocab_parallel_embedding", _embedding_backward, _embedding_setup)
