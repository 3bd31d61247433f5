"""Completing a Hugging Face TP plan that leaves splittable modules whole.

Several of transformers' plans name only part of the model: gpt-oss's names the embedding
(its experts are in ``base_model_ep_plan`` only, its attention nowhere), Bamba's, Falcon-H1's
and LFM2's name the embedding and nothing of their MLPs or attention, GraniteMoE's names the
experts but not the attention, Qwen2-MoE's leaves the shared expert out. Applied as written,
each rank holds most of the model. :func:`complete` adds, in Hugging Face's own style names
(so that :func:`tpx.parallel.hf_plan.translate` reads them exactly as a shipped entry), the
entries for the modules of a known structure that no entry covers:

* **attention**: a module with ``q_proj``, ``k_proj``, ``v_proj`` and one output projection
  (``o_proj``, ``out_proj``, ``dense``), all ``nn.Linear``: q/k/v ``colwise`` (split in whole
  heads, KV heads replicated where fewer than ranks) with a gate of the output beside them
  (``g_proj`` / ``gate_proj``: one per head, LFM3's, or per feature), the output ``rowwise``; a per-head
  parameter of the attention (gpt-oss's ``sinks``, one per query head) split with its heads;
* **multi-head latent attention** (DeepSeek-V3's, whose plan leaves it out): the entries
  DeepSeek-V2's plan gives it (``q_proj`` or ``q_b_proj`` and ``kv_b_proj`` ``colwise``,
  ``kv_a_proj_with_mqa`` ``mla_kv_a_proj``, ``o_proj`` ``rowwise``);
* **MLPs**: ``gate_proj`` / ``up_proj`` / ``down_proj`` or ``w1`` / ``w3`` / ``w2``
  (``nn.Linear``), and the plain pairs ``up_proj`` / ``down_proj`` and ``fc1`` / ``fc2``: the
  inputs ``colwise``, the output ``rowwise``;
* **vocabulary tables** beside the input embedding (Gemma 4's per-layer embeddings), as
  many rows as a vocabulary of the config: vocab-parallel (``embedding_rowwise``);
* **sequence mixers** (:func:`tpx.parallel.mixers.mixer_style`): Mamba-2's (Bamba's,
  Falcon-H1's, Nemotron-H's, ...) :class:`tpx.parallel.ssm.Mamba2Parallel`, split by heads
  and groups, Mamba-1's (Jamba's) :class:`tpx.parallel.ssm.Mamba1Parallel`, split by
  channels, Gated DeltaNet's (OLMo-hybrid's)
  :class:`tpx.parallel.delta_net.GatedDeltaNetParallel`, split by heads, and LFM2's short
  convolution :class:`tpx.parallel.short_conv.ShortConvParallel`, by channels: tpx styles (no
  Hugging Face style states them), with every per-channel parameter;
* **fused experts** a model's ``base_model_ep_plan`` names (``ep_dispatch_experts``) that its
  TP plan does not: ``moe_tp_experts``, their 3-D ``gate_up_proj`` / ``down_proj`` read in the
  layout the module's class uses (its ``is_transposed`` / ``is_concatenated``, or
  :data:`tpx.parallel.hf_styles.EXPERT_LAYOUTS` for a class that has neither).

A group whose entries the translation refuses (a head count it cannot read, a parameter
inside the attention it does not know) is left whole and reported. The completed entries
are tpx's reading of the module structure, not the model's: the plan they are part of is a
:class:`~tpx.parallel.completed.CompletedPlan`, proved against the unsharded model before it
is used.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from typing import Dict, List, Optional

from torch import Tensor, nn

from .hf_styles import EXPERT_LAYOUTS, text_config

__all__ = ["complete", "Completion"]

_ATTN_IN = ("q_proj", "k_proj", "v_proj")
_ATTN_OUT = ("o_proj", "out_proj", "dense")
_ATTN_GATES = ("g_proj", "gate_proj")  # a gate per head or per feature of the attention output
# Column-parallel inputs first, the row-parallel output last; gated ones before the plain
# pair their names contain.
_MLPS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("up_proj", "down_proj"),
         ("fc1", "fc2"))
# Multi-head latent attention (DeepSeek-V2/V3's): the per-head projections out of the latent.
_MLA_Q = ("q_proj", "q_b_proj")


def _mla(kids: Dict[str, nn.Module]):
    """``("mla attention", entries)`` for a module with MLA's projections, as DeepSeek-V2's
    own plan states them: the query heads (``q_proj``, or ``q_b_proj`` out of the query
    latent) and ``kv_b_proj`` (keys' no-rope part and values, per head) column-parallel, the
    shared rope key of ``kv_a_proj_with_mqa`` with its gradient summed, ``o_proj``
    row-parallel; the latents and their norms whole."""
    q = [c for c in _MLA_Q if _linear(kids.get(c))]
    if len(q) != 1 or not all(_linear(kids.get(c)) for c in
                              ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")):
        return None
    return ("mla attention", {q[0]: "colwise", "kv_a_proj_with_mqa": "mla_kv_a_proj",
                              "kv_b_proj": "colwise", "o_proj": "rowwise"})
# Per-head parameters of an attention module: one row per query head.
_HEAD_PARAMS = ("sinks",)


class Completion:
    """What :func:`complete` added: ``entries`` (pattern -> Hugging Face style name, the
    parameter entries of experts included, or a tpx style where none states it), ``groups``
    (a readable name of each group added -> its patterns) and ``left`` (a group it could not
    add -> why)."""

    def __init__(self) -> None:
        self.entries: Dict[str, object] = {}
        self.groups: Dict[str, List[str]] = {}
        self.modules: Dict[str, str] = {}  # group -> the pattern of the module it splits
        self.left: Dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    def without(self, label: str, why: str) -> "Completion":
        """This completion with the group ``label`` left whole (``why``)."""
        out = Completion()
        for k in self.groups:
            if k != label:
                out.groups[k], out.modules[k] = self.groups[k], self.modules[k]
                out.entries.update({e: self.entries[e] for e in self.groups[k]})
        out.left = dict(self.left, **{label: why})
        return out

    def group_of(self, module: Optional[str]) -> Optional[str]:
        """The group whose module is ``module`` or holds it (``None``: no single one)."""
        if not module:
            return None
        for label, keys in self.groups.items():  # an entry's module, or one inside it
            if any(fnmatch.fnmatchcase(module, k) or fnmatch.fnmatchcase(module, k + ".*")
                   for k in keys):
                return label
        for label, pat in self.modules.items():
            if pat and (fnmatch.fnmatchcase(module, pat)
                        or fnmatch.fnmatchcase(module, pat + ".*")):
                return label
        return None


def _pattern(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (every index a wildcard)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name) if name else name


def _covered(name: str, keys: List[str]) -> bool:
    """Whether a plan key names ``name`` or a module above it."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatchcase(p, k) for p in prefixes for k in keys)


def _linear(module: Optional[nn.Module]) -> bool:
    return isinstance(module, nn.Linear)


def _found(name: str, mod: nn.Module, vocabularies):
    """``(kind, {child: style name})`` of a module of a known structure, or None."""
    kids = dict(mod.named_children())
    found = _mla(kids)
    if found is None and all(_linear(kids.get(c)) for c in _ATTN_IN):
        outs = [c for c in _ATTN_OUT if _linear(kids.get(c))]
        if len(outs) == 1:
            gates = {c: "colwise" for c in _ATTN_GATES if _linear(kids.get(c))}
            found = ("attention", {**{c: "colwise" for c in _ATTN_IN}, **gates,
                                   outs[0]: "rowwise"})
    if found is None:
        for parts in _MLPS:
            if all(_linear(kids.get(c)) for c in parts):
                found = ("mlp", {**{c: "colwise" for c in parts[:-1]}, parts[-1]: "rowwise"})
                break
    if found is None and isinstance(mod, nn.Embedding) and name \
            and mod.num_embeddings in vocabularies:
        found = ("embedding", {"": "embedding_rowwise"})
    return found


def _groups(model: nn.Module, keys: List[str]):
    """Candidate groups, one per kind and module pattern: (kind, pattern, {key: style name}).
    Where the pattern also names modules of another structure (Nemotron-H's ``mixer`` is
    attention in some layers and an MLP in others) the keys name each module instead."""
    seen = set()
    cfg = text_config(model) if getattr(model, "config", None) is not None else None
    vocabularies = {getattr(cfg, k, None) for k in ("vocab_size", "vocab_size_per_layer_input")
                    } - {None}
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        pat = _pattern(name)
        found = _found(name, mod, vocabularies)
        if found is None or (found[0], pat) in seen:
            continue
        kind, entries = found
        children = [f"{name}.{c}" if c else name for c in entries]
        if any(_covered(c, keys) for c in children) or (name and _covered(name, keys)):
            continue
        seen.add((kind, pat))
        same = [n for n in modules if _pattern(n) == pat]
        fits = [n for n in same if _found(n, modules[n], vocabularies) == found]
        group: Dict[str, object] = {}
        for owner in ([pat] if len(fits) == len(same) else fits):
            prefix = f"{owner}." if owner else ""
            group.update({(prefix + c if c else owner): st for c, st in entries.items()})
            if kind == "attention":
                for p in _HEAD_PARAMS:
                    if isinstance(getattr(mod, p, None), nn.Parameter):
                        group[prefix + p] = "colwise"
        yield kind, pat, group


def ep_experts(model: nn.Module, keys: List[str]):
    """Fused experts the EP plan names and the TP plan does not: (pattern, entries)."""
    ep = getattr(text_config(model), "base_model_ep_plan", None) or {}
    base = getattr(model, "base_model", model)
    prefix = "" if base is model else next(n for n, m in model.named_modules() if m is base) + "."
    modules = dict(model.named_modules())
    for key, style in ep.items():
        if style != "ep_dispatch_experts":
            continue
        pat = prefix + key
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pat)]
        if not names or any(_covered(n, keys) for n in names):
            continue
        mod = modules[names[0]]
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if not (isinstance(gu, Tensor) and isinstance(dn, Tensor) and gu.dim() == 3
                and dn.dim() == 3):
            continue
        layout = EXPERT_LAYOUTS.get(type(mod).__name__)
        if layout is None:
            transposed = bool(getattr(mod, "is_transposed", False))
            if not hasattr(mod, "is_transposed") and gu.shape[1] != 2 * dn.shape[2]:
                continue  # a layout tpx cannot read from the class: left whole
            layout = (transposed, not bool(getattr(mod, "is_concatenated", True)))
        entries = {pat: "moe_tp_experts",
                   pat + ".gate_up_proj": "packed_rowwise" if layout[0] else "packed_colwise",
                   pat + ".down_proj": "colwise" if layout[0] else "rowwise"}
        yield pat, entries


