"""The multi-dimensional tensor-parallel operators (2-D SUMMA, 2.5-D, 3-D) and the mesh
collectives: wrappers, fake implementations and autograd side by side. The block notation
and which mesh dimension splits which tensor dimension are in :mod:`tpx.nn.multidim` and
``csrc/overlap/multidim``. Every op takes the nn.Linear weight block [out_local, in_local] and
computes x @ weight.T.

=================  ============================================================================
forward            backward
=================  ============================================================================
linear_2d          ``tpx::linear_2d_backward``: dX = dY A^T and dA = X^T dY as pipelined
                   SUMMA products (broadcast + reduce per step); with a depth group (2.5-D)
                   the weight and bias gradients are also summed over depth
linear_3d          ``tpx::linear_3d_backward``: all-gather dY, reduce-scatter dX and dA
mesh_all_reduce    all-reduce of the gradient (every rank's loss depends on the sum)
mesh_layer_norm    LayerNorm of rows whose features are split over a group: the input gradient's
                   two row means in one all-reduce; weight and bias gradients summed over the
                   batch-splitting groups
mesh_rms_norm      RMSNorm likewise: one all-reduce for the input gradient, the weight's
                   gradient summed over the batch-splitting groups
=================  ============================================================================

Each backward is told which inputs need a gradient: a frozen weight costs no weight-gradient
GEMM and no collective for it, an input without grad none for the input gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..comm.guard import guarded
from .core import call, mesh_groups, register, register_saved_first, world


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
    mesh_groups("linear_2d", (row_group, col_group, depth_group), (x, weight, bias))
    return call("linear_2d", x, weight, bias, row_group, col_group, depth_group)


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
    mesh_groups("linear_3d", (input_group, batch_group, hidden_group), (x, weight, bias),
                 chunks=chunks)
    return call("linear_3d", x, weight, bias, input_group, batch_group, hidden_group, chunks)


@guarded
def mesh_all_reduce(x: Tensor, group: str) -> Tensor:
    """Out-of-place sum of ``x`` over the group named ``group``: ``P -> R``."""
    mesh_groups("mesh_all_reduce", (group,), (x,))
    return call("mesh_all_reduce", x, group)


@guarded
def mesh_all_gather(x: Tensor, group: str) -> Tensor:
    """Every rank's ``x`` stacked in rank order: ``[world, *x.shape]``."""
    mesh_groups("mesh_all_gather", (group,), (x,))
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
    q = world(input_group)
    gathered = x.new_empty([x.shape[0] * q] + list(x.shape[1:]))
    return (x.new_empty(list(x.shape[:-1]) + [weight.shape[0] * q]), gathered,
            weight.new_empty((weight.shape[0] * q, weight.shape[1])))


@torch.library.register_fake("tpx::linear_3d_backward")
def _linear_3d_backward_fake(grad_out, x_gathered, weight_gathered, input_group, batch_group,
                             hidden_group, chunks, need_x, need_weight, need_bias):
    q = world(input_group)
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
    return x.new_empty([world(group)] + list(x.shape))


def sum_by_name(x: Tensor, group_name: str) -> Tensor:
    """The operator ``tpx::mesh_all_reduce`` alone, for tpx's own layout changes: no guard, no
    argument checks, no autograd (their callers are guarded and hold the group)."""
    return torch.ops.tpx.mesh_all_reduce(x, group_name)


# linear_2d -----------------------------------------------------------------------------------


def _linear_2d_setup(ctx, inputs, output):
    x, weight, bias, row_group, col_group, depth_group = inputs
    ctx.save_for_backward(x, weight)
    ctx.args = (row_group, col_group, depth_group, bias is not None)


def _linear_2d_backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    row_group, col_group, depth_group, has_bias = ctx.args
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = has_bias and ctx.needs_input_grad[2]
    grad_x, grad_w, grad_b = torch.ops.tpx.linear_2d_backward(
        grad_out, x, weight, row_group, col_group, depth_group, need_x, need_w, need_b)
    return grad_x, grad_w, grad_b, None, None, None


register("linear_2d", _linear_2d_backward, _linear_2d_setup)
register_saved_first("linear_2d", lambda x, weight, bias, row_group, col_group, depth_group=None:
                     (*x.shape[:-1], weight.shape[0]))


# linear_3d: the gathered input and weight are kept from the forward ---------------------------


def _linear_3d_setup(ctx, inputs, output):
    x, weight, bias, input_group, batch_group, hidden_group, chunks = inputs
    _, x_gathered, weight_gathered = output
    ctx.mark_non_differentiable(x_gathered, weight_gathered)
    ctx.save_for_backward(x_gathered, weight_gathered)
    ctx.args = (input_group, batch_group, hidden_group, chunks, bias is not None)


def _linear_3d_backward(ctx, grad_out, _grad_xg, _grad_wg):
    x_gathered, weight_gathered = ctx.saved_tensors
    input_group, batch_group, hidden_group, chunks, has_bias = ctx.args
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = has_bias and ctx.needs_input_grad[2]
    if grad_out is None:
        return None, None, None, None, None, None, None
    grad_x, grad_w, grad_b = torch.ops.tpx.linear_3d_backward(
        grad_out, x_gathered, weight_gathered, input_group, batch_group, hidden_group, chunks,
        need_x, need_w, need_b)
    return grad_x, grad_w, grad_b, None, None, None, None


register("linear_3d", _linear_3d_backward, _linear_3d_setup)


