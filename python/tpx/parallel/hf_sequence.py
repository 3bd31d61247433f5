"""Sequence parallelism layered on a plan translated from a Hugging Face model's TP plan
(:func:`tpx.parallel.hf_plan.translate` with ``sequence_parallel=True``)."""

from __future__ import annotations

import copy
import fnmatch
from typing import Dict, List, Tuple

from torch import nn

from ..layout.dtensor_io import Partial
from .sequence import (
    Chain, ExpertsBlockSequence, GatherSequence, PadSequence, SeqLength, SplitSequence,
    WholeOnSequence, find_module)
from .style import (
    ParallelStyle, PrepareModuleInput, Replicate, RowwiseParallel, SequenceParallel, Shard)

__all__ = ["sequence_parallel_plan"]

Plan = Dict[str, ParallelStyle]


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
    plan gathers its projections' outputs runs on the real positions as attention does."""

    def fail(why):
        return ValueError(f"tpx.plans.auto: sequence_parallel=True is not supported for "
                          f"model_type={model_type!r}: {why}; use sequence_parallel=False")

    layers = find_module(model, "layers")
    if layers is None or not isinstance(model.get_submodule(layers), nn.ModuleList):
        raise fail("no `layers` list of decoder layers")
    pre = layers + ".*."
    base = layers[: len(layers) - len("layers")]
    layer = model.get_submodule(layers)[0]
    rows = {k: s for k, s in entries.items() if s in rowwise and k.startswith(pre)}
    # a mixture-of-experts block ends in its experts (whose sum over the group is the block's
    # reduction) where a dense MLP ends in its down projection
    experts = [k for k, s in entries.items() if s == "moe_tp_experts" and k.startswith(pre)]
    blocks: Dict[str, Dict[str, List[str]]] = {}
    for key in rows:
        blocks.setdefault(key[len(pre):].split(".")[0], {}).setdefault("rows", []).append(key)
    for key in experts:
        blocks.setdefault(key[len(pre):].split(".")[0], {}).setdefault("experts", []).append(key)
    attn = [p for p in attn_parents if p.startswith(pre)]
    if any(attn_parents[p] != [p] for p in attn):
        raise fail("not every decoder layer has the attention the plan splits by heads")
    # the mixture-of-experts blocks (the modules holding the experts), and the row-parallel
    # projections inside them: the ends of shared experts the plan splits
    sparse = {n.rsplit(".", 1)[0] for n, _ in model.named_modules()
              for key in experts if fnmatch.fnmatchcase(n, key)}
    names = [n for n, _ in model.named_modules()]
    shared = [k for k in rows if any(fnmatch.fnmatchcase(n, k) and n.startswith(b + ".")
                                     for n in names for b in sparse)]
    for k in shared:
        if not all(any(n.startswith(b + ".") for b in sparse)
                   for n in names if fnmatch.fnmatchcase(n, k)):
            raise fail(f"the row-parallel projection {k!r} is inside some of its "
                       "mixture-of-experts blocks and outside others")

    for k in rows:
        if k not in shared and k[len(pre):].count(".") != 1:
            # the end of a block kept whole around it (a mixture of experts the plan does not
            # name): its output is not the block's, which cannot be reduce-scattered there
            raise fail(f"the row-parallel projection {k!r} is not a direct child of its block "
                       f"{pre + k[len(pre):].split('.')[0]!r}, so its output is not the block's")

    def one_end(ends) -> bool:  # one dense end (and / or the experts), any shared experts
        dense = [k for k in ends.get("rows", []) if k not in shared]
        return len(dense) <= 1 and len(ends.get("experts", [])) <= 1 and bool(
            dense or ends.get("experts"))

    whole = None  # an attention the plan keeps whole: it runs on the whole sequence
    if not attn:
        others = [name for name, sub in layer.named_children() if name not in blocks
                  and not ("norm" in type(sub).__name__.lower() or isinstance(sub, nn.Dropout))]
        if len(others) == 1 and not any(k.startswith(pre + others[0]) for k in entries):
            whole = others[0]
            kinds = {tuple((n, type(c).__name__) for n, c in lay.named_children())
                     for lay in model.get_submodule(layers)}
            if len({k for kind in kinds for n, k in kind if n == whole}) != 1 or any(
                    whole not in dict(kind) for kind in kinds):
                what = type(getattr(layer, whole)).__name__
                raise fail(f"the decoder layers differ: {whole} ({what}) is not in every one "
                           "of them alike")
    # dense blocks whose plan gathers their projections' outputs (an attention with its heads
    # whole on every rank: Phi-3's, OLMo 2's, OLMoE's; Phi-3's MLP): each runs on the real
    # positions, its row-parallel end reduce-scatters
    gathered = sorted(b for b, e in blocks.items() if "experts" not in e) if (
        not attn and whole is None and len(blocks) == 2
        and all(one_end(e) for e in blocks.values())) else []
    if (len(attn) != 1 and whole is None and not gathered) or len(blocks) != (
            1 if whole else 2) or not all(one_end(e) for e in blocks.values()):
        raise fail("the decoder layer is not one attention and one MLP, each ending in one "
                   "row-parallel projection (or, for a mixture of experts, in its experts, "
                   "beside shared experts the plan splits)")
    attn_child = whole or (gathered[0] if gathered else attn[0][len(pre):])
    if not whole and ("." in attn_child or attn_child not in blocks):
        raise fail("the attention is not a direct child of the decoder layer")
    mlp_child = next(b for b in blocks if b != attn_child)
    for name, sub in layer.named_children():
        if name in (attn_child, mlp_child):
            continue
        if not ("norm" in type(sub).__name__.lower() or isinstance(sub, nn.Dropout)):
            raise fail(f"the decoder layer holds {name} ({type(sub).__name__}), neither a norm "
                       "nor dropout")
    base_mod = model.get_submodule(base.rstrip(".")) if base else model
    finals = [n for n, m in base_mod.named_children() if "norm" in type(m).__name__.lower()]
    if len(finals) != 1:
        raise fail("no single final norm after the decoder layers")
    n = SeqLength()
    for key in rows:
        st = plan[key]
        # a shared expert's end leaves its output Partial(): the block reduce-scatters it
        # with the routed experts' (ExpertsBlockSequence)
        new = RowwiseParallel(input_layouts=st.input_layouts,
                              output_layouts=Partial() if key in shared else Shard(1))
        padded = (any(key.startswith(pre + b + ".") for b in gathered)
                  or attn and key.startswith(attn[0] + "."))
        plan[key] = Chain(new, PadSequence(n)) if padded else new
    if whole:
        plan[pre + whole] = WholeOnSequence(n)
    elif gathered:
        for child in gathered:
            key = pre + child
            plan[key] = (Chain(plan[key], GatherSequence(n, "input")) if key in plan
                         else GatherSequence(n, "input"))
    else:
        plan[attn[0]] = Chain(plan[attn[0]], GatherSequence(n, "input"))
    # tpx's own plan hands local tensors between the blocks (no DTensor on the hot path)
    gather_padded = PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Replicate(),),
                                       use_local_output=True)
    if mlp_child in gathered:
        pass  # it gathers the real positions (above)
    elif not experts:
        plan[pre + mlp_child] = gather_padded
    else:
        # A mixture-of-experts block gathers the real positions only (ExpertsBlockSequence).
        # Where it adds nothing to the experts' output (its other children with parameters
        # are the router), the experts leave their output Partial() and the block
        # reduce-scatters it; where it adds more (a shared expert every rank computes whole),
        # the experts sum theirs and the block keeps its block of the sequence.
        key = experts[0]
        routers = ("gate", "router")
        split_shared = {n.rsplit(".", 1)[0] for n in names for k in shared
                        if fnmatch.fnmatchcase(n, k)}
        alone = all(child is getattr(block, "experts", None) or name in routers
                    or next(child.parameters(), None) is None
                    or f"{b}.{name}" in split_shared
                    for b, block in ((b, model.get_submodule(b)) for b in sparse)
                    for name, child in block.named_children())
        if shared and not alone:
            raise fail("its mixture-of-experts block holds, beside the routed experts and the "
                       "shared experts the plan splits, a module with parameters computed "
                       "whole on every rank")
        if alone:
            style = copy.copy(plan[key])
            style.output_layouts = Partial()
            plan[key] = style
        dense = [k for k in rows if k not in shared]
        for name, _ in model.named_modules():
            if not fnmatch.fnmatchcase(name, pre + mlp_child):
                continue
            if name in sparse:
                plan[name] = ExpertsBlockSequence(n, partial=alone)
            elif any(fnmatch.fnmatchcase(m, k) and m.startswith(name + ".")
                     for m in names for k in dense):
                plan[name] = gather_padded
            else:  # a dense MLP the plan keeps whole (AFMoE's first layer)
                plan[name] = WholeOnSequence(n)
    plan[pre.replace("*", "0").rstrip(".")] = SplitSequence(n)
    for name, sub in layer.named_children():
        if name not in (attn_child, mlp_child):
            plan[pre + name] = SequenceParallel(use_local_output=True)
    plan[base + finals[0]] = Chain(SequenceParallel(use_local_output=True),
                                    GatherSequence(n, "output"))
