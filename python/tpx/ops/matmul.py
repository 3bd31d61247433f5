"""The collective matmuls of the 1-D layers and their backward pairs: the operator wrappers
(placements in :mod:`tpx.ops`), their fake implementations for ``torch.compile``, and their
autograd, side by side.

=========================  ==================================================================
forward                    backward
=========================  ==================================================================
all_gather_matmul          grad_a = matmul_reduce_scatter(grad, b.T), overlapped with
                           grad_b = a_gathered.T @ grad  (``tpx::all_gather_matmul_backward``)
matmul_reduce_scatter      grad_a = all_gather_matmul(grad, b.T); every gathered piece also
                           feeds grad_b += a.T @ piece  (``tpx::matmul_reduce_scatter_backward``)
matmul_all_reduce          local: grad_a = grad @ b.T, grad_b = a.T @ grad
                           (``tpx::matmul_all_reduce_backward``)
replicated_matmul          grad_a = all_reduce(grad @ b.T), issued before the weight-gradient
                           GEMM and waited after it (``tpx::replicated_matmul_backward``)
=========================  ==================================================================
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _ext
from ..comm.guard import guarded
from ..comm.groups import GroupLike
from .core import (
    call, call_on_params, check_watched, dim_first_shape, dtensor_of, group_name, register,
    register_saved_first, saving_hooks, world)


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
    name = group_name("all_gather_matmul", group, a, gather_dim=gather_dim, k=b.shape[0],
                       chunks=chunks)
    staged, out = call("all_gather_matmul", a, b, gather_dim, name, chunks, bias)
    if not return_gathered:
        return None, out
    return _rank_major(staged, a, gather_dim, world(name), chunks), out


def _rank_major(staged: Tensor, a: Tensor, gather_dim: int, world: int,
                chunks: Optional[int]) -> Tensor:
    """``all_gather_matmul``'s gathered input in rank order. The op gathers pipeline chunk
    ``j`` of every rank into one block (chunk-major: chunk 0 of ranks 0..W-1, then chunk 1,
    ...); with one chunk that already is rank order."""
    gd = gather_dim % a.dim()
    extent = a.shape[gd]
    # The op chose its depth from the bytes of the tensor it gathered: under autocast that is
    # the cast copy of `a` (the dtype of `staged`), not `a` itself.
    depth = 1 if world == 1 else _ext.pipeline_depth(chunks, extent,
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
    name = group_name("matmul_reduce_scatter", group, bias, scatter_dim=scatter_dim,
                       out_shape=(*a.shape[:-1], b.shape[1]), a_dtype=str(a.dtype),
                       chunks=chunks)
    return call("matmul_reduce_scatter", a, b, scatter_dim, name, chunks, bias)


@guarded
def matmul_all_reduce(
    a: Tensor,
    b: Optional[Tensor],
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
) -> Tensor:
    """``out = all_reduce(a @ b (+ bias))``: the GEMM of row chunk ``i+1`` runs while chunk
    ``i`` is all-reduced.

    Placement: ``a S(-1), b S(0) -> out R``.

    Args:
        a: ``[..., k_r]``, this rank's slice of the contraction dimension.
        b: ``[k_r, n]``; ``None`` with ``weight``.
        group, chunks: as in :func:`all_gather_matmul`.
        bias: optional replicated ``[n]``, added once to the reduced result.
        weight: instead of ``b``, a row-parallel ``nn.Linear`` weight ``[n, k_r]`` (``b`` is
            its transpose), which may be a ``DTensor`` parameter, as may ``bias``: the
            operator then computes on their local tensors and hands their gradients back as
            ``DTensor`` s (one autograd node).
    """
    if weight is not None:
        # The contraction width may differ by rank; the output shape may not.
        name = group_name("matmul_all_reduce", group, _local(bias),
                          out_shape=(*a.shape[:-1], weight.shape[0]), a_dtype=str(a.dtype),
                          chunks=chunks)
        return call_on_params("matmul_all_reduce", (a, weight, name, chunks, bias), (1,))
    name = group_name("matmul_all_reduce", group, bias, out_shape=(*a.shape[:-1], b.shape[1]),
                       a_dtype=str(a.dtype), chunks=chunks)
    return call("matmul_all_reduce", a, b, name, chunks, bias)


def _local(t: Optional[Tensor]) -> Optional[Tensor]:
    return t._local_tensor if t is not None and hasattr(t, "_local_tensor") else t


@guarded
def replicated_matmul(
    a: Tensor,
    b: Optional[Tensor],
    group: GroupLike = None,
    chunks: Optional[int] = None,
    *,
    bias: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
) -> Tensor:
    """``out = a @ b (+ bias)`` for a replicated input: no communication forward; backward
    all-reduces the input gradient, issued before the weight-gradient GEMM and waited after it
    (the column-parallel linear without sequence parallelism).

    Placement: ``a R, b S(1) -> out S(-1)``; ``grad_a`` is R (summed over ranks).

    ``weight``: instead of ``b`` (then ``None``), a column-parallel ``nn.Linear`` weight
    ``[n_r, k]`` (``b`` is its transpose), which may be a ``DTensor`` parameter, as may
    ``bias``: the operator then computes on their local tensors and hands their gradients
    back as ``DTensor`` s (one autograd node).
    """
    name = group_name("replicated_matmul", group, a, chunks=chunks)
    if weight is not None:
        return call_on_params("replicated_matmul", (a, weight, name, chunks, bias), (1,))
    return call("replicated_matmul", a, b, name, chunks, bias)


def local_matmul(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``out = a @ b (+ bias)`` on this rank alone, with the GEMM the engine runs (see
    :func:`cpu_gemm_backend`): no communication, no autograd. Useful to time a rank's compute
    apart from its collectives.

    Placement: local (no group); ``a [..., k]``, ``b [k, n]`` -> ``out [..., n]``.
    """
    return torch.ops.tpx.local_matmul(a, b, bias)