def _mamba_mixers(model: nn.Module, keys: List[str]):
    """Mamba mixers no plan key covers: (pattern, {key: its style}). A pattern that would also
    name other modules (Nemotron-H's ``mixer`` is attention or an MLP in some layers) is given
    as each mixer's own name."""
    from .mixers import mixer_style

    modules = dict(model.named_modules())
    found: Dict[str, List[str]] = {}
    styles: Dict[str, object] = {}
    for name, mod in modules.items():
        style = mixer_style(mod) if name and not _covered(name, keys) else None
        if style is not None:
            found.setdefault(_pattern(name), []).append(name)
            styles[_pattern(name)] = style
    for pat, names in found.items():
        same = [n for n in modules if n and fnmatch.fnmatchcase(n, pat)]
        listed = [pat] if sorted(same) == sorted(names) else names
        yield pat, {k: copy.copy(styles[pat]) for k in listed}


def complete(model: nn.Module, hf: Dict[str, str], accept) -> Completion:
    """The entries to add to ``hf`` (a Hugging Face plan, keys relative to ``model``), each
    group kept only if ``accept(plan)`` (translating ``hf`` with the groups kept so far and
    this one, its Hugging Face style names only) raises nothing. See the module docstring."""
    done = Completion()
    keys = list(hf)
    candidates = [(f"experts {pat}", pat, entries) for pat, entries in ep_experts(model, keys)]
    candidates += [(f"{kind} {pat or '(the model)'}", pat, entries)
                   for kind, pat, entries in _groups(model, keys)]
    candidates += [(f"mixer {pat}", pat, entries) for pat, entries in _mamba_mixers(model, keys)]
    for label, pat, entries in candidates:
        try:
            accept({k: v for k, v in dict(hf, **done.entries, **entries).items()
                    if isinstance(v, str)})
        except (ValueError, NotImplementedError, AttributeError) as e:
            done.left[label] = str(e).split("\n")[0]
            continue
        done.entries.update(entries)
        done.groups[label] = list(entries)
        done.modules[label] = pat
    return done

