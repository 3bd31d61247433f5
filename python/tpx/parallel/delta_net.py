"""Gated DeltaNet linear attention split by heads over the TP group (OLMo-hybrid's).

A Gated DeltaNet layer (transformers' ``OlmoHybridGatedDeltaNet``) projects the hidden states
into queries and keys (``q_proj``, ``k_proj``: ``Hk`` key heads of ``dk`` features), values and
an output gate (``v_proj``, ``g_proj``: ``Hv`` value heads of ``dv``), and one decay and one
write strength per value head (``a_proj``, ``b_proj``); it runs a depthwise causal convolution
over ``[q | k | v]``, the gated delta rule per value head (each key head serving ``Hv / Hk``
consecutive value heads; ``A_log`` and ``dt_bias`` one entry per value head), a gated RMS
norm per head (``o_norm``, one weight of ``dv`` shared by the heads) and ``o_proj``.

Every part but the output projection is per head, so :class:`GatedDeltaNetParallel` splits
it as attention is split: each rank holds its key heads (dealt as evenly as they go) and the
value heads they serve, that is

* the rows of ``q_proj`` and ``k_proj`` for its key heads, of ``v_proj``, ``g_proj``,
  ``a_proj`` and ``b_proj`` for its value heads (column-parallel: the input's gradient summed
  over the group);
* those heads' channels of the convolution, and their entries of ``A_log`` and ``dt_bias``;
* ``o_proj`` row-parallel over its value heads' features (one all-reduce, as attention's
  output); ``o_norm`` whole, its gradient summed over the group.

The layer's own sizes (``num_k_heads``, ``num_v_heads``, ``key_dim``, ``value_dim``,
``conv_dim``) are set to this rank's, so its own forward runs on the local tensors. Fewer key
heads than ranks cannot be dealt: such a layer stays whole (``local_heads`` raises, and
:meth:`tpx.parallel.base.ModelPlan.fit_to` leaves it whole with a warning).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch.distributed as dist
from torch import nn

from ..comm.groups import balanced_bounds
from ..layout.initial import shard_in_place
from ..layout.sharding import describe_params
from .base import ParallelStyle, TPContext, apply_style
from .module_styles import ReplicatedWithGradAllReduce
from .ssm import column_linear, row_linear

__all__ = ["GatedDeltaNetParallel", "is_gated_delta_net"]

_PROJ = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` has the parts of OLMo-hybrid's Gated DeltaNet, of consistent sizes
    (module docstring)."""
    if not all(hasattr(module, a) for a in _PROJ + _SIZES + ("conv1d", "A_log", "dt_bias")):
        return False
    if not all(type(getattr(module, a)) is nn.Linear for a in _PROJ):
        return False
    hk, hv, dk, dv = (getattr(module, a) for a in _SIZES)
    if not all(isinstance(v, int) and v > 0 for v in (hk, hv, dk, dv)) or hv % hk:
        return False
    conv = module.conv1d
    outs = {a: getattr(module, a).out_features for a in _PROJ}
    return (isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == 2 * hk * dk + hv * dv
            and outs["q_proj"] == outs["k_proj"] == hk * dk
            and outs["v_proj"] == outs["g_proj"] == hv * dv
            and outs["a_proj"] == outs["b_proj"] == hv
            and module.o_proj.in_features == hv * dv
            and tuple(module.A_log.shape) == tuple(module.dt_bias.shape) == (hv,))


def _heads_of(hk: int, hv: int, world: int, rank: int):
    """``((first, end) key heads, (first, end) value heads)`` of ``rank``: the key heads
    dealt as evenly as they go, each with the ``hv / hk`` value heads it serves."""
    if hk < world:
        raise ValueError(f"{hk} key heads of Gated DeltaNet cannot be dealt over TP size "
                         f"{world}")
    k0, k1 = balanced_bounds(hk, rank, world)
    r = hv // hk
    return (k0, k1), (k0 * r, k1 * r)


