"""The styles of a derived plan's entries (:mod:`tpx.parallel.derive`): a pair's
column-parallel sources and row-parallel sink, each rank holding the rows and columns of its
units; an RMS norm over the sink's input, split with it; the cut of per-head tensor inputs;
and the update that tells an attention module its local head counts."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm.groups import copied_with_module, head_split, shard_bounds
from ..layout.initial import shard_in_place
from ..layout.sharding import describe_params
from ..nn.ssm import GatedRMSNormParallel
from .base import ParallelStyle, TPContext
from .module_styles import ShardedAttention
from .style import ColwiseParallel, RowwiseParallel
from .trace import Pair

__all__ = ["UnitColwise", "UnitRowwise", "UnitNorm", "HeadInputs", "local_counts"]


class UnitColwise(ColwiseParallel):
    """A source of a derived pair: column-parallel, each rank holding the rows its units of
    the row-parallel projection read."""

    def __init__(self, pair: Pair, source: str) -> None:
        super().__init__()
        self.pair, self.source = pair, source

    def _plain_split(self) -> bool:
        return False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module._tpx_plain_equivalent = True  # traced: its forward computes F.linear
        return super().apply(module, ctx)

    def _out_rows(self, out_f: int, world: int):
        return self.pair.rank_rows(self.source, world)

    def __repr__(self) -> str:
        kind = f"{self.pair.heads} heads" if self.pair.heads else "columns"
        return f"ColwiseParallel(derived: the rows {self.pair.sink}'s {kind} read)"


class UnitRowwise(RowwiseParallel):
    """The row-parallel projection of a derived pair: the input columns of the units its
    sources give each rank (whole heads dealt as evenly as they go where they do not divide
    the TP size). A subclass of ``nn.Linear`` whose traced forward computes ``F.linear`` is
    replaced as a plain one."""

    def __init__(self, pair: Pair) -> None:
        super().__init__()
        self.pair = pair

    def _in_cols(self, in_f: int, world: int):
        return self.pair.sink_cols(world)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module._tpx_plain_equivalent = True
        return super().apply(module, ctx)


class UnitNorm(ParallelStyle):
    """An RMS norm over the whole input of a derived pair's row-parallel projection (BitNet's
    sub-norms): each rank holds the weight of the sink's columns it holds, and the sums of
    squares of its features are added over the group (one all-reduce forward, one backward:
    :class:`tpx.nn.ssm.GatedRMSNormParallel` with one group of every feature, no gate)."""

    def __init__(self, pair: Pair, eps: float) -> None:
        self.pair, self.eps = pair, float(eps)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        width, world = self.pair.width, pg.size()
        cols = self.pair.sink_cols(world) or [shard_bounds(width, r, world)
                                             for r in range(world)]
        shard_in_place(module, [("weight", 0, [[c] for c in cols])], pg, ctx.src_rank,
                       f"derived RMS norm before {self.pair.sink}",
                       dict(features=width, part="norm"))
        new = GatedRMSNormParallel(module.weight, cols=cols, features=width, group_size=width,
                                   eps=self.eps, group=pg)
        new._tpx_dtensor_params = True  # Shard(0) where the columns are shard_range's
        describe_params(new)
        return new

    def __repr__(self) -> str:
        return f"UnitNorm(derived: {self.pair.sink}'s input features, sums over the ranks)"


class HeadInputs(ParallelStyle):
    """Cuts the attention module's tensor inputs that hold one entry per head (ALiBi biases:
    ``[heads, ...]`` or ``[batch * heads, ...]``) to this rank's heads. An input that has a
    gradient (CPM-Ant's position bias, learned, computed once for every layer) gets it summed
    over the group: each rank's heads read their own part of it."""

    def __init__(self, heads: int, where: List[Tuple[object, int]],
                 kv_heads: Optional[int] = None) -> None:
        self.heads, self.where, self.kv_heads = heads, list(where), kv_heads

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        world, rank = ctx.group.size(), dist.get_rank(ctx.group)
        (lo, hi), _ = head_split(self.heads, self.kv_heads or self.heads, world)[rank]
        h = hi - lo

        def cut(t: Tensor, d: int) -> Tensor:
            n = t.shape[d]
            if n % self.heads == 0 and t.requires_grad and torch.is_grad_enabled():
                t = mappings.all_reduce_grad(t, ctx.group)
            if n == self.heads:
                return t.narrow(d, lo, h)
            if n % self.heads == 0:
                shape = list(t.shape)
                v = t.reshape(shape[:d] + [n // self.heads, self.heads] + shape[d + 1:])
                v = v.narrow(d + 1, lo, h)
                return v.reshape(shape[:d] + [n // self.heads * h] + shape[d + 1:])
            return t

        def hook(mod, args, kwargs):
            args = list(args)
            for key, d in self.where:
                if isinstance(key, int) and key < len(args) and isinstance(args[key], Tensor):
                    args[key] = cut(args[key], d)
                elif isinstance(key, str) and isinstance(kwargs.get(key), Tensor):
                    kwargs[key] = cut(kwargs[key], d)
            return tuple(args), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadInputs({self.where})"


_NOT_COUNTS = ("dim", "size", "idx", "layer", "window", "position", "bucket", "rotary", "rope")


def local_counts(heads: int, kv_heads: int, width: int, projections: List[str],
                 sink: Optional[str] = None):
    """``update`` for the attention module of a derived pair: the integer attributes equal to
    the heads, the KV heads or their widths, of the module and of the modules under it on the
    way to its projections (BERT's ``attention.self``), take this rank's values."""
    per = width // heads

    def update(module: nn.Module, h: int, kv: int) -> None:
        names = {n for p in projections for n in _path(p)}
        counted = {}  # path name -> the module given this rank's counts
        heads_of_rank = module.__dict__.get("_tpx_query_heads")

        def count_new(mod, args=None):
            for name, sub in mod.named_modules():
                if (not name or name in names) and counted.get(name) is not sub:
                    _set_counts(sub, h, kv)
                    counted[name] = sub
                    if heads_of_rank is not None:
                        draws_for_every_head(sub, *heads_of_rank)

        count_new(module)
        # a module the model puts in place of one of these after the split (BigBird's full
        # and block-sparse attention, built again from the config when the input's length
        # changes which one runs) gets this rank's counts before it runs
        module.register_forward_pre_hook(copied_with_module(count_new))

    def _path(proj: str) -> List[str]:  # the modules above a projection, under the owner
        parts = proj.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    def _set_counts(module: nn.Module, h: int, kv: int) -> None:
        local = {"q": h, "kv": kv, "groups": h // kv}
        widths = {width: h * per, kv_heads * per: kv * per}
        counts = {heads: h, kv_heads: kv}
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or not isinstance(value, int) or isinstance(value, bool):
                continue
            if attr in ShardedAttention.HEAD_ATTRIBUTES:
                setattr(module, attr, local[ShardedAttention.HEAD_ATTRIBUTES[attr]])
            elif value in widths and value != per:
                setattr(module, attr, widths[value])
            elif value in counts and not any(w in attr for w in _NOT_COUNTS):
                setattr(module, attr, counts[value])
    # what it was made from, for a plan carried to a model of other widths (derive_twin)
    update._tpx_counts = (heads, kv_heads, width, list(projections), sink)
    return update


def draws_for_every_head(module: nn.Module, first: int, end: int, heads: int) -> None:
    """An attention module that draws a random pattern for each head in turn from one seed
    (BigBird's block-sparse attention, its random blocks while training) draws them for all
    ``heads`` and keeps this rank's ``[first, end)``, so each head attends to the blocks it
    does on one device (drawn for the local heads only, the second rank's heads would take
    the first rank's patterns)."""
    import inspect

    names = ("_bigbird_block_rand_mask_with_head", "_bigbird_block_rand_mask")
    if (end - first) == heads or not all(hasattr(module, n) for n in names) or \
            any(n in module.__dict__ for n in names):
        return
    with_head, per_head = (getattr(module, n) for n in names)  # bound, or static
    local = end - first

    def all_heads_at_once(*args, **kwargs):
        call = inspect.signature(with_head).bind(*args, **kwargs)
        if call.arguments["num_heads"] != local:
            raise RuntimeError(f"tpx: {type(module).__name__} drew random blocks for "
                               f"{call.arguments['num_heads']} heads; this rank holds {local}")
        call.arguments["num_heads"] = heads
        return with_head(*call.args, **call.kwargs)[first:end]

    drawn: list = []  # this call's patterns of this rank's heads, one taken per head

    def one_head_at_a_time(*args, **kwargs):
        if not drawn:  # the first of this call's heads: every head's pattern, in turn
            every = [per_head(*args, **kwargs) for _ in range(heads)]
            drawn.extend(every[first:end])
        return drawn.pop(0)

    module.__dict__[names[0]] = copied_with_module(all_heads_at_once)
    module.__dict__[names[1]] = copied_with_module(one_head_at_a_time)
