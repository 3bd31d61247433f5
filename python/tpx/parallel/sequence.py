"""Pieces of the model-family plans (:mod:`tpx.parallel.plans`, :mod:`tpx.parallel.hf_plan`):
sequence parallelism over a decoder's layers (the sequence split at the first layer, padded to
a multiple of the TP size, gathered before attention and at the final norm), several styles on
one module, and a module found by the end of its name."""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..comm.groups import copied_with_module
from .. import mappings
from .style import ParallelStyle, TPContext, apply_style

__all__ = ["Chain", "ExpertsBlockSequence", "GatherSequence", "PadSequence", "SeqLength",
           "WholeOnSequence",
           "SplitSequence", "find_module"]


def find_module(model: nn.Module, suffix: str) -> Optional[str]:
    """The name of the first module whose name ends with ``suffix`` ('' for the root)."""
    for name, _ in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            return name
    return None


class SeqLength:
    """The sequence length of the forward pass under way, shared by the entries of a
    sequence-parallel plan that pads the sequence to a multiple of the TP size."""

    def __init__(self) -> None:
        self.length = self.padded = 0


def _hidden(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states")


def _replace_hidden(args, kwargs, x):
    if args:
        return (x,) + tuple(args[1:]), kwargs
    kwargs["hidden_states"] = x
    return args, kwargs


class SplitSequence(ParallelStyle):
    """At the entry of the first decoder layer: ``hidden_states R -> S(1)``. A sequence whose
    length does not divide by the TP size P is padded at its end to the next multiple of P
    (rows of zeros that never reach a real position: attention reads the sequence trimmed
    back, every other module works row by row), so every rank holds an equal block."""

    def __init__(self, seq: SeqLength) -> None:
        self.seq = seq

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        seq, world, rank = self.seq, pg.size(), dist.get_rank(pg)

        def hook(mod, args, kwargs):
            x = _hidden(args, kwargs)
            if not isinstance(x, Tensor):
                return None
            if x.dim() != 3:
                raise ValueError(f"tpx.plans (sequence_parallel=True): the first decoder layer "
                                 f"expects hidden states [batch, sequence, hidden]; got shape "
                                 f"{tuple(x.shape)}")
            n = x.shape[1]
            per = -(-n // world)
            seq.length, seq.padded = n, per * world
            if seq.padded != n:
                x = F.pad(x, (0, 0, 0, seq.padded - n))
            x = mappings.split_dim(x, 1, [per] * world, rank * per, pg)
            return _replace_hidden(args, kwargs, x)

        module.register_forward_pre_hook(copied_with_module(hook), with_kwargs=True)
        return module


def _check_block(per: int, world: int, seq: SeqLength) -> None:
    if per * world != seq.padded:
        raise ValueError(f"tpx.plans (sequence_parallel=True): a block of {per} positions on "
                         f"each of {world} ranks, but the first decoder layer split "
                         f"{seq.padded}; call the model as a whole, not a layer on its own")


def _gather_sequence(x: Tensor, seq: SeqLength, pg: dist.ProcessGroup, trim: bool) -> Tensor:
    world = pg.size()
    per = x.shape[1]
    _check_block(per, world, seq)
    if not (trim and seq.length != seq.padded):
        # Nothing to trim: the column-parallel projections reading the result (q, k, v) leave
        # their input gradients partial; their sum is reduce-scattered once.
        return mappings.gather_dim_for_partial_grads(x, 1, pg)
    x = mappings.gather_dim(x, 1, [per] * world, dist.get_rank(pg) * per, pg)
    return x.narrow(1, 0, seq.length) if trim and seq.length != seq.padded else x


class GatherSequence(ParallelStyle):
    """``hidden_states S(1) -> R`` at a module's input (``where="input"``; attention: trimmed to
    the real sequence) or at its output (``where="output"``: the final norm, so the model
    returns the full sequence and the LM head reads every position, e.g. only the last)."""

    def __init__(self, seq: SeqLength, where: str) -> None:
        self.seq, self.where = seq, where

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        seq = self.seq
        if self.where == "input":
            def pre(mod, args, kwargs):
                x = _hidden(args, kwargs)
                if not isinstance(x, Tensor):
                    return None
                return _replace_hidden(args, kwargs, _gather_sequence(x, seq, pg, True))

            module.register_forward_pre_hook(copied_with_module(pre), with_kwargs=True)
        else:
            module.register_forward_hook(
                copied_with_module(lambda mod, args, out: _gather_sequence(out, seq, pg, True)))
        return module


class ExpertsBlockSequence(ParallelStyle):
    """A mixture-of-experts block under sequence parallelism: its input
    ``hidden_states S(1) -> R``, gathered and trimmed to the real positions (its router must not
    see the padding: the load-balancing loss counts every token it routes; the input's gradient
    is whole on every rank, the experts having summed theirs, so the backward keeps this rank's
    block). Its output, padded to the length the first decoder layer split: with
    ``partial=True`` (the experts leave their output ``Partial()`` and the block adds nothing
    else) ``P -> S(1)``, one reduce-scatter along the sequence, as a dense MLP's down
    projection (the backward gathers the gradient); otherwise ``R -> S(1)``, this rank's block
    (the experts summed theirs; a shared expert every rank computes whole added to it)."""

    def __init__(self, seq: SeqLength, partial: bool = True) -> None:
        self.seq, self.partial = seq, partial

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg, seq = ctx.group, self.seq
        world, rank = pg.size(), dist.get_rank(pg)
        partial = self.partial

        batch = []  # the batch size of the call in flight

        def pre(mod, args, kwargs):
            x = _hidden(args, kwargs)
            if not isinstance(x, Tensor):
                return None
            per = x.shape[1]
            _check_block(per, world, seq)
            x = mappings.gather_dim(x, 1, [per] * world, rank * per, pg)
            if seq.length != seq.padded:
                x = x.narrow(1, 0, seq.length).contiguous()
            batch[:] = [x.shape[0]]
            return _replace_hidden(args, kwargs, x)

        def scatter(x):
            flat = x.dim() == 2 and batch and x.shape[0] == batch[0] * seq.length
            if flat:  # the block hands back its tokens flattened ([B * S, H]: Llama 4)
                x = x.view(batch[0], seq.length, x.shape[-1])
            if x.shape[1] < seq.padded:
                x = F.pad(x, (0, 0, 0, seq.padded - x.shape[1]))
            if partial:
                x = mappings.reduce_scatter_dim(x, 1, pg)
            else:
                per = seq.padded // world
                x = mappings.split_dim(x, 1, [per] * world, rank * per, pg)
            return x.reshape(-1, x.shape[-1]) if flat else x

        def post(mod, args, out):
            if isinstance(out, Tensor):
                return scatter(out)
            if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
                return (scatter(out[0]),) + out[1:]
            return out

        module.register_forward_pre_hook(copied_with_module(pre), with_kwargs=True)
        module.register_forward_hook(copied_with_module(post))
        return module

    def __repr__(self) -> str:
        return f"ExpertsBlockSequence(partial={self.partial})"


class WholeOnSequence(ExpertsBlockSequence):
    """A module the plan keeps whole (an attention it does not split: DeepSeek-V3's MLA,
    GraniteMoE's) under sequence parallelism: its input ``hidden_states S(1) -> R``, gathered
    and trimmed to the real positions; every rank computes it whole on the whole sequence and
    keeps its block of the output, ``R -> S(1)``, padded as the first decoder layer split it.
    The backward all-gathers the output's gradient, so every rank computes the same whole
    gradients (its parameters need no sum), and keeps its block of the input's."""

    def __init__(self, seq: SeqLength) -> None:
        super().__init__(seq, partial=False)

    def __repr__(self) -> str:
        return "WholeOnSequence()"


class PadSequence(ParallelStyle):
    """Before a row-parallel projection that scatters its output along the sequence: pads its
    input (the real positions) back to the length the first decoder layer split."""

    def __init__(self, seq: SeqLength) -> None:
        self.seq = seq

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        seq = self.seq

        def pre(mod, args):
            x = args[0]
            if isinstance(x, Tensor) and x.dim() == 3 and x.shape[1] < seq.padded:
                return (F.pad(x, (0, 0, 0, seq.padded - x.shape[1])),) + tuple(args[1:])
            return None

        module.register_forward_pre_hook(copied_with_module(pre))
        return module


class Chain(ParallelStyle):
    """Several styles applied to one module, in order."""

    def __init__(self, *styles: ParallelStyle) -> None:
        self.styles = styles

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        for style in self.styles:
            module = apply_style(style, module, ctx)
        return module

    def __repr__(self) -> str:
        return " + ".join(map(repr, self.styles))
