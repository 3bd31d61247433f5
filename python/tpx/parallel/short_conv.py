"""LFM2's short convolution mixer split by channels over the TP group (LFM2's, LFM3's).

The mixer (transformers' ``Lfm2ShortConv``) projects the hidden states once, ``in_proj ->
[B | C | x]`` (``H`` channels each), gates ``B * x``, runs a depthwise causal convolution over
it (``conv``, one filter per channel), gates the result by ``C`` and projects back with
``out_proj``. Every step but ``out_proj`` is per channel, so :class:`ShortConvParallel`
splits it as Megatron-Core splits an MLP: each rank holds its channels ``c`` (``H`` dealt as
evenly as they go) of ``B``, ``C`` and ``x`` (``in_proj`` column-parallel, rows ``c``,
``H + c`` and ``2H + c``; the input's gradient summed over the group), of the convolution,
and ``out_proj``'s columns ``c`` (row-parallel: one all-reduce, as attention's output).
The mixer's forward runs on the local tensors unchanged.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..comm.groups import balanced_bounds
from ..layout.initial import shard_in_place
from ..layout.sharding import describe_params
from .base import ParallelStyle, TPContext
from .ssm import column_linear, row_linear

__all__ = ["ShortConvParallel", "is_short_conv"]


def is_short_conv(module: nn.Module) -> bool:
    """Whether ``module`` has the parts of LFM2's short convolution mixer, of consistent
    sizes: ``in_proj`` ``[3H, hidden]``, a depthwise ``conv`` over ``H`` channels and
    ``out_proj`` ``[hidden, H]``, no others with parameters."""
    proj, out, conv = (getattr(module, a, None) for a in ("in_proj", "out_proj", "conv"))
    if not (type(proj) is nn.Linear and type(out) is nn.Linear and isinstance(conv, nn.Conv1d)):
        return False
    h = conv.in_channels
    others = [n for n, c in module.named_children() if n not in ("in_proj", "out_proj", "conv")
              and any(True for _ in c.parameters())]
    return (not others and not any(True for _ in module.parameters(recurse=False))
            and conv.groups == h == conv.out_channels and proj.out_features == 3 * h
            and out.in_features == h)


class ShortConvParallel(ParallelStyle):
    """LFM2's short convolution mixer split by channels (module docstring).

    Placement: input ``R`` (its gradient summed by ``in_proj``), output ``R`` (``out_proj``'s
    all-reduce); ``in_proj``'s rows and the convolution's this rank's channels (plain
    tensors described for ``tpx.checkpoint``: ``in_proj`` holds three segments along dim 0),
    ``out_proj``'s columns."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        what = f"ShortConvParallel({type(module).__name__})"
        if not is_short_conv(module):
            raise ValueError(f"tpx.{what}: not a short convolution mixer (it needs in_proj "
                             "[3H, hidden], a depthwise conv over H channels and out_proj "
                             "[hidden, H])")
        pg = ctx.group
        world, rank = pg.size(), dist.get_rank(pg)
        conv = module.conv
        h = conv.in_channels
        if h < world:
            raise ValueError(f"tpx.{what}: {h} channels at TP size {world}: use a TP size of "
                             f"at most {h}")
        chans = [balanced_bounds(h, r, world) for r in range(world)]
        module.in_proj = column_linear(
            module.in_proj, [[(j * h + a, j * h + b) for j in range(3)] for a, b in chans], ctx)
        module.out_proj = row_linear(module.out_proj, chans, ctx)
        rows = [[c] for c in chans]
        held = tuple(n for n in ("weight", "bias") if getattr(conv, n, None) is not None)
        shard_in_place(conv, [(n, 0, rows) for n in held], pg, ctx.src_rank, what,
                       dict(channels=h, part="conv"))
        conv.group = pg
        conv._shards = lambda rows=rows, held=held: [(n, 0, rows) for n in held]
        describe_params(conv)
        local = chans[rank][1] - chans[rank][0]
        conv.in_channels = conv.out_channels = conv.groups = local
        return module

    def __repr__(self) -> str:
        return "ShortConvParallel()"
