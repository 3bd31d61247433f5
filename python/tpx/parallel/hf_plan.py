"""How tpx reads a Hugging Face TP plan.

A Hugging Face model carries its tensor-parallel plan as data: ``config.base_model_tp_plan``
(module-name patterns of the base model to style names) merged by transformers with the
classes' own ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``) and, when the base model
has an ``embed_tokens``, ``"embedding_rowwise"`` for it: ``model.tp_plan``. The style names
are those of transformers' ``ALL_PARALLEL_STYLES``. This module holds

* :data:`HF_STYLES`: the one table from every such name to the tpx style that computes the
  same thing (what transformers' style does, checked against its source, beside it);
* :func:`translate`: ``model.tp_plan`` through that table, then what tpx knows beyond it,
  layered on top (never a copy of the plan per model family):

  - attention split in whole heads (``head_size``), KV heads replicated when they do not
    divide the TP size (Hugging Face's plan cuts them in half and fails), the attention
    module told its local head counts (:class:`~tpx.parallel.style.ShardedAttention`);
  - a fused ``gate_up_proj`` that the plan gathers (``colwise_gather_output``) before a
    ``down_proj`` that splits its input again (``rowwise_split_input``) kept sharded
    instead, in matching halves of gate and up (the gather and the split cancel);
  - the input embedding vocab-parallel (a scaled embedding, Gemma's, keeps its scale) and
    the LM head column-parallel, its logits vocab-sharded with ``loss_parallel=True``, full
    during ``generate()``;
  - ``sequence_parallel=True``: norms on blocks of the sequence, one gather before attention
    and the MLP, reduce-scatters after them;

* :func:`style`: one Hugging Face style name as a tpx style, for plans written by hand.

Parameter entries (a key naming a parameter, ``layers.*.mlp.experts.gate_up_proj``) are read
only under a module marked ``moe_tp_experts``, whose tpx style
(``tpx.parallel.moe.ExpertsTensorParallel``) shards those parameters itself.
"""

from __future__ import annotations

import copy
import fnmatch
import inspect
import re
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .generate import with_generate
from .hf_styles import (
    HF_STYLES, AllReduceOutput, BlocksColwise, HeadParams, HFStyle, KeepWhole, PartialGradParams,
    SparseActivationsOverRanks, SplitRopeGrad, VocabParallelEmbeddingStyle, own_embedding_forward,
    packed_colwise, style, text_config)
from .hf_sequence import sequence_parallel_plan
from .module_styles import ReplicatedWithGradAllReduce
from .sequence import Chain, is_pipeline_stage, stage_placeholders
from .style import (
    ColwiseParallel, ParallelStyle, Replicate, RowwiseParallel, Shard, ShardedAttention)

__all__ = ["HF_STYLES", "HFStyle", "style", "translate", "has_plan", "hf_tp_plan"]

Plan = Dict[str, ParallelStyle]

# ------------------------------------------------------------------ reading the model's plan

def has_plan(model: nn.Module) -> bool:
    """Whether the Hugging Face ``model``'s config has a ``base_model_tp_plan``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    return bool(getattr(cfg, "base_model_tp_plan", None)
                or getattr(text_config(model), "base_model_tp_plan", None))


def hf_tp_plan(model: nn.Module) -> Dict[str, str]:
    """The model's Hugging Face plan, keys relative to ``model``: ``model.tp_plan`` (the
    config's ``base_model_tp_plan`` under the base model's prefix, with the classes'
    ``_tp_plan`` and the ``embedding_rowwise`` transformers adds for ``embed_tokens``)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base = text_config(model).base_model_tp_plan or {}
    prefix = ""
    base_model = getattr(model, "base_model", model)
    if base_model is not model:
        prefix = next(n for n, m in model.named_modules() if m is base_model) + "."
    out = {prefix + k: v for k, v in base.items()}
    for k, v in (getattr(type(model), "_tp_plan", None) or {}).items():
        out.setdefault(k, v)
    return out


# ------------------------------------------------------------------ translation

_Q, _K, _V = ("q_proj",), ("k_proj",), ("v_proj",)
_GATES = ("g_proj", "gate_proj")  # inside attention: a gate per head (LFM3) or per feature
_FUSED_QKV = "qkv_proj"            # [q | k | v] (Phi-3's layout)
_PER_HEAD_QKV = "query_key_value"  # [q k v] per head (GPT-NeoX's layout)
_COLWISE_OUT = ("colwise",)        # output left sharded: heads split
_ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")


