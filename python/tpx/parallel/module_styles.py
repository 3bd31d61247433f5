"""The styles that shard no weight of their own: placements at a module's input and output
(:class:`PrepareModuleInput`, :class:`PrepareModuleOutput`), a replicated module whose
gradients are summed over the group (:class:`ReplicatedWithGradAllReduce`), and an attention
module told its local head counts (:class:`ShardedAttention`)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..comm.groups import copied_with_module, head_split
from ..layout.param_dtensors import compute_on_locals, replicate_params
from .base import ParallelStyle, TPContext, redistribute

__all__ = ["NoParallel", "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
           "ReplicatedWithGradAllReduce",
           "ShardedAttention"]


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


class LayoutsLengthError(ValueError, AssertionError):
    """Layouts of different lengths given to a style: a ``ValueError`` (tpx's bad input) that is
    also the ``AssertionError`` PyTorch's styles raise there."""


class PrepareModuleInput(ParallelStyle):
    """Redistributes the positional (and keyword) inputs of a module before it runs:
    ``input_layouts[i] -> desired_input_layouts[i]`` (``None`` leaves an input alone).

    A plain tensor is taken as this rank's part of ``input_layouts[i]`` (shards of a plain
    tensor are equal-sized); a ``DTensor`` carries its own placement. As PyTorch's, each input
    is handed on as a ``DTensor`` with placement ``desired_input_layouts[i]``, or as its local
    tensor with ``use_local_output=True``. ``Shard(d) -> Replicate()`` goes through tpx's own
    all-gather, whose gradient a column-parallel layer reading the result reduce-scatters once.
    The module must be called with as many positional inputs as ``input_layouts`` names."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False) -> None:
        self.use_local_output = use_local_output
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise LayoutsLengthError(
                "tpx.PrepareModuleInput: input_layouts and desired_input_layouts should have same "
                f"length! (got {len(self.input_layouts)} and {len(self.desired_input_layouts)}; "
                "give one desired layout per input layout, None for an input to leave alone)")
        self.kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        if len(self.kwarg_layouts) != len(self.desired_kwarg_layouts):
            raise LayoutsLengthError(
                "tpx.PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts "
                f"should have same length! (got {len(self.kwarg_layouts)} and "
                f"{len(self.desired_kwarg_layouts)}; give one desired layout per keyword)")

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        local = bool(self.use_local_output)

        def hook(mod, args, kwargs):
            if self.input_layouts and len(args) != len(self.input_layouts):
                raise ValueError(
                    "tpx.PrepareModuleInput: module inputs and input_layouts should have same "
                    f"length! ({type(mod).__name__} was called with {len(args)} positional "
                    f"inputs, but input_layouts names {len(self.input_layouts)}; give one layout "
                    "per positional input, None for an input to leave alone)")
            args = list(args)
            for i, (src, dst) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
                if src is not None or dst is not None:
                    args[i] = redistribute(args[i], src, dst, pg, local=local)
            for key, src in self.kwarg_layouts.items():
                if key in kwargs:
                    kwargs[key] = redistribute(kwargs[key], src,
                                               self.desired_kwarg_layouts.get(key), pg,
                                               local=local)
            return tuple(args), kwargs

        module.register_forward_pre_hook(copied_with_module(hook), with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Redistributes a module's output(s): ``output_layouts[i] -> desired_output_layouts[i]``."""

    def __init__(self, *, output_layouts, desired_output_layouts,
                 use_local_output: bool = True) -> None:
        self.use_local_output = use_local_output
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise LayoutsLengthError(
                "tpx.PrepareModuleOutput: output_layouts and desired_output_layouts should have "
                f"same length! (got {len(self.output_layouts)} and "
                f"{len(self.desired_output_layouts)}; give one desired layout per output)")

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        local = bool(self.use_local_output)

        def hook(mod, args, output):
            single = not isinstance(output, tuple)
            outs = (output,) if single else list(output)
            if len(outs) != len(self.output_layouts):
                raise ValueError(
                    "tpx.PrepareModuleOutput: module outputs and output_layouts should have same "
                    f"length! ({type(mod).__name__} returned {len(outs)} outputs, but "
                    f"output_layouts names {len(self.output_layouts)}; give one layout per "
                    "output, None for an output to leave alone)")
            outs = [redistribute(o, src, dst, pg, local=local)
                    for o, src, dst in zip(outs, self.output_layouts,
                                           self.desired_output_layouts)]
            return outs[0] if single else tuple(outs)

        module.register_forward_hook(copied_with_module(hook))
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module, as PyTorch's
    style of that name: the inputs redistributed ``input_layouts -> desired_input_layouts``
    (handed on as local tensors with ``use_local_input=True``), the outputs
    ``output_layouts -> desired_output_layouts`` (local tensors with ``use_local_output=True``,
    the default)."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_input: bool = False, output_layouts, desired_output_layouts,
                 use_local_output: bool = True) -> None:
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        self.prepare_module_input.apply(module, ctx)
        self.prepare_module_output.apply(module, ctx)
        return module

    def __repr__(self) -> str:
        i, o = self.prepare_module_input, self.prepare_module_output
        return (f"PrepareModuleInputOutput(input_layouts={i.input_layouts}, "
                f"desired_input_layouts={i.desired_input_layouts}, "
                f"use_local_input={i.use_local_output}, output_layouts={o.output_layouts}, "
                f"desired_output_layouts={o.desired_output_layouts}, "
                f"use_local_output={o.use_local_output})")


