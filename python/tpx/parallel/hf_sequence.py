"""Sequence parallelism layered on a plan translated from a Hugging Face model's TP plan
(:func:`tpx.parallel.hf_plan.translate` with ``sequence_parallel=True``), on a whole model or
on a pipeline stage of one (:func:`sequence_parallel_plan`)."""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from ..layout.dtensor_io import Partial
from .sequence import (
    Chain, ExpertsBlockSequence, GatherSequence, PadSequence, SeqLength, SplitSequence,
    WholeOnSequence, find_module, owned_layers)
from .style import (
    ParallelStyle, PrepareModuleInput, Replicate, RowwiseParallel, SequenceParallel, Shard)

__all__ = ["sequence_parallel_plan"]

Plan = Dict[str, ParallelStyle]


@dataclass
class _Layer:
    """What a decoder layer is made of, as the plan splits it: its blocks (children ending in
    a row-parallel projection or in experts), the attention and the MLP among them."""

    pre: str                                    # "<layers>.*."
    rows: Dict[str, str] = field(default_factory=dict)     # row-parallel end -> HF style
    experts: List[str] = field(default_factory=list)       # plan keys of routed experts
    sparse: set = field(default_factory=set)    # the mixture-of-experts blocks' names
    shared: List[str] = field(default_factory=list)        # ends of split shared experts
    names: List[str] = field(default_factory=list)         # every module name of the model
    attn: List[str] = field(default_factory=list)          # attention the plan splits by heads
    whole: Optional[str] = None                 # an attention the plan keeps whole
    gathered: List[str] = field(default_factory=list)      # blocks run on the real positions
    attn_child: str = ""
    mlp_child: str = ""


def sequence_parallel_plan(model: nn.Module, plan: Plan, entries: Dict[str, str],
                           attn_parents: Dict[str, List[str]], model_type,
                           rowwise: Tuple[str, ...]) -> None:
    """Sequence parallelism layered on the translated plan, as for the Llama family: the
    decoder layers run on this rank's block of the sequence (padded to a multiple of the TP
    size), their norms on the block; attention gathers the sequence before it (trimmed to
    the real positions) and its output projection reduce-scatters it; the MLP gathers
    it (padded) and its down projection reduce-scatters; the final norm gathers it back. A
    mixture-of-experts block gathers the real positions and reduce-scatters its experts' (and
    split shared experts') partial output (:class:`ExpertsBlockSequence`); an attention the
    plan keeps whole runs on the gathered sequence (:class:`WholeOnSequence`); a block whose
    plan gathers its projections' outputs runs on the real positions as attention does.

    A pipeline stage (any contiguous run of the decoder layers, with or without the
    embedding, the final norm and the LM head: the pieces it does not hold deleted, ``None``
    or an ``nn.Identity``) takes and returns whole hidden states ``R`` on the TP group, as the
    same stage unsharded does: its first layer splits the sequence (``R -> S(1)``), and where
    it holds no final norm its last layer gathers it back (``S(1) -> R``, trimmed to the real
    positions). So the activations a stage sends to the next, and the gradients it receives
    for them, have the unsharded stage's shapes at any sequence length (the padding never
    leaves a stage), and the gradient a stage hands back for its input is whole on every TP
    rank. Handing the next stage this rank's block instead would send 1 / TP of the bytes
    and save the gather, but the next stage could not tell the real length from a padded
    block, and the shapes of every boundary would depend on the TP size and the padding. A
    stage without decoder layers runs whole (nothing to split)."""

    def fail(why):
        return ValueError(f"tpx.plans.auto: sequence_parallel=True is not supported for "
                          f"model_type={model_type!r}: {why}; use sequence_parallel=False")

    layers = find_module(model, "layers")
    if layers is None or not isinstance(model.get_submodule(layers), nn.ModuleList):
        raise fail("no `layers` list of decoder layers")
    owned = owned_layers(model, layers)
    if not owned:
        return  # a pipeline stage of the embedding, the final norm or the head alone
    shape = _layer_blocks(model, entries, attn_parents, layers, owned, rowwise, fail)
    base = layers[: len(layers) - len("layers")]
    base_mod = model.get_submodule(base.rstrip(".")) if base else model
    finals = [n for n, m in base_mod.named_children() if "norm" in type(m).__name__.lower()]
    if len(finals) > 1:
        raise fail(f"more than one norm after the decoder layers ({finals})")
    n = SeqLength()
    _block_ends(plan, shape, n)
    _block_inputs(model, plan, shape, n, fail)
    first, last = f"{layers}.{owned[0]}", f"{layers}.{owned[-1]}"
    plan[first] = SplitSequence(n)
    for name, _ in model.get_submodule(first).named_children():
        if name not in (shape.attn_child, shape.mlp_child):
            plan[shape.pre + name] = SequenceParallel(use_local_output=True)
    if finals:
        plan[base + finals[0]] = Chain(SequenceParallel(use_local_output=True),
                                        GatherSequence(n, "output"))
    else:  # a pipeline stage before the last: it hands the next stage whole hidden states
        out = GatherSequence(n, "output")
        plan[last] = Chain(plan[last], out) if last == first else out