# The layers' common call (tpx.ops.core.lean_mode): the kernels of the operators without the
# dispatcher (tpx._C.direct), the same computation as torch.ops.tpx.<op>.
_DIRECT = _ext.direct


def plain_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], group_name: str,
                 chunks: Optional[int]) -> Tensor:
    """``x @ weight.T + bias`` on local tensors, nothing recorded: the forward of a
    column-parallel layer (and of any layer at world size 1) in
    :func:`tpx.ops.core.lean_mode` ``PLAIN`` (``replicated_matmul``'s kernel: the engine's
    GEMM, no communication, a group tpx found broken refused). ``group_name`` from
    :func:`tpx.ops.core.plain_group_name`.

    Placement: ``x R``, ``weight S(0)``, ``bias S(0)`` -> ``out S(-1)``."""
    return _DIRECT.replicated_matmul(x, weight.t(), group_name, chunks, bias)


def plain_linear_all_reduce(x: Tensor, weight: Tensor, bias: Optional[Tensor], group_name: str,
                            chunks: Optional[int]) -> Tensor:
    """``all_reduce(x @ weight.T) + bias`` on local tensors, nothing recorded: the forward of a
    row-parallel layer in :func:`tpx.ops.core.lean_mode` ``PLAIN`` (``matmul_all_reduce``'s
    kernel). ``group_name`` from :func:`tpx.ops.core.plain_group_name`.

    Placement: ``x S(-1)``, ``weight S(1)``, ``bias R`` -> ``out R``."""
    return _DIRECT.matmul_all_reduce(x, weight.t(), group_name, chunks, bias)


def linear_on_params(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                     group_name: str, chunks: Optional[int]) -> Tensor:
    """A layer's training call in :func:`tpx.ops.core.lean_mode` ``ON_PARAMS``: ``op``
    (``"replicated_matmul"`` or ``"matmul_all_reduce"``) on the ``DTensor`` parameters
    ``weight`` (a Linear weight, used transposed) and ``bias`` (``None`` or a ``DTensor``),
    as one autograd node whose backward hands their gradients back as ``DTensor`` s of their
    placements (as :func:`tpx.ops.core.call_on_params` does). Placements as in the op."""
    if op == "matmul_all_reduce" and saving_hooks():
        # the input saved before the all-reduce runs (tpx.ops.core.register_saved_first)
        return call_on_params(op, (x, weight, group_name, chunks, bias), (1,))
    # Function.apply's own work before its C++ core is for functorch transforms (none are
    # active here, lean_mode checked) and costs about a tenth of the whole call.
    return _LINEAR_APPLY[op](torch._C._functorch.unwrap_if_dead(x), weight, bias, group_name,
                             chunks)