# mesh_all_reduce ------------------------------------------------------------------------------


def _mesh_all_reduce_setup(ctx, inputs, output):
    ctx.group = inputs[1]


def _mesh_all_reduce_backward(ctx, grad):
    return torch.ops.tpx.mesh_all_reduce(grad, ctx.group), None


register("mesh_all_reduce", _mesh_all_reduce_backward, _mesh_all_reduce_setup)


# The norms of the multi-dimensional layouts (tpx.nn.multidim.norm): rows whose features are
# split over ``hidden_group``; the parameters replicated over the batch-splitting groups.


def _sum_over(t: Tensor, names) -> Tensor:
    for name in names:
        t = sum_by_name(t, name)
    return t


class _LayerNormFn(torch.autograd.Function):
    """LayerNorm of rows whose features are split over ``hidden_group``.

    Forward: each rank's row mean and sum of squared deviations travel in ONE all-gather and
    are merged exactly (Chan et al.'s parallel variance), so the variance is as accurate as a
    two-pass one. Backward: the two row means the input gradient needs travel in ONE
    all-reduce; the weight and bias gradients are summed over the batch-splitting groups."""

    @staticmethod
    @guarded
    def forward(ctx, x, weight, bias, eps, features, hidden_group, batch_groups):
        xf = x.float()
        h = x.shape[-1]
        mean_r = xf.mean(-1)
        m2_r = (xf - mean_r.unsqueeze(-1)).square().sum(-1)
        stats = mesh_all_gather(torch.stack([mean_r, m2_r], -1), hidden_group)
        mean = stats[..., 0].mean(0)
        m2 = stats[..., 1].sum(0) + h * (stats[..., 0] - mean).square().sum(0)
        rstd = torch.rsqrt(m2 / features + eps)
        xhat = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        y = xhat
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.args = (features, hidden_group, batch_groups, bias is not None)
        return y.to(x.dtype)

    @staticmethod
    @guarded
    def backward(ctx, dy):
        xhat, rstd, weight = ctx.saved_tensors
        features, hidden_group, batch_groups, has_bias = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dyf = dy.float()
        grad_x = grad_w = grad_b = None
        if need_x:
            g = dyf * weight.float() if weight is not None else dyf
            sums = torch.stack([g.sum(-1), (g * xhat).sum(-1)], -1)
            means = mesh_all_reduce(sums, hidden_group) / features
            grad_x = (rstd.unsqueeze(-1) * (g - means[..., :1] - xhat * means[..., 1:])
                      ).to(dy.dtype)
        rows = dyf.reshape(-1, dyf.shape[-1])
        parts = []
        if need_w:
            parts.append((rows * xhat.reshape(rows.shape)).sum(0))
        if need_b and has_bias:
            parts.append(rows.sum(0))
        if parts:
            summed = _sum_over(torch.stack(parts), batch_groups)
            if need_w:
                grad_w = summed[0].to(weight.dtype)
            if need_b and has_bias:
                grad_b = summed[-1].to(dy.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm of rows whose features are split over ``hidden_group``: the row sum of squares
    in ONE all-reduce forward, the row sum of ``grad * weight * x`` in ONE backward; the
    weight gradient is summed over the batch-splitting groups."""

    @staticmethod
    @guarded
    def forward(ctx, x, weight, eps, features, hidden_group, batch_groups):
        xf = x.float()
        ss = mesh_all_reduce(xf.square().sum(-1, keepdim=True), hidden_group)
        rstd = torch.rsqrt(ss / features + eps)
        xn = xf * rstd
        ctx.save_for_backward(xf, rstd, weight)
        ctx.args = (features, hidden_group, batch_groups)
        if weight is None:
            return xn.to(x.dtype)
        # As Hugging Face's LlamaRMSNorm: normalise in fp32, cast, then scale.
        return weight * xn.to(x.dtype)

    @staticmethod
    @guarded
    def backward(ctx, dy):
        xf, rstd, weight = ctx.saved_tensors
        features, hidden_group, batch_groups = ctx.args
        need_x, need_w = ctx.needs_input_grad[:2]
        dyf = dy.float()
        grad_x = grad_w = None
        if need_x:
            g = dyf * weight.float() if weight is not None else dyf
            s = mesh_all_reduce((g * xf).sum(-1, keepdim=True), hidden_group)
            grad_x = (rstd * (g - xf * rstd.square() * s / features)).to(dy.dtype)
        if need_w and weight is not None:
            rows = (dyf * xf * rstd).reshape(-1, xf.shape[-1])
            grad_w = _sum_over(rows.sum(0), batch_groups).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


@guarded
def mesh_layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                    features: int, hidden_group: str, batch_groups) -> Tensor:
    """LayerNorm over ``features`` of rows whose features are split over ``hidden_group``
    (statistics merged across it exactly), with ``weight`` and ``bias`` this rank's block.

    Placement: ``x`` and the result: this rank's block of the features (and of the batch);
    ``weight``, ``bias``: the same features' block, replicated over ``batch_groups`` (their
    gradients summed over them)."""
    return _LayerNormFn.apply(x, weight, bias, eps, features, hidden_group, list(batch_groups))


@guarded
def mesh_rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, features: int,
                  hidden_group: str, batch_groups) -> Tensor:
    """RMSNorm of rows whose features are split over ``hidden_group``; placements as
    :func:`mesh_layer_norm`."""
    return _RMSNormFn.apply(x, weight, eps, features, hidden_group, list(batch_groups))
