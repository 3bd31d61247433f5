"""The tpx operators: typed Python wrappers over ``torch.ops.tpx.*`` and their fake (meta)
implementations, so ``torch.compile`` and ``torch.library.opcheck`` can trace them.

Placements (per rank of the group; R = replicated, S(d) = sharded on dim d, P = partial):

===========================  ======================================  ===========================
op                           inputs                                  outputs
===========================  ======================================  ===========================
``all_gather_matmul``        a S(gather_dim), b R or S(1)            a_gathered R, out S(1)*
``matmul_reduce_scatter``    a S(-1), b S(0)                         out S(scatter_dim)
``matmul_all_reduce``        a S(-1), b S(0)                         out R
``replicated_matmul``        a R, b S(1)                             out S(-1)
``vocab_parallel_cross_``    logits S(1) [N, V_local], target R      loss R [N], lse R [N]
``entropy_rows``
``linear_cross_entropy_``    hidden R, weight S(0), target R         loss R [N], lse R [N]
``rows``
``vocab_parallel_embedding`` weight S(0), ids R                      out R, or S(scatter_dim)
===========================  ======================================  ===========================

(*) ``out`` is R when ``b`` is replicated and S(-1) when ``b`` holds this rank's columns.

Under ``torch.autocast`` every op follows its torch counterpart (GEMMs in the autocast
dtype, the loss in float32, the embedding untouched; see :mod:`tpx.amp`).

Every op is differentiable (see :mod:`tpx.autograd`); ``chunks`` is the pipeline depth:
``1`` runs the collective and the GEMM one after the other (the reference), ``None`` picks
the default (``tpx.build_info()["default_chunks"]``, or ``TPX_DEFAULT_CHUNKS``).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (loads the operator library)
from . import amp as _amp  # the operators' torch.autocast kernels (and the eager casts)
from .comm_groups import guarded, own as _own, own_by_name as _own_by_name
from .group import GroupLike, check_same_on_ranks, resolve_group

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "replicated_matmul",
    "vocab_parallel_cross_entropy_rows",
    "vocab_parallel_embedding",
    "linear_cross_entropy_rows",
    "local_matmul",
    "cpu_gemm_backend",
]


@guarded
def all_gather_matmul(
    a: Tensor,
    b: Tensor,
    gather_dim: int,
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
    return_gathered: bool = True,
) -> Tuple[Optional[Tensor], Tensor]:
    """``out = all_gather(a, gather_dim) @ b (+ bias)``, with the all-gather of one piece of
    ``a`` in flight while the GEMM of another runs.

    Placement: ``a S(gather_dim), b S(1) -> a_gathered R, out S(1)`` (``b`` and ``bias`` may
    also be replicated, giving ``out R``).

    Args:
        a: ``[..., k]``, this rank's shard along ``gather_dim`` (any dim but the last); every
            rank's shard has the same shape.
        b: ``[k, n]``; a transposed view such as ``linear.weight.t()`` is used without a copy.
        gather_dim: the dimension of ``a`` that is gathered.
        group: ``None`` (default group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        chunks: pipeline depth; ``1`` is the non-overlapped reference, ``None`` the default.
        bias: optional ``[n]``, added to every row of ``out``.
        return_gathered: ``False`` returns ``None`` for ``a_gathered``: the op gathers ``a``
            chunk by chunk, and putting the chunks in rank order costs one copy when the
            pipeline has more than one chunk, which callers that only want ``out`` skip.

    Returns:
        ``(a_gathered, out)``: ``a`` gathered along ``gather_dim`` in rank order, and the
        product, both with ``a.shape[gather_dim] * world_size`` entries along ``gather_dim``.
    """
    # b (and bias) may hold a different number of columns on each rank; a may not differ.
    name = _group_name("all_gather_matmul", group, a, gather_dim=gather_dim, k=b.shape[0],
                       chunks=chunks)
    staged, out = _call("all_gather_matmul", a, b, gather_dim, name, chunks, bias)
    if not return_gathered:
        return None, out
    return _rank_major(staged, a, gather_dim, _world(name), chunks), out


def _rank_major(staged: Tensor, a: Tensor, gather_dim: int, world: int,
                chunks: Optional[int]) -> Tensor:
    """``all_gather_matmul``'s gathered input in rank order. The op gathers pipeline chunk
    ``j`` of every rank into one block (chunk-major: chunk 0 of ranks 0..W-1, then chunk 1,
    ...); with one chunk that already is rank order."""
    gd = gather_dim % a.dim()
    extent = a.shape[gd]
    # The op chose its depth from the bytes of the tensor it gathered: under autocast that is
    # the cast copy of `a` (the dtype of `staged`), not `a` itself.
    depth = 1 if world == 1 else _C.pipeline_depth(chunks, extent,
                                                   a.numel() * staged.element_size())
    if depth == 1:
        return staged
    base, extra = divmod(extent, depth)
    order, lo = [], 0
    spans = []
    for j in range(depth):
        length = base + (1 if j < extra else 0)
        spans.append((lo, length))
        lo += length
    for lo, length in spans:  # staged position -> rank-major position
        for r in range(world):
            order.extend(range(r * extent + lo, r * extent + lo + length))
    index = torch.empty(len(order), dtype=torch.long)
    index[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return staged.index_select(gd, index.to(staged.device))


@guarded
def matmul_reduce_scatter(
    a: Tensor,
    b: Tensor,
    scatter_dim: int,
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``out = reduce_scatter(a @ b (+ bias), scatter_dim)``: the GEMM of one piece runs while
    the previous piece is being reduce-scattered.

    Placement: ``a S(-1), b S(0) -> out S(scatter_dim)``; the sum over ranks of ``a @ b`` is
    the full product, and rank ``r`` receives the ``r``-th block of it along ``scatter_dim``.

    Args:
        a: ``[..., k_r]``, this rank's slice of the contraction dimension; ``a.shape[scatter_dim]``
            must divide by the group size.
        b: ``[k_r, n]``; a transposed view such as ``weight.t()`` is used without a copy.
        scatter_dim: the dimension of the product that is scattered (not the last).
        group, chunks: as in :func:`all_gather_matmul`.
        bias: optional replicated ``[n]``, added once to the reduced result.
    """
    name = _group_name("matmul_reduce_scatter", group, bias, scatter_dim=scatter_dim,
                       out_shape=(*a.shape[:-1], b.shape[1]), a_dtype=str(a.dtype),
                       chunks=chunks)
    return _call("matmul_reduce_scatter", a, b, scatter_dim, name, chunks, bias)


@guarded
def matmul_all_reduce(
    a: Tensor,
    b: Tensor,
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``out = all_reduce(a @ b (+ bias))``: the GEMM of row chunk ``i+1`` runs while chunk
    ``i`` is all-reduced.

    Placement: ``a S(-1), b S(0) -> out R``.

    Args:
        a: ``[..., k_r]``, this rank's slice of the contraction dimension.
        b: ``[k_r, n]``.
        group, chunks: as in :func:`all_gather_matmul`.
        bias: optional replicated ``[n]``, added once to the reduced result.
    """
    # The contraction width (b.shape[0]) may differ by rank; the output shape may not.
    name = _group_name("matmul_all_reduce", group, bias, out_shape=(*a.shape[:-1], b.shape[1]),
                       a_dtype=str(a.dtype), chunks=chunks)
    return _call("matmul_all_reduce", a, b, name, chunks, bias)


@guarded
def replicated_matmul(
    a: Tensor,
    b: Tensor,
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``out = a @ b (+ bias)`` for a replicated input: no communication forward; backward
    all-reduces the input gradient, issued before the weight-gradient GEMM and waited after it
    (the column-parallel linear without sequence parallelism).

    Placement: ``a R, b S(1) -> out S(-1)``; ``grad_a`` is R (summed over ranks).
    """
    name = _group_name("replicated_matmul", group, a, chunks=chunks)
    return _call("replicated_matmul", a, b, name, chunks, bias)


def local_matmul(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``out = a @ b (+ bias)`` on this rank alone, with the GEMM the engine runs (see
    :func:`cpu_gemm_backend`): no communication, no autograd. Useful to time a rank's compute
    apart from its collectives.

    Placement: local (no group); ``a [..., k]``, ``b [k, n]`` -> ``out [..., n]``.
    """
    return torch.ops.tpx.local_matmul(a, b, bias)


def default_chunks() -> int:
    """The pipeline depth the ops use when ``chunks=None`` (``TPX_DEFAULT_CHUNKS``, else 2;
    a small message still runs as one chunk)."""
    return int(_C.build_info()["default_chunks"])


def cpu_gemm_backend() -> str:
    """The GEMM that tpx's ops run for float32 CPU tensors: ``"onednn"`` (oneDNN's matmul,
    which PyTorch ships; fp32 accuracy) or ``"aten"`` (ATen's default BLAS, the one
    ``nn.Linear`` uses). CUDA tensors always use ATen (cuBLAS).

    Chosen by ``TPX_CPU_GEMM``, read on every call: ``auto`` (default: oneDNN when PyTorch has
    it, ``torch.backends.mkldnn.enabled`` is set, and a first small product agreed exactly
    with ATen's), ``aten``, or ``onednn`` (an error when it is not available). Operands oneDNN
    cannot read in place (other strides) and other dtypes always use ATen, as do products
    under 4096 multiply-adds (under ``auto``: under 2**22, where oneDNN's call overhead
    outweighs its faster kernel)."""
    return torch.ops.tpx.cpu_gemm_backend()


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
    name = _group_name("vocab_parallel_cross_entropy", group, target, vocab_size=vocab_size)
    return _call("vocab_parallel_cross_entropy", logits, target, vocab_start, vocab_size, name,
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
    name = _group_name("vocab_parallel_embedding", group, ids, scatter_dim=scatter_dim,
                       dim=weight.shape[-1], weight_dtype=str(weight.dtype))
    return _call("vocab_parallel_embedding", weight, ids, vocab_start, name, scatter_dim,
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
    name = _group_name("linear_cross_entropy", group, hidden, target, vocab_size=vocab_size,
                       chunk_size=chunk_size)
    return _call("linear_cross_entropy", hidden, weight, bias, target, vocab_start, vocab_size,
                 name, chunk_size, ignore_index, label_smoothing)


# Eager calls of the differentiable operators go through a plain ``torch.autograd.Function``
# per operator, registered here by the autograd layer (:mod:`tpx.autograd`) with the same
# forward and backward as the operator's own autograd registration. The operator is then
# called below the autograd dispatch key, which skips the generic per-call work of
# ``torch.library``'s autograd kernel (about 40 us a call on a CPU). ``torch.compile`` and
# direct ``torch.ops.tpx.*`` calls use the operator's registration: one graph node per op.
# Under torch.autocast the eager path casts before the Function (tpx.amp.eager_call), where
# the operator's own Autocast kernel would cast inside it.
_EAGER_FUNCTIONS: dict = {}


def register_eager_function(op: str, function: type) -> None:
    """Makes ``function.apply(*args)`` the eager path of ``torch.ops.tpx.<op>(*args)``
    (``function.operator``, the operator's overload, is called directly, below autograd, where
    no input needs a gradient)."""
    _EAGER_FUNCTIONS[op] = function


def _call(op: str, *args):
    function = _EAGER_FUNCTIONS.get(op)
    if function is None or torch.compiler.is_compiling():
        return getattr(torch.ops.tpx, op)(*args)
    if torch._C._is_any_autocast_enabled():
        # Cast above the Function, so autograd records the casts (tpx.amp).
        return _amp.eager_call(op, function, args)
    if not (torch.is_grad_enabled() and _any_requires_grad(args)):
        # No gradient is wanted: the operator itself, with no autograd node to build.
        with torch._C._AutoDispatchBelowAutograd():
            return function.operator(*args)
    return function.apply(*args)


def _any_requires_grad(args) -> bool:
    for t in args:
        if isinstance(t, Tensor) and t.requires_grad:
            return True
    return False


def _group_name(op: str, group: GroupLike, *tensors: Optional[Tensor], **same: object) -> str:
    """Resolves ``group`` and makes sure tpx has its own copy of it where it needs one
    (:mod:`tpx.comm_groups`); with ``TPX_DEBUG_CHECKS=1`` also checks, with one extra small
    collective, that every rank calls ``op`` with the same shapes, dtypes and arguments that
    shape its collectives, so that a mismatch raises the same error on every rank instead of
    hanging one of them."""
    pg = resolve_group(group)
    _own(pg)
    if debug_checks_enabled() and pg.size() > 1 and not torch.compiler.is_compiling():
        _check_same(pg, op, tensors, same)
    return pg.group_name


def _check_same(pg, op: str, tensors, same: dict) -> None:
    meta = [None if t is None else (tuple(t.shape), str(t.dtype)) for t in tensors]
    check_same_on_ranks(pg, f"tpx.ops.{op}", dict(op=op, tensors=meta, **same))


def _mesh_groups(op: str, names, tensors, **same) -> None:
    """The multi-dimensional ops' groups (given by name): tpx's own copies, and with
    ``TPX_DEBUG_CHECKS=1`` the arguments compared over each group."""
    if torch.compiler.is_compiling():
        return
    for name in names:
        if name is not None:
            _own_by_name(name)
    if debug_checks_enabled():
        from torch.distributed.distributed_c10d import _resolve_process_group

        for name in names:
            if name is not None:
                pg = _resolve_process_group(name)
                if pg.size() > 1:
                    _check_same(pg, op, tensors, same)


def debug_checks_enabled() -> bool:
    """``TPX_DEBUG_CHECKS=1``: every collective op first checks that the ranks agree."""
    return os.environ.get("TPX_DEBUG_CHECKS", "0") == "1"

# ---------------------------------------------------------------------------------------------
# Fake implementations: shapes, dtypes and strides exactly as the C++ kernels produce them.
# ---------------------------------------------------------------------------------------------


def _world(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def _dim_first_shape(t: Tensor, dim: int) -> list:
    return list(t.movedim(dim, 0).shape)


@torch.library.register_fake("tpx::all_gather_matmul")
def _all_gather_matmul_fake(a, b, gather_dim, group_name, chunks=None, bias=None):
    gd = gather_dim % a.dim()
    shape = _dim_first_shape(a, gd)
    shape[0] = shape[0] * _world(group_name)
    gathered = a.new_empty(shape)
    out = a.new_empty(shape[:-1] + [b.shape[1]])
    return gathered.movedim(0, gd), out.movedim(0, gd).contiguous()


@torch.library.register_fake("tpx::all_gather_matmul_backward")
def _all_gather_matmul_backward_fake(grad_out, grad_a_gathered, a_gathered, b, gather_dim,
                                     group_name, chunks, need_a, need_b, bias_grad):
    gd = gather_dim % a_gathered.dim()
    shape = _dim_first_shape(a_gathered, gd)
    shape[0] = shape[0] // _world(group_name)
    grad_a = a_gathered.new_empty(shape).movedim(0, gd) if need_a else None
    grad_b = b.new_empty((b.shape[1], b.shape[0])).t() if need_b else None
    grad_bias = grad_out.new_empty((b.shape[1],)) if bias_grad else None
    return grad_a, grad_b, grad_bias


@torch.library.register_fake("tpx::matmul_reduce_scatter")
def _matmul_reduce_scatter_fake(a, b, scatter_dim, group_name, chunks=None, bias=None):
    sd = scatter_dim % a.dim()
    shape = _dim_first_shape(a, sd)
    shape[0] = shape[0] // _world(group_name)
    shape[-1] = b.shape[1]
    return a.new_empty(shape).movedim(0, sd).contiguous()


@torch.library.register_fake("tpx::matmul_reduce_scatter_backward")
def _matmul_reduce_scatter_backward_fake(grad_out, a, b, scatter_dim, group_name, chunks,
                                         need_a, need_b, bias_grad):
    sd = scatter_dim % a.dim()
    grad_a = a.new_empty(_dim_first_shape(a, sd)).movedim(0, sd) if need_a else None
    grad_b = b.new_empty((b.shape[1], b.shape[0])).t() if need_b else None
    grad_bias = grad_out.new_empty((b.shape[1],)) if bias_grad else None
    return grad_a, grad_b, grad_bias


def _local_matmul_fake(a, b, group_name, chunks=None, bias=None):
    return a.new_empty(list(a.shape[:-1]) + [b.shape[1]])


torch.library.register_fake("tpx::matmul_all_reduce")(_local_matmul_fake)
torch.library.register_fake("tpx::replicated_matmul")(_local_matmul_fake)


@torch.library.register_fake("tpx::local_matmul")
def _local_matmul_only_fake(a, b, bias=None):
    return _local_matmul_fake(a, b, None, bias=bias)


@torch.library.register_fake("tpx::matmul_all_reduce_backward")
def _matmul_all_reduce_backward_fake(grad_out, a, b, need_a, need_b, bias_grad):
    grad_a = a.new_empty(a.shape) if need_a else None
    grad_b = b.new_empty((b.shape[1], b.shape[0])).t() if need_b else None
    grad_bias = grad_out.new_empty((b.shape[1],)) if bias_grad else None
    return grad_a, grad_b, grad_bias


@torch.library.register_fake("tpx::replicated_matmul_backward")
def _replicated_matmul_backward_fake(grad_out, a, b, group_name, chunks, need_a, need_b,
                                     bias_grad):
    return _matmul_all_reduce_backward_fake(grad_out, a, b, need_a, need_b, bias_grad)


@torch.library.register_fake("tpx::vocab_parallel_cross_entropy")
def _vocab_parallel_cross_entropy_fake(logits, target, vocab_start, vocab_size, group_name,
                                       ignore_index, label_smoothing, inplace_backward):
    rows = logits.shape[0]
    acc = _loss_dtype(logits.dtype)
    return logits.new_empty((rows,), dtype=acc), logits.new_empty((rows,), dtype=acc)


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
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
    shape = _dim_first_shape(ids, sd) + [dim]
    shape[0] = shape[0] // _world(group_name)
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


# ---------------------------------------------------------------------------------------------
# Multi-dimensional tensor parallelism (2-D SUMMA, 2.5-D, 3-D): the block notation and which
# mesh dimension splits which tensor dimension are in tpx.nn.multidim and csrc/overlap/multidim.
# Every op takes the nn.Linear weight block [out_local, in_local] and computes x @ weight.T.
# ---------------------------------------------------------------------------------------------


@guarded
def linear_2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], row_group: str,
              col_group: str, depth_group: Optional[str] = None) -> Tensor:
    """2-D SUMMA ``Y = X A`` (``A = W^T``) over a q x q grid, q pipelined steps: step ``l``
    broadcasts ``X_il`` along the mesh row and ``A_lj`` along the mesh column while step
    ``l-1``'s GEMM accumulates ``X_i(l-1) A_(l-1)j``.

    Placement (rank ``(i, j)``: ``i`` its index in ``row_group``, ``j`` in ``col_group``):
    ``x = X_ij [B/q, ..., k/q]`` (S(0) over "row", S(-1) over "col"), ``weight = W_ji
    [n/q, k/q]`` (``A_ij``), ``bias`` block ``j [n/q]`` (R over "row") ->
    ``y = Y_ij [B/q, ..., n/q]`` (S(0) over "row", S(-1) over "col").

    ``depth_group`` (2.5-D): the weight is replicated over it, so the backward sums the weight
    and bias gradients over it; the forward does not use it.
    """
    _mesh_groups("linear_2d", (row_group, col_group, depth_group), (x, weight, bias))
    return _call("linear_2d", x, weight, bias, row_group, col_group, depth_group)


@guarded
def linear_3d(x: Tensor, weight: Tensor, bias: Optional[Tensor], input_group: str,
              batch_group: str, hidden_group: str,
              chunks: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """3-D ``Y = X A``: all-gather ``x`` over ``batch_group`` and ``weight`` over
    ``input_group``, GEMM, reduce-scatter over ``hidden_group``; row chunk ``c+1``'s gathers
    are in flight during chunk ``c``'s GEMMs.

    Placement (rank ``(i, o, h)`` = its index in input/batch/hidden groups):
    ``x [B/q^2, ..., k/q]`` = rows block ``i*q + o``, features block ``h``;
    ``weight [n/q^2, k/q]`` = out block ``o*q + i``, in block ``h``; ``bias [n/q]`` = out
    block ``o`` -> ``y [B/q^2, ..., n/q]`` = rows block ``i*q + h``, out block ``o``; also
    returns ``x_gathered [B/q, ..., k/q]`` and ``weight_gathered [n/q, k/q]`` (kept for the
    backward).
    """
    _mesh_groups("linear_3d", (input_group, batch_group, hidden_group), (x, weight, bias),
                 chunks=chunks)
    return _call("linear_3d", x, weight, bias, input_group, batch_group, hidden_group, chunks)


@guarded
def mesh_all_reduce(x: Tensor, group: str) -> Tensor:
    """Out-of-place sum of ``x`` over the group named ``group``: ``P -> R``."""
    _mesh_groups("mesh_all_reduce", (group,), (x,))
    return _call("mesh_all_reduce", x, group)


@guarded
def mesh_all_gather(x: Tensor, group: str) -> Tensor:
    """Every rank's ``x`` stacked in rank order: ``[world, *x.shape]``."""
    _mesh_groups("mesh_all_gather", (group,), (x,))
    return torch.ops.tpx.mesh_all_gather(x, group)


@torch.library.register_fake("tpx::linear_2d")
def _linear_2d_fake(x, weight, bias, row_group, col_group, depth_group=None):
    return x.new_empty(list(x.shape[:-1]) + [weight.shape[0]])


@torch.library.register_fake("tpx::linear_2d_backward")
def _linear_2d_backward_fake(grad_out, x, weight, row_group, col_group, depth_group, need_x,
                             need_weight, need_bias):
    return (x.new_empty(x.shape) if need_x else None,
            weight.new_empty(weight.shape) if need_weight else None,
            grad_out.new_empty((weight.shape[0],)) if need_bias else None)


@torch.library.register_fake("tpx::linear_3d")
def _linear_3d_fake(x, weight, bias, input_group, batch_group, hidden_group, chunks=None):
    q = _world(input_group)
    gathered = x.new_empty([x.shape[0] * q] + list(x.shape[1:]))
    return (x.new_empty(list(x.shape[:-1]) + [weight.shape[0] * q]), gathered,
            weight.new_empty((weight.shape[0] * q, weight.shape[1])))


@torch.library.register_fake("tpx::linear_3d_backward")
def _linear_3d_backward_fake(grad_out, x_gathered, weight_gathered, input_group, batch_group,
                             hidden_group, chunks, need_x, need_weight, need_bias):
    q = _world(input_group)
    return (x_gathered.new_empty([x_gathered.shape[0] // q] + list(x_gathered.shape[1:]))
            if need_x else None,
            weight_gathered.new_empty((weight_gathered.shape[0] // q, weight_gathered.shape[1]))
            if need_weight else None,
            grad_out.new_empty((weight_gathered.shape[0],)) if need_bias else None)


@torch.library.register_fake("tpx::mesh_all_reduce")
def _mesh_all_reduce_fake(x, group):
    return x.new_empty(x.shape)


@torch.library.register_fake("tpx::mesh_all_gather")
def _mesh_all_gather_fake(x, group):
    return x.new_empty([_world(group)] + list(x.shape))
