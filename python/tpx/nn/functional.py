"""Functional forms of tpx's vocab-parallel layers (the ``torch.nn.functional`` of tpx)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import collectives
from .. import mappings, ops
from ..comm.checks import check_values
from ..comm.guard import guarded
from ..ops.amp import loss_dtype
from ..comm.groups import GroupLike, resolve_group, shard_bounds
from ..layout.dtensor_io import DTensor, Replicate, Shard
from ..layout.param_dtensors import local_params, read_for_input_grad, watch_params

__all__ = ["vocab_parallel_cross_entropy", "linear_cross_entropy", "default_chunk_size"]

_REDUCTIONS = ("none", "mean", "sum")


def vocab_layout(local_size: int, pg: dist.ProcessGroup, vocab_size: Optional[int] = None,
                 device: Optional[torch.device] = None) -> Tuple[int, int]:
    """``(start, full_size)`` of this rank's block of a dimension sharded over ``pg`` whose
    local size is ``local_size``. With ``vocab_size`` the layout is ``shard_range(vocab_size)``
    (checked, no communication); without it the ranks' local sizes are all-gathered (one
    integer each, on tpx's own copy of ``pg`` and counted by ``tpx.comm_stats``) and the
    blocks follow rank order, so any split is accepted."""
    rank, world = dist.get_rank(pg), pg.size()
    if vocab_size is not None:
        start, end = shard_bounds(vocab_size, rank, world)
        if end - start != local_size:
            raise ValueError(
                f"tpx: this rank holds {local_size} vocabulary entries but shard_range("
                f"{vocab_size}) gives it {end - start} ([{start}, {end})); shard the vocabulary "
                "with tpx.shard_range, or pass the right vocab_size")
        return start, vocab_size
    if world == 1:
        return 0, local_size
    mine = torch.tensor([local_size], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    collectives.all_gather(sizes, mine, pg)
    sizes = [int(s) for s in sizes]
    return sum(sizes[:rank]), sum(sizes)


def _check_loss_args(fn: str, logits: Tensor, target: Tensor, reduction: str,
                     label_smoothing: float) -> Tensor:
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise ValueError(f"tpx.{fn}: logits must be a floating-point Tensor [..., V_local]")
    if not isinstance(target, Tensor) or target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"tpx.{fn}: target must be an integer Tensor of class ids")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"tpx.{fn}: target shape {tuple(target.shape)} must equal logits.shape"
                         f"[:-1] = {tuple(logits.shape[:-1])} (logits are [..., V_local])")
    if target.device != logits.device:
        raise ValueError(f"tpx.{fn}: target is on {target.device} but logits on {logits.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"tpx.{fn}: reduction must be one of {_REDUCTIONS}; got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"tpx.{fn}: label_smoothing must lie in [0, 1]; got {label_smoothing}")
    return target.reshape(-1).long()


def _check_targets(fn: str, target: Tensor, vocab_size: int, ignore_index: int) -> None:
    def bad():
        return (target != ignore_index) & ((target < 0) | (target >= vocab_size))

    def message():
        value = int(target[bad()][0])
        return (f"tpx.{fn}: target id {value} is outside the vocabulary [0, {vocab_size}) and "
                f"is not ignore_index={ignore_index}")

    check_values(lambda: ~bad().any(), message)


def _reduce(loss_rows: Tensor, target: Tensor, ignore_index: int, reduction: str,
            shape, dtype) -> Tensor:
    if reduction == "none":
        return loss_rows.view(shape).to(dtype)
    total = loss_rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    return (total / (target != ignore_index).sum()).to(dtype)


@guarded
def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    group: GroupLike = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    inplace_backward: bool = False,
    vocab_size: Optional[int] = None,
    weight: Optional[Tensor] = None,
) -> Tensor:
    """Cross-entropy of logits sharded over the vocabulary, equal to ``F.cross_entropy`` on the
    gathered logits (``F.cross_entropy(full.reshape(-1, V), target.reshape(-1), ...)``, or of
    ``target``'s shape with ``reduction="none"``), without gathering them.

    Placement: ``logits S(-1)`` — this rank's ``[..., V_local]`` columns, in rank order
    (``tpx.shard_range(V)``; widths may differ by rank) — and ``target R`` (global ids,
    ``logits.shape[:-1]``) -> ``loss R`` (the same value on every rank).

    The four per-row statistics (max, sum of exp, target logit, sum of logits) of all ranks
    travel in ONE all-gather. Label smoothing is over the FULL vocabulary; ``ignore_index``
    rows contribute nothing and ``mean`` divides by the number of the other rows; the
    arithmetic is fp32 for bf16/fp16 logits, and the result has the logits' dtype (float32
    under ``torch.autocast``, as ``F.cross_entropy``).

    Args:
        logits: ``[..., V_local]`` floating point.
        target: integer ids in ``[0, V)`` or ``ignore_index``; others raise ``ValueError``.
        group: ``None``, a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        ignore_index, label_smoothing, reduction: as in ``F.cross_entropy``.
        inplace_backward: write the gradient over ``logits`` to save memory (``logits``
            must not be used after the loss).
        vocab_size: the full vocabulary size. When given, the shard must be
            ``shard_range(vocab_size)`` and no extra communication is needed; when omitted,
            the ranks' widths are all-gathered (one integer each) on every call.
        weight: class weights, as ``F.cross_entropy``'s: the FULL ``[V]`` tensor, the same
            on every rank (R; a ``DTensor`` is gathered); ``"mean"`` divides by the summed
            weights of the non-ignored targets. With label smoothing it costs one more
            all-reduce of three numbers per row; not with ``inplace_backward``.
    """
    fn = "vocab_parallel_cross_entropy"
    if isinstance(logits, DTensor) or isinstance(target, DTensor):
        return _dtensor_cross_entropy(logits, target, group, ignore_index, label_smoothing,
                                      reduction, inplace_backward, vocab_size, weight)
    target1 = _check_loss_args(fn, logits, target, reduction, label_smoothing)
    pg = resolve_group(group)
    width = logits.shape[-1]
    start, full = vocab_layout(width, pg, vocab_size, logits.device)
    weight = _check_class_weight(fn, weight, full, logits, inplace_backward)
    _check_targets(fn, target1, full, ignore_index)
    logits2 = logits.reshape(-1, width)
    if inplace_backward and not logits2.is_contiguous():
        raise ValueError(f"tpx.{fn}: inplace_backward=True needs contiguous logits")
    if weight is not None:
        return _weighted_cross_entropy(logits2, target1, weight, start, full, pg, ignore_index,
                                       float(label_smoothing), reduction, target.shape,
                                       loss_dtype(logits))
    loss_rows, _ = ops.vocab_parallel_cross_entropy_rows(
        logits2, target1, start, full, pg, ignore_index, float(label_smoothing),
        bool(inplace_backward))
    return _reduce(loss_rows, target1, ignore_index, reduction, target.shape,
                   loss_dtype(logits))


def _check_class_weight(fn: str, weight, classes: int, logits: Tensor,
                        inplace_backward: bool) -> Optional[Tensor]:
    if weight is None:
        return None
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 1:
        raise ValueError(f"tpx.{fn}: `weight` must be a 1-D floating-point Tensor of the {classes} "
                         "class weights (the full vocabulary's, the same on every rank)")
    if weight.shape[0] != classes:
        raise ValueError(f"tpx.{fn}: `weight` has {weight.shape[0]} entries but the vocabulary "
                         f"has {classes} classes; pass the FULL weight vector on every rank, not "
                         "this rank's block")
    if weight.device != logits.device:
        raise ValueError(f"tpx.{fn}: `weight` is on {weight.device} but the logits on "
                         f"{logits.device}")
    if inplace_backward:
        raise ValueError(f"tpx.{fn}: inplace_backward=True does not take class weights; drop "
                         "one of them")
    return weight


def _weighted_cross_entropy(logits2: Tensor, target1: Tensor, weight: Tensor, start: int,
                            full: int, pg, ignore_index: int, eps: float, reduction: str, shape,
                            dtype) -> Tensor:
    """``F.cross_entropy(full_logits, target, weight, ...)`` from this rank's columns: the rows'
    negative log-likelihoods come from the fused operator, scaled by the target's weight;
    with label smoothing the operator gives ``lse - mean(x)`` per row and one all-reduce adds
    the rows' sums of the logits, of the weighted logits and the target logit (PyTorch's
    smoothing term is ``sum_c w_c (lse - x_c)``)."""
    valid = target1 != ignore_index
    safe = torch.where(valid, target1, torch.zeros_like(target1))
    w_t = weight.gather(0, safe) * valid
    width = logits2.shape[1]
    if eps == 0:
        nll, _ = ops.vocab_parallel_cross_entropy_rows(logits2, target1, start, full, pg,
                                                        ignore_index, 0.0, False)
        rows = w_t * nll
        smooth = None
    else:
        flat, _ = ops.vocab_parallel_cross_entropy_rows(logits2, target1, start, full, pg,
                                                         ignore_index, 1.0, False)
        x = logits2.float()
        local = target1 - start
        held = valid & (local >= 0) & (local < width)
        if width:
            picked = x.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
            picked = torch.where(held, picked, torch.zeros_like(picked))
        else:
            picked = x.new_zeros(x.shape[0])
        w_local = weight[start:start + width].float()
        stats = mappings.all_reduce_sum(torch.stack([x.sum(1), x @ w_local, picked]), pg)
        lse = flat + stats[0] / full
        nll = torch.where(valid, lse - stats[2], torch.zeros_like(lse))
        smooth = torch.where(valid, weight.sum().float() * lse - stats[1], torch.zeros_like(lse))
        rows = (1.0 - eps) * w_t * nll + (eps / full) * smooth
    if reduction == "none":
        return rows.view(shape).to(dtype)
    total = rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    return (total / w_t.sum()).to(dtype)


def _dtensor_cross_entropy(logits, target, group, ignore_index, label_smoothing, reduction,
                           inplace_backward, vocab_size, weight=None) -> Tensor:
    """:func:`vocab_parallel_cross_entropy` of DTensor logits on a 1-D mesh (the output of a
    ``ColwiseParallel(use_local_output=False)`` head, after the ops a training loop puts in
    between: ``flatten``, ``float()``, ``view``): redistributed to ``Shard(-1)`` if they are
    not (one collective), made local, and the loss handed back as a ``Replicate()`` DTensor
    on the same mesh, as PyTorch's ``loss_parallel`` does. A DTensor target is made
    replicated."""
    fn = "vocab_parallel_cross_entropy"
    if not isinstance(logits, DTensor):
        target = target.full_tensor()
        return vocab_parallel_cross_entropy(
            logits, target, group=group, ignore_index=ignore_index,
            label_smoothing=label_smoothing, reduction=reduction,
            inplace_backward=inplace_backward, vocab_size=vocab_size, weight=weight)
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"tpx.{fn}: the logits are a DTensor on a {mesh.ndim}-D mesh; pass the "
                         "logits of the 1-D TP mesh (e.g. the output of a head sharded over "
                         "mesh['tp']), or a tpx.init_mesh mesh to tpx.loss_parallel")
    pg = mesh.get_group()
    if group is not None:
        given = resolve_group(group)
        if given.group_name != pg.group_name and tuple(
                torch.distributed.get_process_group_ranks(given)) != tuple(
                mesh.mesh.flatten().tolist()):
            raise ValueError(f"tpx.{fn}: the logits are a DTensor over the ranks "
                             f"{mesh.mesh.flatten().tolist()}, not over the group passed")
    full = logits.shape[-1]
    if vocab_size is not None and vocab_size != full:
        raise ValueError(f"tpx.{fn}: vocab_size={vocab_size} but the DTensor logits have "
                         f"{full} classes")
    want = Shard(logits.dim() - 1)
    if tuple(logits.placements) != (want,):
        logits = logits.redistribute(mesh, [want])
    if isinstance(target, DTensor):
        target = target.full_tensor()
    loss = vocab_parallel_cross_entropy(
        logits.to_local(), target, group=pg, ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=reduction,
        inplace_backward=inplace_backward, vocab_size=full, weight=weight)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


# Fewest tokens per chunk by default. A chunk's token count is the inner dimension of its
# weight-gradient GEMM, and short chunks run far below a GPU's rate: on an H200 (8192 tokens,
# d = 4096, V = 128256, bf16, world size 1) 130-token chunks took 116 ms forward + backward,
# 1024-token chunks 56 ms, 4096-token chunks 54 ms, the unfused head + loss 43 ms
# (benchmarks/bench_gpu.py).
MIN_CHUNK_TOKENS = 1024


def default_chunk_size(vocab_size: int, world_size: int) -> int:
    """Tokens per chunk of :func:`linear_cross_entropy` when ``chunk_size`` is not given: a
    chunk's fp32 logits take about 64 MiB on the widest shard, but a chunk holds at least
    1024 tokens (``MIN_CHUNK_TOKENS``: shorter chunks make slow GEMMs; 512 MiB of fp32 logits
    at a 128k vocabulary on one rank). Every chunk shapes two collectives (the statistics'
    all-gather, the hidden gradient's all-reduce), so the size comes from the full vocabulary
    and the group size, which all ranks share, never from this rank's (possibly narrower)
    shard."""
    widest = -(-vocab_size // max(world_size, 1))
    return max(MIN_CHUNK_TOKENS, (1 << 24) // max(widest, 1))


@guarded
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    *,
    group: GroupLike = None,
    bias: Optional[Tensor] = None,
    chunk_size: Optional[int] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    vocab_size: Optional[int] = None,
) -> Tensor:
    """The LM head and the vocab-parallel cross-entropy fused:
    ``vocab_parallel_cross_entropy(hidden @ weight.T + bias, target)`` without ever holding the
    logits of all tokens. Tokens are processed ``chunk_size`` at a time, so the peak memory
    of the logits is ``O(chunk_size x V_local)``; the backward recomputes each chunk's logits
    and overwrites them with their gradient.

    Placement: ``hidden R [..., d]``, ``weight S(0) [V_local, d]`` (this rank's vocabulary
    rows, ``tpx.shard_range(V)``), ``bias S(0) [V_local]``, ``target R`` -> ``loss R``.
    ``weight`` (and ``bias``) may be the ``DTensor`` parameters of a column-parallel LM head
    (``Shard(0)`` of ``[V, d]``): their local rows are used, the vocabulary is their global
    size, and their gradients come back as ``DTensor`` s.
    Gradients of ``hidden`` (R, summed over the vocabulary shards), ``weight`` and ``bias``
    (this rank's rows) equal those of the unfused computation.

    Args:
        chunk_size: tokens per chunk, the same on every rank; default
            (:func:`default_chunk_size`): a chunk's fp32 logits take about 64 MiB on the widest
            shard, and a chunk holds at least 1024 tokens; derived from the full vocabulary so
            every rank picks the same size.
        The others: as in :func:`vocab_parallel_cross_entropy`.
    """
    fn = "linear_cross_entropy"
    if isinstance(weight, DTensor):
        if tuple(weight.placements) != (Shard(0),):
            raise ValueError(f"tpx.{fn}: a DTensor weight must be Shard(0) (vocabulary rows) on "
                             f"a 1-D mesh; got placements {weight.placements}")
        if vocab_size is None:
            vocab_size = weight.shape[0]
        if group is None:
            group = weight.device_mesh.get_group()
        watched = weight
        weight, bias = local_params(weight, bias)
    else:
        watched = None
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        raise ValueError(f"tpx.{fn}: hidden must be a floating-point Tensor [..., d]")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"tpx.{fn}: weight must be [V_local, d] with d = hidden.shape[-1] = "
                         f"{hidden.shape[-1]}; got {tuple(getattr(weight, 'shape', ()))}")
    fake_logits = hidden.new_empty(()).expand(*hidden.shape[:-1], weight.shape[0])
    target1 = _check_loss_args(fn, fake_logits, target, reduction, label_smoothing)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"tpx.{fn}: chunk_size must be an int >= 1; got {chunk_size!r}")
    pg = resolve_group(group)
    start, full = vocab_layout(weight.shape[0], pg, vocab_size, hidden.device)
    if chunk_size is None:
        chunk_size = default_chunk_size(full, pg.size())
    _check_targets(fn, target1, full, ignore_index)
    loss_rows, _ = ops.linear_cross_entropy_rows(
        hidden.reshape(-1, hidden.shape[-1]), weight, target1, start, full, pg, bias,
        chunk_size, ignore_index, float(label_smoothing))
    # The weight is read for the hidden states' gradient.
    loss_rows = watch_params(loss_rows, watched, read=read_for_input_grad(hidden, watched))
    return _reduce(loss_rows, target1, ignore_index, reduction, target.shape,
                   loss_dtype(hidden))


def gaussian_topk(x: Tensor, sparsity: float, features: int,
                  group: Optional[GroupLike] = None) -> Tensor:
    """Gemma 3n's activation sparsity over features split across ``group``: ``relu(x - (mean +
    std * Phi^-1(sparsity)))``, the mean and the (biased) standard deviation taken over all
    ``features`` of the last dimension, of which ``x`` holds this rank's. Two all-reduces of
    one value per row (the sum, then the sum of squared deviations), their gradients summed
    over the group in the backward. Placement: ``x`` ``S(-1)``, output ``S(-1)``; ``features``
    the full count, the same on every rank."""
    pg = resolve_group(group)
    multiplier = torch.distributions.normal.Normal(0, 1).icdf(
        torch.tensor(sparsity, dtype=torch.float32, device=x.device)).to(x.dtype)

    def over_ranks(t: Tensor) -> Tensor:
        return mappings.all_reduce_sum(mappings.all_reduce_grad(t, pg), pg)

    mean = over_ranks(x.sum(-1, keepdim=True)) / features
    var = over_ranks((x - mean).pow(2).sum(-1, keepdim=True)) / features
    return torch.relu(x - (mean + var.sqrt() * multiplier))
