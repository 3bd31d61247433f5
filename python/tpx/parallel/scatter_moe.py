"""Experts in ScatterMoE's layout (JetMoE's), split over the TP group.

JetMoE keeps each set of experts as one module: a ``weight`` ``[E, out, in]`` and a forward
``(inputs, expert_size)`` that applies expert ``e``'s matrix to its block of the inputs,
sorted by expert. Two modules are built of such pairs:

* the **MoE MLP** (``JetMoeMoE``): ``input_linear`` ``[E, 2I, H]`` (each expert's
  ``[gate | up]``), ``output_linear`` ``[E, H, I]``, a router, and a bias added after the
  experts;
* the **mixture of attention** (``JetMoeAttention``, its experts a ``JetMoeMoA``):
  ``input_linear`` ``[E, K*d, H]`` gives each routed slot the queries of the ``K`` KV heads
  (``d`` features each), ``kv_proj`` ``[2*K*d, H]`` the keys and values they share, and
  ``output_linear`` ``[E, H, K*d]`` each slot's output projection.

:class:`ScatterMoEParallel` splits both as Megatron-Core splits an MLP and attention: each
rank holds its block of every expert's ``I`` features (the MLP) or of the ``K`` heads, with
their queries, keys, values and output columns (the attention), dealt as evenly as they go.
The module's own forward runs on the local weights; the router and the biases stay whole.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm.groups import balanced_bounds, copied_with_module
from ..layout.initial import shard_in_place
from ..layout.sharding import describe_params
from .base import ParallelStyle, TPContext
from .ssm import column_linear

__all__ = ["ScatterMoEParallel", "scatter_moe_style"]


def _experts(module: Optional[nn.Module]) -> Optional[Tuple[Tensor, Tensor]]:
    """``(input weight, output weight)`` of a module holding ScatterMoE's expert pair."""
    if module is None:
        return None
    inp, out = getattr(module, "input_linear", None), getattr(module, "output_linear", None)
    w_in, w_out = getattr(inp, "weight", None), getattr(out, "weight", None)
    if not (isinstance(w_in, Tensor) and isinstance(w_out, Tensor) and w_in.dim() == 3
            and w_out.dim() == 3 and w_in.shape[0] == w_out.shape[0]
            and w_in.shape[2] == w_out.shape[1] and isinstance(getattr(module, "router", None),
                                                               nn.Module)):
        return None
    return w_in, w_out


def _kind(module: nn.Module) -> Optional[str]:
    """``"mlp"`` (``[gate | up]`` then down), ``"attention"`` (heads of ``head_dim``, keys and
    values from ``kv_proj``) or ``None``."""
    pair = _experts(module)
    if pair is not None and pair[0].shape[1] == 2 * pair[1].shape[2]:
        return "mlp"
    pair = _experts(getattr(module, "experts", None))
    kv, d = getattr(module, "kv_proj", None), getattr(module, "head_dim", None)
    if (pair is not None and isinstance(kv, nn.Linear) and isinstance(d, int) and d > 0
            and pair[0].shape[1] == pair[1].shape[2] and pair[1].shape[2] % d == 0
            and kv.out_features == 2 * pair[1].shape[2]):
        return "attention"
    return None


