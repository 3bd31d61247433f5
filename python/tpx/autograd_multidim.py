"""Autograd for the multi-dimensional tensor-parallel ops (2-D SUMMA, 2.5-D, 3-D).

=================  ============================================================================
forward            backward
=================  ============================================================================
linear_2d          ``tpx::linear_2d_backward``: dX = dY A^T and dA = X^T dY as pipelined
                   SUMMA products (broadcast + reduce per step); with a depth group (2.5-D)
                   the weight and bias gradients are also summed over depth
linear_3d          ``tpx::linear_3d_backward``: all-gather dY, reduce-scatter dX and dA
mesh_all_reduce    all-reduce of the gradient (every rank's loss depends on the sum)
=================  ============================================================================

Each backward is told which inputs need a gradient: a frozen weight costs no weight-gradient
GEMM and no collective for it, an input without grad none for the input gradient.
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401  (registers the operators and their fakes)
from .autograd import register

__all__: list = []


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
