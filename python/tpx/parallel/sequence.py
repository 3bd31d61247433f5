"""Pieces of the model-family plans (:mod:`tpx.parallel.plans`, :mod:`tpx.parallel.hf_plan`):
sequence parallelism over a decoder's layers (the sequence split at the first layer, padded to
a multiple of the TP size, gathered before attention and at the final norm, or after the last
layer of a pipeline stage without it), several styles on one module, and a module found by the
end of its name."""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..comm.groups import copied_with_module
from .. import mappings
from .style import ParallelStyle, TPContext, apply_style

__all__ = ["Chain", "ExpertsBlockSequence", "GatherSequence", "PadSequence", "SeqLength",
           "WholeOnSequence", "SplitSequence", "find_module", "owned_layers",
           "stage_placeholders", "is_pipeline_stage"]


def find_module(model: nn.Module, suffix: str) -> Optional[str]:
    """The name of the first module whose name ends with ``suffix`` ('' for the root)."""
    for name, _ in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            return name
    return None


# ------------------------------------------------------------------ pipeline stages

def owned_layers(model: nn.Module, layers: str) -> List[str]:
    """The names (in the list or dict ``layers``) of the decoder layers ``model`` holds: all of
    them, or on a pipeline stage those left in it that are not an ``nn.Identity`` standing in
    for a layer of another stage (transformers' ``PipelineIdentityLayer``)."""
    return [name for name, layer in model.get_submodule(layers).named_children()
            if not isinstance(layer, nn.Identity)]


def stage_placeholders(model: nn.Module) -> List[str]:
    """The names of the modules that stand in for pieces a pipeline stage does not hold: an
    ``nn.Identity`` (transformers' ``PipelineIdentityLayer`` is one) as a child of the model,
    of its base model or of its ``layers``: in the place of the input embedding, a decoder
    layer, the final norm or the LM head."""
    layers = find_module(model, "layers")
    parents = [model, getattr(model, "base_model", model)]
    if layers is not None:
        parents.append(model.get_submodule(layers))
    ids = {id(m) for p in parents for m in p.children() if isinstance(m, nn.Identity)}
    return [n for n, m in model.named_modules() if id(m) in ids]


def is_pipeline_stage(model: nn.Module) -> bool:
    """Whether ``model`` is a pipeline stage cut from a larger model: it holds placeholders
    (:func:`stage_placeholders`), a piece set to ``None`` (``model.lm_head = None``, as
    torchtitan cuts its stages) at its top or in its base model, or fewer decoder layers than
    its config counts (``config.num_hidden_layers``)."""
    if stage_placeholders(model):
        return True
    parents = [model, getattr(model, "base_model", model)]
    if any(m is None for p in parents for m in p._modules.values()):
        return True
    layers = find_module(model, "layers")
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    count = getattr(get() if callable(get) else cfg, "num_hidden_layers", None)
    return (layers is not None and isinstance(count, int)
            and len(owned_layers(model, layers)) < count)


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
    back, every other module works row by row), so every rank holds an equal block; with
    ``pad=False`` (a plan whose attention reads the blocks gathered as they are) it raises a
    ``ValueError`` instead."""

    def __init__(self, seq: SeqLength, pad: bool = True) -> None:
        self.seq, self.pad = seq, pad

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        seq, world, rank, pad = self.seq, pg.size(), dist.get_rank(pg), self.pad

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
            if n % world and not pad:
                raise ValueError(f"tpx.plans (sequence_parallel=True): a sequence of {n} "
                                 f"positions does not split into {world} equal blocks; use a "
                                 f"length that divides by the TP size {world}")
            seq.length, seq.padded = n, per * world
            if seq.padded != n:
                x = F.pad(x, (0, 0, 0, seq.padded - n))
            x = mappings.split_dim(x, 1, [per] * world, rank * per, pg)
            return _replace_hidden(args, kwargs, x)

        module.register_forward_pre_hook(copied_with_module(hook), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return "SplitSequence()" if self.pad else "SplitSequence(pad=False)"


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
    # contiguous: the projections reading it would each copy a strided view, and a pipeline
    # stage sends its output from a buffer of the same strides
    return x.narrow(1, 0, seq.length).contiguous() if trim and seq.length != seq.padded else x


class GatherSequence(ParallelStyle):
    """``hidden_states S(1) -> R`` at a module's input (``where="input"``; attention: trimmed to
    the real sequence) or at its output (``where="output"``, trimmed too: the final norm, so the
    model returns the full sequence and the LM head reads every position, e.g. only the last;
    the last decoder layer of a pipeline stage without the final norm, so the stage hands the
    next one whole hidden states; an output tuple has them first). Backward: of a gradient
    whole on every rank (the next stage's) this rank keeps its block; the partial gradients of
    column-parallel consumers (q/k/v, the LM head) are summed and reduce-scattered once."""

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
            def post(mod, args, out):
                if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
                    return (_gather_sequence(out[0], seq, pg, True),) + out[1:]
                return _gather_sequence(out, seq, pg, True)

            module.register_forward_hook(copied_with_module(post))
        return module

    def __repr__(self) -> str:
        return f"GatherSequence({self.where!r})"


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