class NoParallel(ParallelStyle):
    """A module kept whole on every rank, computing the same thing on every rank (its inputs
    are replicated): a mixture-of-experts router, a norm outside sequence parallelism. Its
    parameters become ``Replicate()`` ``DTensor`` s on the TP mesh with the values of rank
    ``src_rank`` (the module computes on their local tensors; the gradients, already whole on
    every rank, land as ``Replicate()`` ``DTensor`` s; nothing is communicated), so that a model
    whose every parameter is a ``DTensor`` goes through torch's ``clip_grad_norm_``, foreach and
    fused optimizers and ``torch.distributed.checkpoint`` as under PyTorch's TP. torchtitan's
    ``NoParallel`` (for plain tensor inputs and outputs).

    Placement: parameters ``Replicate()`` ``DTensor`` s; inputs and outputs as they are.
    """

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        compute_on_locals(module, replicate_params(module, ctx.group))
        return module

    def __repr__(self) -> str:
        return "NoParallel()"


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module whose parameters stay whole on every rank but see only this rank's part of the
    computation: a per-head norm after a column-parallel projection (Qwen3's ``q_norm`` /
    ``k_norm``), a norm over this rank's heads. Their gradients are partial sums; this style
    sums them over the group in the backward of each call (one all-reduce for all of them),
    so the replicas stay equal and equal to one device. Hugging Face's plans call it
    ``replicated_with_grad_allreduce``.

    Placement: parameters ``Replicate()`` ``DTensor`` s (gradient P, summed to R, landing as
    ``Replicate()`` ``DTensor`` s); inputs and outputs as they are.

    Without it such a model runs, gives the right loss, and drifts: the ranks' copies of the
    parameter differ after the first optimizer step. ``tpx.check_replicas(model)`` finds that.
    """

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        if next(module.parameters(), None) is None:
            raise ValueError(f"tpx.ReplicatedWithGradAllReduce: {type(module).__name__} has no "
                             "parameter to sum the gradient of")
        # Replicate() DTensors, as under SequenceParallel (one kind of parameter for torch's
        # clip_grad_norm_, foreach optimizers and DCP); the module computes on their local
        # tensors, swapped in for its forward only.
        # The gradients are summed in the backward of each call (part of its autograd graph):
        # a parameter frozen now (a norm under LoRA fine-tuning) and made trainable later too.
        compute_on_locals(module, replicate_params(module, pg), sum_grads_over=pg)
        return module

    def __repr__(self) -> str:
        return "ReplicatedWithGradAllReduce()"


class ShardedAttention(ParallelStyle):
    """The attention module around head-sharded projections (colwise q/k/v, rowwise output):
    checks that the head counts fit the TP size, tells the module its LOCAL head counts, and
    runs its sharded part on ``tpx.random``'s tensor-parallel stream.

    Args:
        num_heads: the model's query heads; must divide by the TP size (else ``ValueError``
            naming the numbers).
        num_kv_heads: key/value heads (GQA); ``None`` = ``num_heads``. Either they divide by
            the TP size, or the TP size is a multiple of them: the KV heads are then
            replicated (the k/v projections use ``ColwiseParallel(replicate_heads=True)``)
            and each rank holds the one KV head its query heads read.
        update: ``update(module, local_heads, local_kv_heads)`` sets the module's own
            head-count attributes (``num_key_value_groups``, ``split_size``, ...). Without
            it, the integer attributes the module has among :attr:`HEAD_ATTRIBUTES` are set
            to the local counts, and a module with none of them raises ``ValueError`` (it
            would go on computing with its global head count). A module that reads its head
            count from the tensors' shapes takes ``update=ShardedAttention.shapes_only``.
        out_proj: name of the output projection inside the module. When ``tpx.random`` is
            seeded and the module is training, the module's forward runs on the
            tensor-parallel stream from its start up to the call of ``out_proj`` (attention
            dropout differs across ranks: each holds other heads), and on the replicated
            stream after it (dropout after the output projection is the same on every rank).
    """

    #: head-count attributes set without ``update``: query heads, KV heads, and the number of
    #: query heads per KV head.
    HEAD_ATTRIBUTES = {"num_heads": "q", "n_heads": "q", "n_head": "q",
                       "num_attention_heads": "q", "num_key_value_heads": "kv",
                       "num_kv_heads": "kv", "n_kv_heads": "kv",
                       "num_key_value_groups": "groups", "n_rep": "groups"}

    @staticmethod
    def shapes_only(module: nn.Module, heads: int, kv_heads: int) -> None:
        """``update`` for an attention module that holds no head count (it derives it from
        the projections' output shapes)."""

    def __init__(self, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 update=None, out_proj: Optional[str] = None, uneven: bool = False) -> None:
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads) if num_kv_heads is not None else self.num_heads
        self.update, self.out_proj = update, out_proj
        self.uneven = bool(uneven)

    def local_heads(self, world: int, rank: Optional[int] = None) -> Tuple[int, int]:
        """(query heads, KV heads) held by rank ``rank`` at TP size ``world``. With
        ``uneven=True`` (the projections split with ``heads=(num_heads, num_kv_heads)``) heads
        that do not divide are dealt as ``tpx.comm.groups.head_split`` deals them, and the
        counts may differ by rank; otherwise they must divide (``ValueError``)."""
        h, kv = self.num_heads, self.num_kv_heads
        if self.uneven and rank is not None:
            (qs, qe), (ks, ke) = head_split(h, kv, world)[rank]
            return qe - qs, ke - ks
        if h % world:
            divisors = [d for d in range(1, h + 1) if h % d == 0]
            raise ValueError(
                f"the model has {h} attention heads, which do not divide by the TP size {world}; "
                f"use a TP size that divides {h} (one of {divisors})")
        if h % kv:
            raise ValueError(f"the model has {h} query heads and {kv} KV heads: not a GQA layout")
        if kv % world == 0:
            return h // world, kv // world
        if world % kv == 0:
            return h // world, 1
        raise ValueError(
            f"the model has {kv} KV heads: they neither divide by the TP size {world} nor does "
            f"{world} divide by them (then each KV head would be replicated); use a TP size "
            f"that divides {kv} or a multiple of it")

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        rank = dist.get_rank(pg)
        heads, kv_heads = self.local_heads(pg.size(), rank)
        if self.uneven:
            (first, _), _ = head_split(self.num_heads, self.num_kv_heads, pg.size())[rank]
        else:
            first = rank * heads
        # this rank's query heads of all of them, for an update that needs to know which
        module.__dict__["_tpx_query_heads"] = (first, first + heads, self.num_heads)
        if self.update is not None:
            self.update(module, heads, kv_heads)
        else:
            self._set_head_attributes(module, heads, kv_heads)
        if self.out_proj is not None and pg.size() > 1:
            self._fork_until_out_proj(module)
        return module

    def _set_head_attributes(self, module: nn.Module, heads: int, kv_heads: int) -> None:
        local = {"q": heads, "kv": kv_heads, "groups": heads // kv_heads}
        found = [a for a in self.HEAD_ATTRIBUTES
                 if isinstance(getattr(module, a, None), int)
                 and not isinstance(getattr(module, a), bool)]
        if not found:
            raise ValueError(
                f"tpx.ShardedAttention: {type(module).__name__} has none of the head-count "
                f"attributes tpx knows ({', '.join(self.HEAD_ATTRIBUTES)}), so it would keep "
                f"computing with {self.num_heads} heads where each rank holds {heads}. Pass "
                "update=fn(module, local_heads, local_kv_heads) that sets its own attributes, "
                "or update=ShardedAttention.shapes_only if it reads the head count from the "
                "tensors' shapes.")
        for a in found:
            setattr(module, a, local[self.HEAD_ATTRIBUTES[a]])

    def _fork_until_out_proj(self, module: nn.Module) -> None:
        from .. import random as tpx_random

        state = {}

        def device_of(mod):
            p = next(mod.parameters(), None)
            return p.device if p is not None else torch.device("cpu")

        def leave(*_):
            swap = state.pop("swap", None)
            if swap is not None:
                swap.exit()

        def enter(mod, args):
            if not (mod.training and tpx_random.is_seeded()):
                return
            proj = mod.get_submodule(self.out_proj)
            if not getattr(proj, "_tpx_leaves_fork", False):
                # The output projection is looked up here, after the plan replaced it.
                proj.register_forward_pre_hook(copied_with_module(lambda m, a: leave()))
                proj._tpx_leaves_fork = True
            state["swap"] = tpx_random.Swap(device_of(mod))
            state["swap"].enter()

        module.register_forward_pre_hook(copied_with_module(enter))
        module.register_forward_hook(copied_with_module(lambda m, a, o: leave()), always_call=True)

    def __repr__(self) -> str:
        return (f"ShardedAttention(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
                f"{', uneven=True' if self.uneven else ''})")