def _layer_blocks(model: nn.Module, entries: Dict[str, str],
                  attn_parents: Dict[str, List[str]], layers: str, owned: List[str],
                  rowwise: Tuple[str, ...], fail: Callable[[str], Exception]) -> _Layer:
    """The blocks of the decoder layers (:class:`_Layer`), or ``fail(why)`` raised where the
    layer is not one attention and one MLP (or mixture of experts) between norms."""
    pre = layers + ".*."
    s = _Layer(pre=pre, names=[n for n, _ in model.named_modules()])
    layer = model.get_submodule(f"{layers}.{owned[0]}")
    s.rows = {k: st for k, st in entries.items() if st in rowwise and k.startswith(pre)}
    # a mixture-of-experts block ends in its experts (whose sum over the group is the block's
    # reduction) where a dense MLP ends in its down projection
    s.experts = [k for k, st in entries.items() if st == "moe_tp_experts" and k.startswith(pre)]
    blocks: Dict[str, Dict[str, List[str]]] = {}
    for key in s.rows:
        blocks.setdefault(key[len(pre):].split(".")[0], {}).setdefault("rows", []).append(key)
    for key in s.experts:
        blocks.setdefault(key[len(pre):].split(".")[0], {}).setdefault("experts", []).append(key)
    s.attn = [p for p in attn_parents if p.startswith(pre)]
    if any(attn_parents[p] != [p] for p in s.attn):
        raise fail("not every decoder layer has the attention the plan splits by heads")
    # the mixture-of-experts blocks (the modules holding the experts), and the row-parallel
    # projections inside them: the ends of shared experts the plan splits
    s.sparse = {n.rsplit(".", 1)[0] for n in s.names
                for key in s.experts if fnmatch.fnmatchcase(n, key)}
    s.shared = [k for k in s.rows if any(fnmatch.fnmatchcase(n, k) and n.startswith(b + ".")
                                         for n in s.names for b in s.sparse)]
    for k in s.shared:
        if not all(any(n.startswith(b + ".") for b in s.sparse)
                   for n in s.names if fnmatch.fnmatchcase(n, k)):
            raise fail(f"the row-parallel projection {k!r} is inside some of its "
                       "mixture-of-experts blocks and outside others")
    for k in s.rows:
        if k not in s.shared and k[len(pre):].count(".") != 1:
            # the end of a block kept whole around it (a mixture of experts the plan does not
            # name): its output is not the block's, which cannot be reduce-scattered there
            raise fail(f"the row-parallel projection {k!r} is not a direct child of its block "
                       f"{pre + k[len(pre):].split('.')[0]!r}, so its output is not the block's")

    def one_end(ends) -> bool:  # one dense end (and / or the experts), any shared experts
        dense = [k for k in ends.get("rows", []) if k not in s.shared]
        return len(dense) <= 1 and len(ends.get("experts", [])) <= 1 and bool(
            dense or ends.get("experts"))

    if not s.attn:
        s.whole = _whole_attention(model, layer, layers, owned, blocks, entries, pre, fail)
    # dense blocks whose plan gathers their projections' outputs (an attention with its heads
    # whole on every rank: Phi-3's, OLMo 2's, OLMoE's; Phi-3's MLP): each runs on the real
    # positions, its row-parallel end reduce-scatters
    s.gathered = sorted(b for b, e in blocks.items() if "experts" not in e) if (
        not s.attn and s.whole is None and len(blocks) == 2
        and all(one_end(e) for e in blocks.values())) else []
    if (len(s.attn) != 1 and s.whole is None and not s.gathered) or len(blocks) != (
            1 if s.whole else 2) or not all(one_end(e) for e in blocks.values()):
        raise fail("the decoder layer is not one attention and one MLP, each ending in one "
                   "row-parallel projection (or, for a mixture of experts, in its experts, "
                   "beside shared experts the plan splits)")
    s.attn_child = s.whole or (s.gathered[0] if s.gathered else s.attn[0][len(pre):])
    if not s.whole and ("." in s.attn_child or s.attn_child not in blocks):
        raise fail("the attention is not a direct child of the decoder layer")
    s.mlp_child = next(b for b in blocks if b != s.attn_child)
    for name, sub in layer.named_children():
        if name in (s.attn_child, s.mlp_child):
            continue
        if not ("norm" in type(sub).__name__.lower() or isinstance(sub, nn.Dropout)):
            raise fail(f"the decoder layer holds {name} ({type(sub).__name__}), neither a norm "
                       "nor dropout")
    return s