def _parent(key: str) -> Tuple[str, str]:
    parent, _, child = key.rpartition(".")
    return parent, child


def _name_of(model: nn.Module, module: Optional[nn.Module]) -> Optional[str]:
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module), None)


def _local_heads_update(module: nn.Module, heads: int, kv_heads: int) -> None:
    """Sets the head counts a Hugging Face attention module keeps (those it has among
    :attr:`ShardedAttention.HEAD_ATTRIBUTES`); most read the rest from the tensors' shapes."""
    local = {"q": heads, "kv": kv_heads, "groups": heads // kv_heads}
    for attr, kind in ShardedAttention.HEAD_ATTRIBUTES.items():
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(module, attr, local[kind])


def _own_counts(attn: nn.Module, kids: Dict[str, str], heads: int, kv: int,
                head_dim: int) -> Tuple[int, int]:
    """The attention's own ``(heads, KV heads)`` where the config's do not fit its query and
    key projections and its own ``num_heads`` do (a vision or audio tower under a text
    config: MOSS's audio tower, Phi-4 multimodal's audio encoder); else the config's."""
    q, k = (next((attn.get_submodule(c) for c in kids if c in names), None)
            for names in (_Q, _K))
    q_out, k_out = (getattr(m, "out_features", None) for m in (q, k))
    own = getattr(attn, "num_heads", None)
    if q_out in (None, heads * head_dim) and k_out in (None, kv * head_dim) or not isinstance(
            own, int) or isinstance(own, bool) or q_out != own * head_dim:
        return heads, kv
    groups = getattr(attn, "num_key_value_groups", None)
    own_kv = getattr(attn, "num_key_value_heads", None) or (
        own // groups if isinstance(groups, int) and groups > 0 else own)
    return (own, own_kv) if k_out in (None, own_kv * head_dim) else (heads, kv)


def _reads_config_heads(module: nn.Module) -> bool:
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "config.num_attention_heads" in src or "config.num_key_value_heads" in src


def _gated_query(module: nn.Module) -> bool:
    """Whether the attention's forward reads its query projection as each head's query and
    output gate side by side (``q_proj(x).view(..., -1, head_dim * 2)``, Qwen3-Next,
    Qwen3.5): such a projection splits in whole blocks of ``2 * head_dim``."""
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return re.search(r"q_proj\([^)]*\)\.view\([^)]*head_dim \* 2\)", src) is not None


def translate(model: nn.Module, *, tp_plan: Optional[Dict[str, str]] = None,
              sequence_parallel: bool = False, loss_parallel: bool = False,
              experts: str = "tp") -> Plan:
    """The tpx plan of a Hugging Face ``model`` from its own TP plan (``tp_plan``: a plan of
    Hugging Face style names to read instead of ``model.tp_plan``), with tpx's additions
    (module docstring). Entries whose pattern matches nothing in this model (a module the
    config leaves out) are dropped, as transformers does. ``experts``: how the experts a plan
    marks ``moe_tp_experts`` are split: ``"tp"`` (expert TP, Hugging Face's meaning) or ``"ep"``
    (expert parallelism: whole experts per rank; docs/experts.md). ``tpx.plans.auto`` adds
    to this the entries for what the plan leaves whole (:mod:`tpx.parallel.completed`)."""
    if experts not in ("tp", "ep"):
        raise ValueError(f"tpx.hf_plan.translate: `experts` must be 'tp' or 'ep'; got "
                         f"{experts!r}")

    hf = dict(tp_plan) if tp_plan is not None else hf_tp_plan(model)
    if not hf:
        raise ValueError(f"tpx.hf_plan.translate: {type(model).__name__} has no Hugging Face TP "
                         "plan (config.base_model_tp_plan is empty); pass tp_plan= or write the "
                         "plan by hand")
    return translate_entries(model, hf, sequence_parallel=sequence_parallel,
                      loss_parallel=loss_parallel, experts=experts)


def translate_entries(model: nn.Module, hf: Dict[str, str], *, sequence_parallel: bool,
               loss_parallel: bool, experts: str) -> Plan:
    """:func:`translate` of the Hugging Face plan ``hf`` as it is."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    modules = dict(model.named_modules())
    absent = set(stage_placeholders(model))  # a pipeline stage's stand-ins for other stages'
    names = [n for n in modules if n and n not in absent]
    param_names = [n for n, _ in model.named_parameters()]

    # 1. Entries naming modules, entries naming parameters, entries naming nothing here.
    mod_entries: Dict[str, str] = {}
    param_entries: Dict[str, str] = {}
    for key, name in hf.items():
        if name not in HF_STYLES:
            raise ValueError(f"tpx.hf_plan.translate: the plan entry {key!r} has the style "
                             f"{name!r}, which is not a Hugging Face style tpx knows "
                             f"({sorted(HF_STYLES)})")
        if any(fnmatch.fnmatchcase(n, key) for n in names):
            mod_entries[key] = name
        elif any(fnmatch.fnmatchcase(p, key) for p in param_names):
            param_entries[key] = name
    expert_keys = {k for k, s in mod_entries.items() if s == "moe_tp_experts"}
    under: Dict[str, Dict[str, str]] = {k: {} for k in expert_keys}
    bare: Dict[str, Dict[str, str]] = {}  # owner -> {parameter: style}, outside experts
    for key, name in param_entries.items():
        owner, attr = _parent(key)
        if owner in expert_keys:
            under[owner][attr] = name
        else:
            bare.setdefault(owner, {})[attr] = name

    def first(key):
        return modules[next(n for n in names if fnmatch.fnmatchcase(n, key))]

    # 2. The table.
    plan: Plan = {}
    for key, name in mod_entries.items():
        ctx = {"name": key, "params": under.get(key, {}), "model": model, "experts": experts}
        plan[key] = HF_STYLES[name].build(first(key), ctx)

    # 3. tpx's additions.
    cfg = text_config(model)
    children: Dict[str, Dict[str, str]] = {}
    for key, name in mod_entries.items():
        parent, child = _parent(key)
        children.setdefault(parent, {})[child] = name
    for parent, kids in children.items():
        if any(s in _COLWISE_OUT for s in kids.values()):
            _statistics_over_ranks(modules, names, plan, parent)
    attn_parents: Dict[str, List[str]] = {}  # pattern -> the plan keys of its attention style
    for parent, kids in children.items():
        sharded = {c for c, s in kids.items() if s in _COLWISE_OUT}
        if not (sharded & {*_Q, *_K, *_V, _FUSED_QKV, _PER_HEAD_QKV}):
            continue
        keys = _holding(modules, names, parent, sharded)
        attn_parents[parent] = keys
        _shard_attention(model, plan, parent, keys, kids, cfg, mod_entries)
    for parent, kids in children.items():
        if parent not in attn_parents:
            _partial_grad_params(modules, names, plan, parent, kids)
    for owner, params in bare.items():
        _head_params(model, plan, owner, params, attn_parents, cfg,
                     mod_entries.get(owner) == "local_params")
    for parent, kids in children.items():
        # A fused [gate | up] the plan gathers only to split it again before down_proj.
        if kids.get("gate_up_proj") == "colwise_gather_output":
            downs = [c for c, s in kids.items() if s in ("rowwise_split_input", "rowwise_rep")]
            if len(downs) == 1:
                plan[parent + ".gate_up_proj"] = packed_colwise(first(parent + ".gate_up_proj"))
                plan[parent + "." + downs[0]] = RowwiseParallel()

    emb_mod, head_mod = _embeddings(model)
    emb_name = _name_of(model, emb_mod)
    head = _name_of(model, head_mod) if isinstance(head_mod, nn.Linear) else None
    # Tables kept whole: the input embedding where the model reads its rows itself, and every
    # embedding the plan would split whose class has a forward of its own (other than a
    # scaled lookup), which a vocabulary-parallel embedding would drop (T5Gemma 2's writes
    # its end-of-image row); an LM head tied to a table kept whole stays whole too.
    whole_table = emb_name is not None and reads_table_rows(model)
    kept = [emb_mod] if whole_table else []
    for key in [k for k, st in plan.items() if isinstance(st, VocabParallelEmbeddingStyle)]:
        own = [modules[n] for n in names if fnmatch.fnmatchcase(n, key)
               and own_embedding_forward(modules[n])]
        if own:
            kept += own
            del plan[key]
    if emb_mod is not None and own_embedding_forward(emb_mod):
        kept.append(emb_mod)
    for mod in kept:
        name = _name_of(model, mod)
        for k in [k for k in plan if name and fnmatch.fnmatchcase(name, k)]:
            del plan[k]
        if head is not None and getattr(head_mod, "weight", None) is getattr(mod, "weight", 0):
            for k in [k for k in plan if fnmatch.fnmatchcase(head, k)]:
                del plan[k]
            head = None
    whole_table = whole_table or any(m is emb_mod for m in kept)
    if emb_name and not whole_table and not any(fnmatch.fnmatchcase(emb_name, k) for k in plan):
        plan[emb_name] = VocabParallelEmbeddingStyle()
    if head is not None:
        for k in [k for k in plan if fnmatch.fnmatchcase(head, k)]:
            del plan[k]
        plan[head] = ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())
    elif loss_parallel and not is_pipeline_stage(model):
        # (a pipeline stage without the head: the stage that holds it keeps its logits sharded)
        raise ValueError(f"tpx.plans.auto: loss_parallel=True needs a model with an LM head "
                         f"(model_type={model_type!r}, {type(model).__name__})")
    if sequence_parallel:
        sequence_parallel_plan(model, plan, mod_entries, attn_parents, model_type, _ROWWISE)
    # Each attention module before its projections: its check of the head counts against
    # the TP size is the error a user sees first.
    ordered: Plan = {}
    for key, st in plan.items():
        for parent, keys in attn_parents.items():
            if key.startswith(parent + "."):
                for k in keys:
                    ordered.setdefault(k, plan[k])
        ordered.setdefault(key, st)
    return with_generate(ordered, model, head, loss_parallel)


def _embeddings(model: nn.Module) -> Tuple[Optional[nn.Module], Optional[nn.Module]]:
    """The input embedding and the LM head of ``model`` (each ``None`` where it has none, or
    a pipeline stage holds a placeholder in its place): its ``get_input_embeddings()`` and
    ``get_output_embeddings()``; for a module without them (a pipeline stage of the user's,
    holding a Hugging Face model's pieces under their names and its ``config``), the child
    the config's ``base_model_pp_plan`` feeds ``input_ids`` (``embed_tokens``) and
    ``lm_head``."""
    if callable(getattr(model, "get_input_embeddings", None)):
        emb = model.get_input_embeddings()
    else:
        pp = getattr(text_config(model), "base_model_pp_plan", None) or {}
        name = next((k for k, (ins, _) in pp.items() if list(ins) == ["input_ids"]),
                    "embed_tokens")
        emb = getattr(model, name, None) if "." not in name else None
    head = (model.get_output_embeddings()
            if callable(getattr(model, "get_output_embeddings", None))
            else getattr(model, "lm_head", None))
    return tuple(m if isinstance(m, nn.Module) and not isinstance(m, nn.Identity) else None
                 for m in (emb, head))


def reads_table_rows(model: nn.Module) -> bool:
    """Whether a forward of the model reads rows of its input embedding's table itself
    (Gemma 4's multimodal forward takes ``embed_tokens.weight[pad_token_id]``): a
    vocabulary-parallel table would hand it a sharded ``DTensor``, so the table stays whole."""
    seen = set()
    for m in model.modules():
        cls = type(m)
        if cls in seen:
            continue
        seen.add(cls)
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            continue
        if re.search(r"embed_tokens\.weight\[", src):
            return True
    return False


def _statistics_over_ranks(modules: Dict[str, nn.Module], names: List[str], plan: Plan,
                           parent: str) -> None:
    """A block whose forward reduces over all the features a column-parallel child splits
    takes its statistic over every rank's: Gemma 3n's activation-sparse MLP keeps the
    activations above a mean plus a multiple of the standard deviation over all its
    intermediate features (``activation_sparsity``, :class:`SparseActivationsOverRanks`)."""
    if any(fnmatch.fnmatchcase(n, parent) and getattr(modules[n], "activation_sparsity", 0)
           and hasattr(modules[n], "_gaussian_topk") for n in names):
        plan[parent] = Chain(plan[parent], SparseActivationsOverRanks()) if parent in plan \
            else SparseActivationsOverRanks()


def _holding(modules: Dict[str, nn.Module], names: List[str], parent: str,
             kids) -> List[str]:
    """The plan keys for a style on the modules matching ``parent`` that hold any child in
    ``kids``: ``[parent]`` when every match does; else the names of those that do (MiniMax's
    linear-attention layers hold none of the projections of its softmax attention under one
    ``layers.*.self_attn``; Gemma 3n's KV-sharing layers hold the query projection only and
    read the keys and values of an earlier layer, split alike)."""
    matches = [n for n in names if fnmatch.fnmatchcase(n, parent)]
    holding = [n for n in matches
               if any(isinstance(getattr(modules[n], c, None), nn.Module) for c in kids)]
    return [parent] if len(holding) == len(matches) else holding


def _partial_grad_params(modules: Dict[str, nn.Module], names: List[str], plan: Plan,
                         parent: str, kids: Dict[str, str]) -> None:
    """In a block whose plan splits features column-parallel and joins them row-parallel
    (an MLP), each child with parameters the plan does not name gets its gradient summed
    (:class:`PartialGradParams`)."""
    cols = [c for c, s in kids.items() if s in ("colwise", "packed_colwise")]
    rows = [c for c, s in kids.items() if s == "rowwise"]
    if not cols or not rows:
        return
    for n in _holding(modules, names, parent, cols + rows):
        for x in [x for x in names if fnmatch.fnmatchcase(x, n)]:  # one style per block
            for child, sub in modules[x].named_children():
                key = f"{x}.{child}"
                if (child in kids or not any(True for _ in sub.parameters())
                        or any(fnmatch.fnmatchcase(key, k) for k in plan)):
                    continue
                plan[key] = PartialGradParams(key, modules[x], cols)


def _shard_attention(model, plan: Plan, parent: str, keys: List[str], kids: Dict[str, str],
                     cfg, entries: Dict[str, str]) -> None:
    """q/k/v (or a fused projection) column-parallel in whole heads, KV heads replicated when
    they do not divide the TP size; the attention module told its local head counts.
    ``keys``: the plan keys of the attention modules (``parent`` or the names of the modules
    under it that hold the projections)."""
    attn = model.get_submodule(next(n for n, _ in model.named_modules()
                                    if any(fnmatch.fnmatchcase(n, k) for k in keys)))
    heads = getattr(cfg, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"tpx.hf_plan: {parent!r}: the plan splits its projections by heads, "
                         "but the model has no config.num_attention_heads to count them")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = (getattr(attn, "head_dim", None) or getattr(attn, "head_size", None)
                or getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    heads, kv = _own_counts(attn, kids, heads, kv, head_dim)
    sharded = [c for c, s in kids.items() if s in _COLWISE_OUT]  # the plan's order
    update = _local_heads_update
    # Heads that do not divide the TP size are dealt in blocks that differ by one head: the
    # projections, the output projection's columns and the module's counts alike.
    counts, uneven = (heads, kv), True
    v_dim = getattr(attn, "v_head_dim", None) or head_dim
    if _reads_config_heads(attn):
        raise ValueError(
            f"tpx.hf_plan: {parent!r} ({type(attn).__name__}) reads config.num_attention_heads "
            "in its forward, so it cannot be told the heads each rank holds; the plan splits "
            f"its projections {sorted(sharded)} by heads. Gather their outputs in the plan "
            "('colwise_gather_output', and 'rowwise_split_input' on the output projection)")
    built: Dict[str, ColwiseParallel] = {}
    for c in sharded:
        proj = attn.get_submodule(c)
        out = getattr(proj, "out_features", None)
        if c in _Q:
            expected, st = heads * head_dim, ColwiseParallel(head_size=head_dim, heads=counts)
            if out == 2 * expected and _gated_query(attn):  # [q_h | gate_h] for each head h
                expected, st = out, ColwiseParallel(head_size=2 * head_dim, heads=counts)
        elif c in _GATES and out in (heads, heads * head_dim):  # a gate per head or feature
            per = 1 if out == heads else head_dim
            expected, st = out, ColwiseParallel(head_size=per, heads=counts)
        elif c in _K:
            expected = kv * head_dim
            st = ColwiseParallel(head_size=head_dim, replicate_heads=True, heads=counts)
        elif c in _V:
            expected = kv * v_dim
            st = ColwiseParallel(head_size=v_dim, replicate_heads=True, heads=counts)
        elif c == _FUSED_QKV and isinstance(getattr(attn, "mp_num", None), int):
            # CodeGen: mp_num blocks, each [q | v | k] of heads / mp_num heads; the forward
            # reads its input as blocks of embed_dim / mp_num features per part, so a rank
            # holding part of a block is told mp_num = the TP size.
            blocks = attn.mp_num
            if heads % blocks or kv != heads:
                raise ValueError(f"tpx.hf_plan: {parent}.{c}: {blocks} interleaved blocks of "
                                 f"{heads} heads ({kv} KV heads) do not split in whole heads")
            expected = 3 * heads * head_dim
            st = BlocksColwise(blocks, heads, head_dim)
            update = _blocks_update(blocks, heads)
            uneven = False
        elif c == _FUSED_QKV:
            expected = (heads + 2 * kv) * head_dim
            st = ColwiseParallel(segments=(heads * head_dim, kv * head_dim, kv * head_dim),
                                 head_size=head_dim, replicate_heads=True, heads=counts)
        elif c == _PER_HEAD_QKV:
            if kv != heads:
                raise ValueError(f"tpx.hf_plan: {parent}.{c}: a per-head [q k v] projection "
                                 f"with {kv} KV heads for {heads} query heads")
            expected, st = 3 * heads * head_dim, ColwiseParallel(head_size=3 * head_dim,
                                                                 heads=counts)
        else:
            continue
        if out != expected:
            raise ValueError(
                f"tpx.hf_plan: {parent}.{c} has {out} output features, not the {expected} its "
                f"config's heads give ({heads} heads, {kv} KV heads, head_dim {head_dim}); "
                "write the plan for this attention by hand")
        plan[f"{parent}.{c}"] = st
        built[c] = st
    _per_module_head_size(model, plan, parent, keys, built, head_dim)
    outs = [c for c, s in kids.items() if s in _ROWWISE]
    if len(outs) != 1:
        raise ValueError(f"tpx.hf_plan: {parent!r}: the heads are split but the plan has "
                         f"{len(outs)} row-parallel output projections under it ({outs}); "
                         "write the plan for this attention by hand")
    # Parameters under the attention the plan does not mention see only this rank's heads.
    own_dim = getattr(attn, "head_dim", None) or head_dim
    for name, sub in attn.named_children():
        if name in kids or not any(True for _ in sub.parameters()):
            continue
        if _per_head_norm(name, sub, own_dim):
            # A norm of each head's features that the plan does not name (Qwen3-VL-MoE's
            # q_norm / k_norm, which Qwen3's plan names 'replicated_with_grad_allreduce'):
            # kept whole, its gradient summed over the ranks' heads.
            for key in keys:
                plan[f"{key}.{name}"] = ReplicatedWithGradAllReduce()
            continue
        raise ValueError(
            f"tpx.hf_plan: {parent}.{name} ({type(sub).__name__}) has parameters and sits "
            "inside attention split by heads, but the plan does not name it: each rank would "
            "train it on its heads only. Add it to the plan ('replicated_with_grad_allreduce' "
            "for a norm shared by the heads) or write the plan by hand")
    # Layers whose KV heads differ from the config's (MiMo's sliding-window layers have twice
    # as many): each such module gets its own counts.
    k_name = next((c for c in sharded if c in _K), None)
    own_kv = {}
    if k_name is not None:
        for n, m in model.named_modules():
            if any(fnmatch.fnmatchcase(n, k) for k in keys):
                out_k = getattr(getattr(m, k_name, None), "out_features", None)
                if out_k:  # in the module's own head_dim (Gemma 4's layers differ)
                    own_kv[n] = out_k // (getattr(m, "head_dim", None) or head_dim)
    if own_kv and set(own_kv.values()) != {kv}:
        for n, kv_n in own_kv.items():
            plan[n] = ShardedAttention(heads, kv_n, out_proj=outs[0], update=update)
        keys[:] = list(own_kv)
        return
    out_key = f"{parent}.{outs[0]}"
    if uneven and type(plan.get(out_key)) is RowwiseParallel:
        out_st = copy.copy(plan[out_key])
        out_st.head_size, out_st.heads = v_dim, counts
        plan[out_key] = out_st
    else:
        uneven = False
    for key in keys:
        plan[key] = ShardedAttention(heads, kv, out_proj=outs[0], update=update, uneven=uneven)


def _per_head_norm(name: str, module: nn.Module, head_dim: int) -> bool:
    """Whether ``module`` (a child of an attention module) is a norm of one head's features:
    a norm by its class or attribute name, every parameter a vector of ``head_dim``."""
    if "norm" not in name.lower() and "norm" not in type(module).__name__.lower():
        return False
    return all(p.dim() == 1 and p.shape[0] == head_dim for p in module.parameters())


def _per_module_head_size(model: nn.Module, plan: Plan, parent: str, keys: List[str],
                          built: Dict[str, ColwiseParallel], head_dim: int) -> None:
    """Attention layers under one pattern whose ``head_dim`` differs from the first one's
    (Gemma 4's full-attention layers): each projection gets its own entry, split in that
    module's whole heads (a split in the first layer's head size would cut a replicated KV
    head in half)."""
    dims = {n: getattr(m, "head_dim", None) or head_dim for n, m in model.named_modules()
            if any(fnmatch.fnmatchcase(n, k) for k in keys)}
    if len(set(dims.values())) < 2:
        return
    import copy

    for c, st in built.items():
        if st.head_size is None:
            continue
        if st.segments is not None or (st.head_size * min(dims.values())) % head_dim:
            raise ValueError(f"tpx.hf_plan: {parent}.{c}: the layers' head_dim differ "
                             f"({sorted(set(dims.values()))}); write the plan for this "
                             "attention by hand")
        del plan[f"{parent}.{c}"]
        for n, d in dims.items():
            own = copy.copy(st)
            own.head_size = st.head_size * d // head_dim
            plan[f"{n}.{c}"] = own


def _head_params(model: nn.Module, plan: Plan, owner: str, params: Dict[str, str],
                 attn_parents: Dict[str, List[str]], cfg, local_params: bool = False) -> None:
    """Parameter entries outside experts: a per-head parameter of attention the plan splits
    by heads (attention sinks, a gate's bias: ``[num_heads, ...]``, ``'colwise'``) is split in
    the same whole heads as the queries (:class:`HeadParams`); anything else raises.
    ``local_params``: the plan marks ``owner`` ``'local_params'`` (an attention whose
    projections the plan splits in contiguous blocks, as MLA's ``q_b_proj``: with the heads
    dividing by the TP size, each block is whole heads, the same ones :class:`HeadParams`
    keeps)."""
    heads = getattr(cfg, "num_attention_heads", None)
    if owner not in attn_parents and local_params and heads:
        attn_parents = dict(attn_parents, **{owner: [owner]})
    for attr, name in params.items():
        key = f"{owner}.{attr}"
        if owner not in attn_parents or name != "colwise":
            raise ValueError(
                f"tpx.hf_plan.translate: the plan entry {key!r}: {name!r} names the parameter "
                f"{attr!r} of {owner!r}, not a module. tpx reads such entries under a "
                "'moe_tp_experts' module and for a per-head parameter ('colwise') of attention "
                "split by heads; give the module a style in the plan instead")
        for mod in [m for n, m in model.named_modules()
                    if any(fnmatch.fnmatchcase(n, k) for k in attn_parents[owner])]:
            p = getattr(mod, attr, None)
            if p is None:  # not in this layer (sinks of the sliding-window layers only)
                continue
            if not isinstance(p, nn.Parameter) or not p.dim() or p.shape[0] != heads:
                raise ValueError(
                    f"tpx.hf_plan.translate: the plan entry {key!r}: 'colwise' on a parameter "
                    f"of attention split by heads needs one row per query head ({heads}); got "
                    f"{tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__}")
    for k in attn_parents[owner] if owner in attn_parents else ():
        st = plan[k]
        kv = (getattr(cfg, "num_key_value_heads", None) or heads) if getattr(
            st, "uneven", False) else None
        plan[k] = Chain(st, HeadParams(tuple(params), heads, kv))


def _blocks_update(blocks: int, heads: int):
    """``update`` of an attention whose fused projection is ``blocks`` interleaved blocks
    (CodeGen's ``mp_num``, split by :class:`BlocksColwise`): a TP size that divides the blocks
    or is a multiple of them."""
    def update(module: nn.Module, local_heads: int, local_kv_heads: int) -> None:
        world = heads // local_heads
        if blocks % world and world % blocks:
            raise ValueError(
                f"tpx.hf_plan: {type(module).__name__}'s fused qkv_proj is {blocks} interleaved "
                f"[q | v | k] blocks; TP size {world} neither divides them nor is a multiple "
                f"of them: use a TP size that divides {blocks} or a multiple of {blocks}")
        _local_heads_update(module, local_heads, local_kv_heads)
        module.mp_num = max(blocks, world)  # the forward's blocks of embed_dim / mp_num
    return update