class _LinearOnParams(torch.autograd.Function):
    """The autograd node of :func:`linear_on_params`: the operator's kernels on the local
    tensors of the ``DTensor`` parameters (``tpx._C.direct``). Under ``create_graph`` the
    backward goes through ``torch.ops.tpx``, as the general path's does (these operators have
    no double backward: it raises)."""

    column = True  # replicated_matmul; False: matmul_all_reduce

    @classmethod
    def forward(cls, ctx, x, weight, bias, group_name, chunks):
        w = weight._local_tensor.t()
        b = None if bias is None else bias._local_tensor
        kernel = _DIRECT.replicated_matmul if cls.column else _DIRECT.matmul_all_reduce
        out = kernel(x, w, group_name, chunks, b)
        ctx.save_for_backward(x, w)
        # the weight is read for the input's gradient only, as nn.Linear saves it only then
        ctx.watched = ((weight, weight._version),) if x.requires_grad else ()
        ctx.args = (group_name, chunks, weight._spec, None if bias is None else bias._spec)
        return out

    @classmethod
    def backward(cls, ctx, grad_out):
        check_watched(ctx.watched)
        x, w = ctx.saved_tensors
        group_name, chunks, weight_spec, bias_spec = ctx.args
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias_spec is not None
        kernels = torch.ops.tpx if torch.is_grad_enabled() else _DIRECT
        if cls.column:
            grad_x, grad_w, grad_bias = kernels.replicated_matmul_backward(
                grad_out, x, w, group_name, chunks, need_x, need_w, need_bias)
        else:
            grad_x, grad_w, grad_bias = kernels.matmul_all_reduce_backward(
                grad_out, x, w, need_x, need_w, need_bias)
        if grad_w is not None:
            grad_w = dtensor_of(grad_w.t().contiguous(), weight_spec)
        if grad_bias is not None:
            grad_bias = dtensor_of(grad_bias, bias_spec)
        return grad_x, grad_w, grad_bias, None, None


def _linear_node(op: str, column: bool):
    node = type(f"{op}_on_params_node", (_LinearOnParams,), dict(
        column=column, __module__=__name__,
        __doc__=f"``{op}``'s node of :func:`linear_on_params`."))
    node.backward = classmethod(guarded(_LinearOnParams.backward.__func__))
    return torch._C._FunctionBase.__dict__["apply"].__get__(None, node)


_LINEAR_APPLY = {"replicated_matmul": _linear_node("replicated_matmul", True),
                 "matmul_all_reduce": _linear_node("matmul_all_reduce", False)}


def default_chunks() -> int:
    """The pipeline depth the ops use when ``chunks=None`` (``TPX_DEFAULT_CHUNKS``, else 2;
    a small message still runs as one chunk)."""
    return int(_ext.build_info()["default_chunks"])


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


@torch.library.register_fake("tpx::all_gather_matmul")
def _all_gather_matmul_fake(a, b, gather_dim, group_name, chunks=None, bias=None):
    gd = gather_dim % a.dim()
    shape = dim_first_shape(a, gd)
    shape[0] = shape[0] * world(group_name)
    gathered = a.new_empty(shape)
    out = a.new_empty(shape[:-1] + [b.shape[1]])
    return gathered.movedim(0, gd), out.movedim(0, gd).contiguous()


@torch.library.register_fake("tpx::all_gather_matmul_backward")
def _all_gather_matmul_backward_fake(grad_out, grad_a_gathered, a_gathered, b, gather_dim,
                                     group_name, chunks, need_a, need_b, bias_grad):
    gd = gather_dim % a_gathered.dim()
    shape = dim_first_shape(a_gathered, gd)
    shape[0] = shape[0] // world(group_name)
    grad_a = a_gathered.new_empty(shape).movedim(0, gd) if need_a else None
    grad_b = b.new_empty((b.shape[1], b.shape[0])).t() if need_b else None
    grad_bias = grad_out.new_empty((b.shape[1],)) if bias_grad else None
    return grad_a, grad_b, grad_bias