def _whole_attention(model: nn.Module, layer: nn.Module, layers: str, owned: List[str],
                     blocks, entries: Dict[str, str], pre: str,
                     fail: Callable[[str], Exception]) -> Optional[str]:
    """The child of the decoder layer that is an attention the plan keeps whole (the one
    child that is neither a block of the plan, a norm nor dropout, alike in every layer), or
    ``None``."""
    others = [name for name, sub in layer.named_children() if name not in blocks
              and not ("norm" in type(sub).__name__.lower() or isinstance(sub, nn.Dropout))]
    if len(others) != 1 or any(k.startswith(pre + others[0]) for k in entries):
        return None
    whole = others[0]
    kinds = {tuple((n, type(c).__name__) for n, c in model.get_submodule(
        f"{layers}.{i}").named_children()) for i in owned}
    if len({k for kind in kinds for n, k in kind if n == whole}) != 1 or any(
            whole not in dict(kind) for kind in kinds):
        what = type(getattr(layer, whole)).__name__
        raise fail(f"the decoder layers differ: {whole} ({what}) is not in every one "
                   "of them alike")
    return whole


def _block_ends(plan: Plan, s: _Layer, n: SeqLength) -> None:
    """Each block's row-parallel end reduce-scatters along the sequence (``P -> S(1)``; a
    shared expert's end leaves its output ``Partial()``, which the block reduce-scatters with
    the routed experts'), padding first where the block ran on the real positions."""
    for key in s.rows:
        st = plan[key]
        new = RowwiseParallel(input_layouts=st.input_layouts,
                              output_layouts=Partial() if key in s.shared else Shard(1))
        padded = (any(key.startswith(s.pre + b + ".") for b in s.gathered)
                  or s.attn and key.startswith(s.attn[0] + "."))
        plan[key] = Chain(new, PadSequence(n)) if padded else new


def _block_inputs(model: nn.Module, plan: Plan, s: _Layer, n: SeqLength,
                  fail: Callable[[str], Exception]) -> None:
    """Each block's input gathered from the blocks of the sequence: attention (and a block
    the plan gathers) on the real positions, a dense MLP padded, a mixture of experts by
    :func:`_experts_inputs`."""
    pre = s.pre
    if s.whole:
        plan[pre + s.whole] = WholeOnSequence(n)
    elif s.gathered:
        for child in s.gathered:
            key = pre + child
            plan[key] = (Chain(plan[key], GatherSequence(n, "input")) if key in plan
                         else GatherSequence(n, "input"))
    else:
        plan[s.attn[0]] = Chain(plan[s.attn[0]], GatherSequence(n, "input"))
    if s.mlp_child in s.gathered:
        return  # it gathers the real positions (above)
    if not s.experts:
        plan[pre + s.mlp_child] = _gather_padded()
    else:
        _experts_inputs(model, plan, s, n, fail)


def _gather_padded() -> PrepareModuleInput:
    # tpx's own plan hands local tensors between the blocks (no DTensor on the hot path)
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                              use_local_output=True)


def _experts_inputs(model: nn.Module, plan: Plan, s: _Layer, n: SeqLength,
                    fail: Callable[[str], Exception]) -> None:
    """A mixture-of-experts block gathers the real positions only (ExpertsBlockSequence).
    Where it adds nothing to the experts' output (its other children with parameters are the
    router), the experts leave their output Partial() and the block reduce-scatters it; where
    it adds more (a shared expert every rank computes whole), the experts sum theirs and the
    block keeps its block of the sequence."""
    key = s.experts[0]
    routers = ("gate", "router")
    split_shared = {n.rsplit(".", 1)[0] for n in s.names for k in s.shared
                    if fnmatch.fnmatchcase(n, k)}
    alone = all(child is getattr(block, "experts", None) or name in routers
                or next(child.parameters(), None) is None
                or f"{b}.{name}" in split_shared
                for b, block in ((b, model.get_submodule(b)) for b in s.sparse)
                for name, child in block.named_children())
    if s.shared and not alone:
        raise fail("its mixture-of-experts block holds, beside the routed experts and the "
                   "shared experts the plan splits, a module with parameters computed "
                   "whole on every rank")
    if alone:
        style = copy.copy(plan[key])
        style.output_layouts = Partial()
        plan[key] = style
    dense = [k for k in s.rows if k not in s.shared]
    for name in s.names:
        if not fnmatch.fnmatchcase(name, s.pre + s.mlp_child):
            continue
        if name in s.sparse:
            plan[name] = ExpertsBlockSequence(n, partial=alone)
        elif any(fnmatch.fnmatchcase(m, k) and m.startswith(name + ".")
                 for m in s.names for k in dense):
            plan[name] = _gather_padded()
        else:  # a dense MLP the plan keeps whole (AFMoE's first layer)
            plan[name] = WholeOnSequence(n)