def scatter_moe_style(module: nn.Module) -> Optional["ScatterMoEParallel"]:
    """The style that splits ``module`` if it holds ScatterMoE's experts, else ``None``."""
    kind = _kind(module)
    if kind == "attention":
        return ScatterMoEParallel(kv_heads=module.kv_proj.out_features // 2 // module.head_dim)
    return ScatterMoEParallel() if kind == "mlp" else None


class ScatterMoEParallel(ParallelStyle):
    """A JetMoE-style MoE MLP or mixture of attention (module docstring) split over the group.

    * MLP: ``input_linear`` keeps rows ``c`` and ``I + c`` of every expert (``c`` this rank's
      block of the ``I`` features), ``output_linear`` columns ``c``.
    * Attention: of the ``K`` KV heads this rank's block ``h``: ``input_linear``'s rows of
      their queries, ``kv_proj`` (a :class:`tpx.ColumnParallelLinear`) the rows of their keys
      and values, ``output_linear``'s columns; the module is told its local widths.

    Placement: input ``R``; ``output_linear``'s output, a partial sum on each rank, is summed
    over the group (one all-reduce per call, before the routing weights and the bias, which
    stay whole); the gradient of ``input_linear``'s input is summed in the backward. Every
    ``I`` (or ``K``) at least the TP size. The expert weights are this rank's plain tensors,
    described for ``tpx.checkpoint`` and ``save_pretrained``.

    ``kv_heads``: the attention's KV heads, where known before it is applied, so that a plan
    at a TP size above them keeps it whole (``ModelPlan.fit_to``) rather than failing."""

    def __init__(self, kv_heads: Optional[int] = None) -> None:
        self.kv_heads = kv_heads

    def local_heads(self, world: int, rank: int) -> Tuple[int, int]:
        """This rank's KV heads (``(heads, heads)``); ``ValueError`` where there are fewer
        than ``world``."""
        if self.kv_heads is None:
            return (0, 0)
        if self.kv_heads < world:
            raise ValueError(f"{self.kv_heads} KV heads of a mixture of attention at TP size "
                             f"{world}")
        lo, hi = balanced_bounds(self.kv_heads, rank, world)
        return (hi - lo, hi - lo)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        kind = _kind(module)
        what = f"ScatterMoEParallel({type(module).__name__})"
        if kind is None:
            raise ValueError(f"tpx.{what}: neither an MoE MLP nor a mixture of attention in "
                             "ScatterMoE's layout (input_linear / output_linear weights "
                             "[E, out, in], a router; kv_proj and head_dim for attention)")
        pg = ctx.group
        world, rank = pg.size(), dist.get_rank(pg)
        experts = module if kind == "mlp" else module.experts
        w_in, w_out = _experts(experts)
        width = w_out.shape[2]
        unit = 1 if kind == "mlp" else module.head_dim
        units = width // unit
        if units < world:
            raise ValueError(f"tpx.{what}: {units} {'features' if kind == 'mlp' else 'KV heads'}"
                             f" at TP size {world}: use a TP size of at most {units}")
        blocks = [tuple(x * unit for x in balanced_bounds(units, r, world))
                  for r in range(world)]
        if kind == "mlp":
            in_rows = [[b, (width + b[0], width + b[1])] for b in blocks]
        else:
            in_rows = [[b] for b in blocks]
            module.kv_proj = column_linear(module.kv_proj, [[b, (width + b[0], width + b[1])]
                                                       for b in blocks], ctx)
        _shard(experts.input_linear, 1, in_rows, ctx, what, "input_linear")
        _shard(experts.output_linear, 2, [[b] for b in blocks], ctx, what, "output_linear")
        local = blocks[rank][1] - blocks[rank][0]
        experts.input_linear.out_rows = in_rows  # its output's features (tpx.plans.check)
        experts.input_linear.output_size = local * (2 if kind == "mlp" else 1)
        experts.output_linear.input_size = local
        if kind == "attention":
            heads = local // unit
            experts.hidden_size = local  # the width of the slots' queries it scatters back
            ratio = module.num_heads // module.num_key_value_heads
            module.num_key_value_heads, module.num_heads = heads, heads * ratio
            module.kv_projection_size = local
        if world > 1:
            experts.input_linear.register_forward_pre_hook(copied_with_module(
                lambda mod, args, pg=pg: (mappings.all_reduce_grad(args[0], pg),) + args[1:]))
            experts.output_linear.register_forward_hook(copied_with_module(
                lambda mod, args, out, pg=pg: mappings.all_reduce_sum(out, pg)))
        return module

    def __repr__(self) -> str:
        return f"ScatterMoEParallel(kv_heads={self.kv_heads})" if self.kv_heads else \
            "ScatterMoEParallel()"


def _shard(experts: nn.Module, dim: int, rows: List[List[Tuple[int, int]]], ctx: TPContext,
           what: str, part: str) -> None:
    shard_in_place(experts, [("weight", dim, rows)], ctx.group, ctx.src_rank, what,
                   dict(shape=list(experts.weight.shape), part=part))
    experts.group = ctx.group
    experts._shards = lambda rows=rows: [("weight", dim, rows)]
    describe_params(experts)