@torch.library.register_fake("tpx::matmul_reduce_scatter")
def _matmul_reduce_scatter_fake(a, b, scatter_dim, group_name, chunks=None, bias=None):
    sd = scatter_dim % a.dim()
    shape = dim_first_shape(a, sd)
    shape[0] = shape[0] // world(group_name)
    shape[-1] = b.shape[1]
    return a.new_empty(shape).movedim(0, sd).contiguous()


@torch.library.register_fake("tpx::matmul_reduce_scatter_backward")
def _matmul_reduce_scatter_backward_fake(grad_out, a, b, scatter_dim, group_name, chunks,
                                         need_a, need_b, bias_grad):
    sd = scatter_dim % a.dim()
    grad_a = a.new_empty(dim_first_shape(a, sd)).movedim(0, sd) if need_a else None
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



# all_gather_matmul ---------------------------------------------------------------------------


def _all_gather_matmul_setup(ctx, inputs, output):
    a, b, gather_dim, group_name, chunks, bias = inputs
    ctx.save_for_backward(output[0], b)
    ctx.args = (gather_dim, group_name, chunks, bias is not None)


def _all_gather_matmul_backward(ctx, grad_a_gathered, grad_out):
    a_gathered, b = ctx.saved_tensors
    gather_dim, group_name, chunks, has_bias = ctx.args
    if grad_out is None:
        grad_out = a_gathered.new_zeros(list(a_gathered.shape[:-1]) + [b.shape[1]])
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = has_bias and ctx.needs_input_grad[5]
    grad_a, grad_b, grad_bias = torch.ops.tpx.all_gather_matmul_backward(
        grad_out, grad_a_gathered, a_gathered, b, gather_dim, group_name, chunks, need_a, need_b,
        need_bias)
    return grad_a, grad_b, None, None, None, grad_bias


register("all_gather_matmul", _all_gather_matmul_backward, _all_gather_matmul_setup)


# matmul_reduce_scatter -----------------------------------------------------------------------


def _matmul_reduce_scatter_setup(ctx, inputs, output):
    a, b, scatter_dim, group_name, chunks, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.args = (scatter_dim, group_name, chunks, bias is not None)


def _matmul_reduce_scatter_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    scatter_dim, group_name, chunks, has_bias = ctx.args
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = has_bias and ctx.needs_input_grad[5]
    grad_a, grad_b, grad_bias = torch.ops.tpx.matmul_reduce_scatter_backward(
        grad_out, a, b, scatter_dim, group_name, chunks, need_a, need_b, need_bias)
    return grad_a, grad_b, None, None, None, grad_bias


register("matmul_reduce_scatter", _matmul_reduce_scatter_backward, _matmul_reduce_scatter_setup)


def _reduce_scattered_shape(a, b, scatter_dim, group_name, chunks=None, bias=None):
    shape = list(a.shape[:-1]) + [b.shape[1]]
    shape[scatter_dim % a.dim()] //= world(group_name)
    return shape


register_saved_first("matmul_reduce_scatter", _reduce_scattered_shape)


# matmul_all_reduce: the output is replicated, so the gradients are local ---------------------


def _matmul_all_reduce_setup(ctx, inputs, output):
    a, b, group_name, chunks, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _matmul_all_reduce_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = ctx.has_bias and ctx.needs_input_grad[4]
    grad_a, grad_b, grad_bias = torch.ops.tpx.matmul_all_reduce_backward(
        grad_out, a, b, need_a, need_b, need_bias)
    return grad_a, grad_b, None, None, grad_bias


register("matmul_all_reduce", _matmul_all_reduce_backward, _matmul_all_reduce_setup)
register_saved_first("matmul_all_reduce",
                     lambda a, b, group_name, chunks=None, bias=None: (*a.shape[:-1], b.shape[1]))


# replicated_matmul ---------------------------------------------------------------------------


def _replicated_matmul_setup(ctx, inputs, output):
    a, b, group_name, chunks, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.args = (group_name, chunks, bias is not None)


def _replicated_matmul_backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    group_name, chunks, has_bias = ctx.args
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = has_bias and ctx.needs_input_grad[4]
    grad_a, grad_b, grad_bias = torch.ops.tpx.replicated_matmul_backward(
        grad_out, a, b, group_name, chunks, need_a, need_b, need_bias)
    return grad_a, grad_b, None, None, grad_bias


register("replicated_matmul", _replicated_matmul_backward, _replicated_matmul_setup)