class GatedDeltaNetParallel(ParallelStyle):
    """A Gated DeltaNet layer split by heads over the TP group (module docstring).

    Placement: input ``R`` (its gradient summed by the column-parallel projections), output
    ``R`` (``o_proj``'s all-reduce); the projections' weights this rank's rows or columns,
    the convolution's and the per-head vectors' this rank's rows (plain tensors described for
    ``tpx.checkpoint``: the convolution holds three segments along dim 0)."""

    def __init__(self, key_heads: Optional[int] = None,
                 value_heads: Optional[int] = None) -> None:
        self.key_heads, self.value_heads = key_heads, value_heads

    def local_heads(self, world: int, rank: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """``((first, end) key heads, (first, end) value heads)`` of ``rank``; ``ValueError``
        where there are fewer key heads than ranks. ``key_heads`` / ``value_heads`` (read
        from the module by :meth:`apply` where not given): given before it is applied, a plan
        at a TP size above them keeps the layer whole (``ModelPlan.fit_to``)."""
        if self.key_heads is None or self.value_heads is None:
            return (0, 0), (0, 0)
        return _heads_of(self.key_heads, self.value_heads, world, rank)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        what = f"GatedDeltaNetParallel({type(module).__name__})"
        if not is_gated_delta_net(module):
            raise ValueError(f"tpx.{what}: not a Gated DeltaNet layer (it needs "
                             f"{', '.join(_PROJ)}, conv1d, A_log and dt_bias of consistent "
                             "sizes)")
        pg = ctx.group
        world, rank = pg.size(), dist.get_rank(pg)
        try:
            heads = [_heads_of(int(module.num_k_heads), int(module.num_v_heads), world, r)
                     for r in range(world)]
        except ValueError as e:
            raise ValueError(f"tpx.{what}: {e}: use a TP size of at most "
                             f"{module.num_k_heads}") from None
        dk, dv = int(module.head_k_dim), int(module.head_v_dim)
        key_dim = int(module.num_k_heads) * dk

        def rows(per: int, which: int, offset: int = 0) -> List[List[Tuple[int, int]]]:
            return [[(offset + h[which][0] * per, offset + h[which][1] * per)] for h in heads]

        q_rows, v_rows, vh_rows = rows(dk, 0), rows(dv, 1), rows(1, 1)
        for name, r in (("q_proj", q_rows), ("k_proj", q_rows), ("v_proj", v_rows),
                        ("g_proj", v_rows), ("a_proj", vh_rows), ("b_proj", vh_rows)):
            setattr(module, name, column_linear(getattr(module, name), r, ctx))
        module.o_proj = row_linear(module.o_proj, [r[0] for r in v_rows], ctx)
        conv_rows = [q + k + v for q, k, v in zip(q_rows, rows(dk, 0, key_dim),
                                                  rows(dv, 1, 2 * key_dim))]
        conv = module.conv1d
        for mod, names, r, part in ((conv, ("weight", "bias"), conv_rows, "conv1d"),
                                    (module, ("A_log", "dt_bias"), vh_rows, "heads")):
            held = tuple(n for n in names if getattr(mod, n, None) is not None)
            shard_in_place(mod, [(n, 0, r) for n in held], pg, ctx.src_rank, what,
                           dict(key_heads=module.num_k_heads, value_heads=module.num_v_heads,
                                part=part))
            mod.group = pg
            mod._shards = lambda r=r, held=held: [(n, 0, r) for n in held]
            describe_params(mod)
        (k0, k1), (v0, v1) = heads[rank]
        local = (k1 - k0) * dk * 2 + (v1 - v0) * dv
        conv.in_channels = conv.out_channels = conv.groups = local
        module.num_k_heads, module.num_v_heads = k1 - k0, v1 - v0
        module.key_dim, module.value_dim, module.conv_dim = (k1 - k0) * dk, (v1 - v0) * dv, local
        norm = getattr(module, "o_norm", None)
        if isinstance(norm, nn.Module) and any(True for _ in norm.parameters()):
            apply_style(ReplicatedWithGradAllReduce(), norm, ctx)
            # its rows are (token, this rank's head): no block of the unsharded output, so
            # tpx.plans.check compares its gradient and o_proj's output, not its own
            norm._tpx_output_interleaved = True
        return module

    def __repr__(self) -> str:
        if self.key_heads is None:
            return "GatedDeltaNetParallel()"
        return f"GatedDeltaNetParallel(key_heads={self.key_heads}, value_heads={self.value_heads})"
