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

import fnmatch
import inspect
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from .generate import with_generate
from .moe import MoEIdentityExpert
from .sequence import Chain, GatherSequence, PadSequence, SeqLength, SplitSequence, find_module
from .style import (ColwiseParallel, ParallelStyle, PrepareModuleInput, Replicate,
                    ReplicatedWithGradAllReduce, RowwiseParallel, SequenceParallel, Shard,
                    ShardedAttention)

__all__ = ["HF_STYLES", "HFStyle", "style", "translate", "has_plan", "hf_tp_plan"]

Plan = Dict[str, ParallelStyle]


# ------------------------------------------------------------------ small styles of the table

class AllReduceOutput(ParallelStyle):
    """A module whose output is a partial sum on every rank (its parameters already sharded
    by entries inside it): the output is summed over the group. ``P -> R``; backward
    identity. Hugging Face's ``all_reduce``."""

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        if pg.size() > 1:
            module.register_forward_hook(
                lambda m, a, out: mappings.all_reduce_sum(out, pg)
                if isinstance(out, Tensor) else out)
        return module

    def __repr__(self) -> str:
        return "AllReduceOutput()"


class KeepWhole(ParallelStyle):
    """Leaves the module whole on every rank (its parameters broadcast from ``src_rank`` as
    every unsharded one). Hugging Face's ``replicate`` and ``local_params`` (tpx's sharded
    layers compute on local tensors already, so a module that reads its own sharded
    parameters needs nothing more)."""

    def __init__(self, hf_name: str = "replicate") -> None:
        self.hf_name = hf_name

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        return module

    def __repr__(self) -> str:
        return f"KeepWhole({self.hf_name!r})"


class SplitRopeGrad(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa`` (DeepSeek-V2 style attention), replicated: its output is
    ``[k_pass | k_rope]``; ``k_pass`` goes through a column-parallel ``kv_b_proj`` (whose
    backward sums the input gradient), ``k_rope`` straight to this rank's heads, so its
    gradient is partial and is summed here. ``rope_dim``: ``config.qk_rope_head_dim``.
    Hugging Face's ``mla_kv_a_proj``."""

    def __init__(self, rope_dim: int) -> None:
        self.rope_dim = int(rope_dim)

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        n = self.rope_dim

        def hook(mod, args, out):
            if pg.size() == 1 or not isinstance(out, Tensor):
                return out
            keep, rope = out.split([out.shape[-1] - n, n], dim=-1)
            return torch.cat([keep, mappings.all_reduce_grad(rope, pg)], dim=-1)

        module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return f"SplitRopeGrad(rope_dim={self.rope_dim})"


class VocabParallelEmbeddingStyle(ParallelStyle):
    """``nn.Embedding`` -> :class:`tpx.VocabParallelEmbedding` (rows of the vocabulary
    sharded, lookups summed), also for a subclass that scales its output (Gemma's
    ``*ScaledWordEmbedding``: ``super().forward(ids) * self.embed_scale``): the scale is kept
    and applied to the summed lookup. Any other subclass with its own forward raises
    ``ValueError``. Hugging Face's ``embedding_rowwise``; ids R, output R."""

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tpx.hf_plan: 'embedding_rowwise' applies to nn.Embedding; got "
                             f"{type(module).__name__}")
        if type(module).forward is nn.Embedding.forward:
            return RowwiseParallel(input_layouts=Replicate()).apply(module, pg, src_rank)
        scale = getattr(module, "embed_scale", None)
        if not _is_scaled_embedding(module):
            raise ValueError(
                f"tpx.hf_plan: {type(module).__name__} subclasses nn.Embedding with its own "
                "forward, which a vocab-parallel embedding would drop. tpx keeps the forward "
                "of a scaled embedding (super().forward(ids) * self.embed_scale) only; leave "
                "this module out of the plan ('replicate') or write a style for it")
        from ..nn import VocabParallelEmbedding

        new = VocabParallelEmbedding.from_embedding(module, group=pg, src_rank=src_rank)
        scale = scale.detach().clone() if isinstance(scale, Tensor) else torch.tensor(scale)
        new.register_buffer("embed_scale", scale, persistent=False)
        new.register_forward_hook(lambda m, a, out: out * m.embed_scale.to(out.dtype))
        return new

    def __repr__(self) -> str:
        return "VocabParallelEmbeddingStyle()"


def _is_scaled_embedding(module: nn.Module) -> bool:
    """A subclass of nn.Embedding whose forward is the lookup times ``self.embed_scale``."""
    if not hasattr(module, "embed_scale"):
        return False
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    body = [ln.strip() for ln in src.splitlines()[1:]
            if ln.strip() and not ln.strip().startswith(("#", '"""', "'''"))]
    return (len(body) == 1 and body[0].startswith("return super().forward(")
            and "* self.embed_scale" in body[0])


def _experts_style(module: nn.Module, name: str, params: Dict[str, str],
                   experts: str = "tp") -> ParallelStyle:
    """``moe_tp_experts``: tpx's experts style (``experts="tp"``: expert TP,
    :class:`~tpx.parallel.moe.ExpertsTensorParallel`; ``"ep"``: expert parallelism,
    :class:`~tpx.parallel.moe.ExpertsParallel`). ``params``: the plan's parameter entries under
    this module (attribute -> style name), read here and not applied again. The pairs read:
    ``packed_colwise`` [gate | up] ``[E, 2I, H]`` with ``rowwise`` down ``[E, H, I]``; the
    same stored transposed (``packed_rowwise`` ``[E, H, 2I]`` with ``colwise`` ``[E, I, H]``,
    Aria); a non-gated ``colwise`` up ``[E, I, H]`` with ``rowwise`` down (NemotronH)."""
    from .moe import ExpertsParallel, ExpertsTensorParallel

    styles = sorted(params.values())
    kwargs: Dict[str, object] = {}
    if styles in (["colwise", "packed_rowwise"], ["colwise", "rowwise"]):
        first = "packed_rowwise" if "packed_rowwise" in styles else "colwise"
        second = "colwise" if first == "packed_rowwise" else "rowwise"
        up = next(p for p, s in params.items() if s == first)
        down = next(p for p, s in params.items() if s == second)
        kwargs = dict(gate_up=up, down=down)
        if first == "packed_rowwise":
            kwargs.update(packed=True, transposed=True)
        else:
            w_up, w_down = getattr(module, up, None), getattr(module, down, None)
            if not (isinstance(w_up, Tensor) and isinstance(w_down, Tensor)
                    and w_up.dim() == 3 and w_down.dim() == 3
                    and w_up.shape[1] == w_down.shape[2]):
                raise ValueError(
                    f"tpx.hf_plan: the experts {name!r} ('moe_tp_experts') come with "
                    f"{params}: a 'colwise' {up!r} is read as a non-gated up projection "
                    f"[experts, intermediate, hidden] beside {down!r} [experts, hidden, "
                    "intermediate], but the shapes are "
                    f"{tuple(getattr(w_up, 'shape', ()))} and "
                    f"{tuple(getattr(w_down, 'shape', ()))} (a fused [gate | up] split in one "
                    "block would pair gates with the wrong up features). Write the plan for "
                    "these experts by hand")
            kwargs["packed"] = False
    else:
        gate_up = [p for p, s in params.items() if s == "packed_colwise"]
        down = [p for p, s in params.items() if s == "rowwise"]
        other = {p: s for p, s in params.items() if p not in gate_up + down}
        if other or len(gate_up) > 1 or len(down) > 1:
            raise ValueError(
                f"tpx.hf_plan: the experts {name!r} ('moe_tp_experts') come with the parameter "
                f"entries {params}; tpx's experts style reads a 'packed_colwise' fused [gate | "
                "up] projection ([experts, 2 * intermediate, hidden]) with a 'rowwise' down "
                "projection ([experts, hidden, intermediate]), the same transposed "
                "('packed_rowwise' with 'colwise'), or a non-gated 'colwise' up with a "
                "'rowwise' down. Write the plan for these experts by hand")
        if gate_up:
            kwargs["gate_up"] = gate_up[0]
        if down:
            kwargs["down"] = down[0]
        kwargs["packed"] = True
    cls = ExpertsParallel if experts == "ep" else ExpertsTensorParallel
    return cls(**kwargs)


def _packed_colwise(module: nn.Module) -> ParallelStyle:
    out = getattr(module, "out_features", None)
    if out is None or out % 2:
        raise ValueError(f"tpx.hf_plan: 'packed_colwise' on a module needs a linear layer with "
                         f"an even number of output features ([gate | up]); got "
                         f"{type(module).__name__} with out_features={out}")
    return ColwiseParallel(segments=(out // 2, out // 2))


def _unsupported(name: str, why: str):
    def build(module, ctx):
        raise ValueError(f"tpx.hf_plan: the style {name!r} on {type(module).__name__}: {why}")
    return build


@dataclass(frozen=True)
class HFStyle:
    """One entry of :data:`HF_STYLES`: a transformers style name, what transformers does with
    it, and how tpx computes the same thing."""

    name: str
    hf: str            # transformers' semantics (placements, what is gathered or summed)
    tpx: str           # the tpx style and its placements
    build: Callable    # build(module, ctx) -> ParallelStyle; module: one module it names
    target: str = "module"   # "module" or "module or parameter"


def _b(make):
    return lambda module, ctx: make()


_GATHER = "ColwiseParallel(output_layouts=Replicate())"
_SPLIT = "RowwiseParallel(input_layouts=Replicate())"

#: Every style name of transformers' ``ALL_PARALLEL_STYLES`` -> its tpx style.
HF_STYLES: Dict[str, HFStyle] = {s.name: s for s in (
    HFStyle("colwise", "Linear weight and bias Shard(0) (output features); input R, output "
            "S(-1)", "ColwiseParallel() (attention projections: in whole heads, see translate)",
            _b(ColwiseParallel), "module or parameter"),
    HFStyle("colwise_gather_output", "as colwise, output gathered to R", _GATHER,
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("colwise_rep", "the same as colwise_gather_output", _GATHER,
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("rowwise", "Linear weight Shard(1) (input features), bias R added once after the "
            "sum; input S(-1), output P -> R (all-reduce)", "RowwiseParallel()",
            _b(RowwiseParallel), "module or parameter"),
    HFStyle("rowwise_split_input", "as rowwise, input R split locally to S(-1)", _SPLIT,
            _b(lambda: RowwiseParallel(input_layouts=Replicate()))),
    HFStyle("rowwise_rep", "the same as rowwise_split_input", _SPLIT,
            _b(lambda: RowwiseParallel(input_layouts=Replicate()))),
    HFStyle("embedding_rowwise", "Embedding weight Shard(0) (vocabulary); ids R, lookups "
            "P -> R", "VocabParallelEmbeddingStyle() (tpx.VocabParallelEmbedding; a scaled "
            "embedding keeps its scale)", _b(VocabParallelEmbeddingStyle)),
    HFStyle("embedding_colwise", "Embedding weight Shard(1) (embedding dim); ids R, output "
            "gathered to R", "ColwiseParallel(output_layouts=Replicate()) "
            "(tpx.ColumnParallelEmbedding)",
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("packed_colwise", "fused [gate | up] weight, each half Shard(0) "
            "(_StridedShard, split_factor 2: every rank keeps matching halves); input R, output "
            "S(-1) of each half", "ColwiseParallel(segments=(n/2, n/2)) on a Linear (its bias "
            "split the same way); on experts' parameters: read by ExpertsTensorParallel",
            lambda module, ctx: _packed_colwise(module), "module or parameter"),
    HFStyle("packed_rowwise", "weight packed along its last dim, each half Shard(-1) "
            "(_StridedShard), bias R", "experts' parameters only (read by the experts' style)",
            _unsupported("packed_rowwise", "a Linear whose input is two packed halves has no "
                         "tpx style; write the plan for this module by hand"),
            "module or parameter"),
    HFStyle("sequence_parallel", "norm/dropout on S(1) (the sequence), parameters R",
            "SequenceParallel(use_local_output=True) (gradients summed over the group)",
            _b(lambda: SequenceParallel(use_local_output=True))),
    HFStyle("replicated_with_grad_allreduce", "parameters R whose gradient is partial (a "
            "per-head norm after a column-parallel projection); gradient summed",
            "ReplicatedWithGradAllReduce()", _b(ReplicatedWithGradAllReduce)),
    HFStyle("all_reduce", "the module's output P -> R (all-reduce), backward identity",
            "AllReduceOutput()", _b(AllReduceOutput)),
    HFStyle("mla_kv_a_proj", "output [pass | rope]: the rope part's gradient summed (it "
            "bypasses the column-parallel kv_b_proj)", "SplitRopeGrad(config.qk_rope_head_dim)",
            lambda module, ctx: SplitRopeGrad(_rope_dim(ctx))),
    HFStyle("local_params", "the module's forward runs on its sharded parameters as local "
            "tensors", "KeepWhole('local_params') (tpx computes on local tensors already)",
            _b(lambda: KeepWhole("local_params"))),
    HFStyle("replicate", "every rank keeps the full parameter", "KeepWhole('replicate')",
            _b(lambda: KeepWhole("replicate")), "module or parameter"),
    HFStyle("moe_tp_experts", "each expert's [gate|up] Shard(-2) packed, down Shard(-1); "
            "input R (gradient summed), output P -> R", "tpx.parallel.moe."
            "ExpertsTensorParallel (imported when needed; it shards the experts' parameters)",
            lambda module, ctx: _experts_style(module, ctx["name"], ctx["params"],
                                               ctx["experts"])),
    HFStyle("moe_identity_expert", "input divided by the TP size (the experts' sum counts it "
            "once)", "tpx.MoEIdentityExpert()", _b(MoEIdentityExpert)),
)}


def _rope_dim(ctx) -> int:
    cfg = _text_config(ctx["model"])
    n = getattr(cfg, "qk_rope_head_dim", None)
    if n is None:
        raise ValueError("tpx.hf_plan: 'mla_kv_a_proj' needs config.qk_rope_head_dim")
    return n


def style(name: str, module: Optional[nn.Module] = None) -> ParallelStyle:
    """The tpx style for one Hugging Face style name (``"colwise"``, ``"rowwise"``, ...).
    ``module``: the module it will shard, for the styles that read it (``packed_colwise``)."""
    if name not in HF_STYLES:
        raise ValueError(f"tpx.hf_plan.style: unknown Hugging Face style {name!r}; known: "
                         f"{sorted(HF_STYLES)}")
    if name in ("moe_tp_experts", "mla_kv_a_proj"):
        raise ValueError(f"tpx.hf_plan.style: {name!r} reads the model (its config, the "
                         "experts' parameter entries); use tpx.hf_plan.translate(model)")
    return HF_STYLES[name].build(module, {})


# ------------------------------------------------------------------ reading the model's plan

def _text_config(model: nn.Module):
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def has_plan(model: nn.Module) -> bool:
    """Whether the Hugging Face ``model``'s config has a ``base_model_tp_plan``."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    return bool(getattr(cfg, "base_model_tp_plan", None)
                or getattr(_text_config(model), "base_model_tp_plan", None))


def hf_tp_plan(model: nn.Module) -> Dict[str, str]:
    """The model's Hugging Face plan, keys relative to ``model``: ``model.tp_plan`` (the
    config's ``base_model_tp_plan`` under the base model's prefix, with the classes'
    ``_tp_plan`` and the ``embedding_rowwise`` transformers adds for ``embed_tokens``)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base = _text_config(model).base_model_tp_plan or {}
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
    (expert parallelism: whole experts per rank; docs/experts.md)."""
    if experts not in ("tp", "ep"):
        raise ValueError(f"tpx.hf_plan.translate: `experts` must be 'tp' or 'ep'; got "
                         f"{experts!r}")

    hf = dict(tp_plan) if tp_plan is not None else hf_tp_plan(model)
    if not hf:
        raise ValueError(f"tpx.hf_plan.translate: {type(model).__name__} has no Hugging Face TP "
                         "plan (config.base_model_tp_plan is empty); pass tp_plan= or write the "
                         "plan by hand")
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
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
    experts = {k for k, s in mod_entries.items() if s == "moe_tp_experts"}
    under: Dict[str, Dict[str, str]] = {k: {} for k in experts}
    bare: Dict[str, Dict[str, str]] = {}  # owner -> {parameter: style}, outside experts
    for key, name in param_entries.items():
        owner, attr = _parent(key)
        if owner in experts:
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
    cfg = _text_config(model)
    children: Dict[str, Dict[str, str]] = {}
    for key, name in mod_entries.items():
        parent, child = _parent(key)
        children.setdefault(parent, {})[child] = name
    for parent, kids in children.items():
        if any(s in _COLWISE_OUT for s in kids.values()):
            _check_whole_feature_statistics(modules, names, parent)
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
                plan[parent + ".gate_up_proj"] = _packed_colwise(first(parent + ".gate_up_proj"))
                plan[parent + "." + downs[0]] = RowwiseParallel()

    emb_name = _name_of(model, model.get_input_embeddings()
                        if callable(getattr(model, "get_input_embeddings", None)) else None)
    if emb_name and not any(fnmatch.fnmatchcase(emb_name, k) for k in plan):
        plan[emb_name] = VocabParallelEmbeddingStyle()
    head_mod = (model.get_output_embeddings()
                if callable(getattr(model, "get_output_embeddings", None)) else None)
    head = _name_of(model, head_mod) if isinstance(head_mod, nn.Linear) else None
    if head is not None:
        for k in [k for k in plan if fnmatch.fnmatchcase(head, k)]:
            del plan[k]
        plan[head] = ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())
    elif loss_parallel:
        raise ValueError(f"tpx.plans.auto: loss_parallel=True needs a model with an LM head "
                         f"(model_type={model_type!r}, {type(model).__name__})")
    if sequence_parallel:
        _sequence_parallel(model, plan, mod_entries, attn_parents, model_type)
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


def _check_whole_feature_statistics(modules: Dict[str, nn.Module], names: List[str],
                                    parent: str) -> None:
    """A block whose forward reduces over all the features a column-parallel child splits
    would compute its statistic over this rank's features only: Gemma 3n's activation-sparse
    MLP keeps the activations above a mean plus a multiple of the standard deviation over all
    its intermediate features (``activation_sparsity``)."""
    for n in names:
        if fnmatch.fnmatchcase(n, parent) and getattr(modules[n], "activation_sparsity", 0):
            raise ValueError(
                f"tpx.hf_plan: {n} ({type(modules[n]).__name__}) keeps the activations above "
                "a mean and standard deviation over all its intermediate features "
                f"(activation_sparsity={modules[n].activation_sparsity}); split column-wise, "
                "each rank would compute them over its own features only. Leave this block "
                "whole (remove its entries from the plan) or write a style for it")


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


def _storage(t) -> Optional[int]:
    return t.untyped_storage().data_ptr() if isinstance(t, Tensor) else None


class _PartialGradParams(ParallelStyle):
    """A module with parameters in a block whose plan splits features column-parallel and
    joins them row-parallel, not named by the plan. Where it sees only this rank's features
    (an activation with its own parameters between the projections: Apertus' xIELU
    ``alpha_p`` / ``alpha_n``) its gradient is a partial sum and is summed over the group, as
    :class:`ReplicatedWithGradAllReduce` does; where it sees a whole (replicated) input (a norm
    before the projections: an MLA attention's ``kv_a_layernorm``) its gradient is whole and
    left alone. Which of the two, each call tells from its input: a column-parallel sibling's
    output of this call of the block (or a view of it: one half of a packed [gate | up]
    output), or anything else."""

    def __init__(self, name: str, block: nn.Module, columns: List[str]) -> None:
        self.name, self.block, self.columns = name, block, list(columns)

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        if pg.size() == 1:
            return module
        state = {"partial": False, "outputs": set(), "hooked": set()}
        self.block.register_forward_pre_hook(lambda mod, args: self._start(state))
        module.register_forward_pre_hook(lambda mod, args: self._see(state, args))
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, pg=pg: mappings.sum_over_group(g, pg)
                                if state["partial"] else g)
        return module

    def _start(self, state) -> None:
        """At each call of the block: forget the last call's outputs; hook the column-parallel
        siblings (the layers parallelize_module put in their place) to record theirs."""
        state["outputs"].clear()
        for c in self.columns:
            sub = self.block.get_submodule(c)
            if id(sub) not in state["hooked"]:
                state["hooked"].add(id(sub))
                sub.register_forward_hook(
                    lambda mod, args, out: state["outputs"].add(_storage(out)))

    def _see(self, state, args) -> None:
        x = next((a for a in args if isinstance(a, Tensor)), None)
        state["partial"] = x is not None and _storage(x) in state["outputs"]

    def __repr__(self) -> str:
        return f"gradient summed where it sees {self.columns}' local features"


def _partial_grad_params(modules: Dict[str, nn.Module], names: List[str], plan: Plan,
                         parent: str, kids: Dict[str, str]) -> None:
    """In a block whose plan splits features column-parallel and joins them row-parallel
    (an MLP), each child with parameters the plan does not name gets its gradient summed
    (:class:`_PartialGradParams`)."""
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
                plan[key] = _PartialGradParams(key, modules[x], cols)


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
    sharded = [c for c, s in kids.items() if s in _COLWISE_OUT]  # the plan's order
    update = _local_heads_update
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
            expected, st = heads * head_dim, ColwiseParallel(head_size=head_dim)
            if out == 2 * expected and _gated_query(attn):  # [q_h | gate_h] for each head h
                expected, st = out, ColwiseParallel(head_size=2 * head_dim)
        elif c in _K:
            expected = kv * head_dim
            st = ColwiseParallel(head_size=head_dim, replicate_heads=True)
        elif c in _V:
            v_dim = getattr(attn, "v_head_dim", None) or head_dim
            expected = kv * v_dim
            st = ColwiseParallel(head_size=v_dim, replicate_heads=True)
        elif c == _FUSED_QKV and isinstance(getattr(attn, "mp_num", None), int):
            # CodeGen: mp_num blocks, each [q | v | k] of heads / mp_num heads; the forward
            # reads however many whole blocks its input holds.
            blocks = attn.mp_num
            if heads % blocks or kv != heads:
                raise ValueError(f"tpx.hf_plan: {parent}.{c}: {blocks} interleaved blocks of "
                                 f"{heads} heads ({kv} KV heads) do not split in whole heads")
            expected = 3 * heads * head_dim
            st = ColwiseParallel(head_size=expected // blocks)
            update = _blocks_update(blocks, heads)
        elif c == _FUSED_QKV:
            expected = (heads + 2 * kv) * head_dim
            st = ColwiseParallel(segments=(heads * head_dim, kv * head_dim, kv * head_dim),
                                 head_size=head_dim, replicate_heads=True)
        elif c == _PER_HEAD_QKV:
            if kv != heads:
                raise ValueError(f"tpx.hf_plan: {parent}.{c}: a per-head [q k v] projection "
                                 f"with {kv} KV heads for {heads} query heads")
            expected, st = 3 * heads * head_dim, ColwiseParallel(head_size=3 * head_dim)
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
    for name, sub in attn.named_children():
        if name in kids or not any(True for _ in sub.parameters()):
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
    for key in keys:
        plan[key] = ShardedAttention(heads, kv, out_proj=outs[0], update=update)


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
        plan[k] = Chain(plan[k], HeadParams(tuple(params), heads))


class HeadParams(ParallelStyle):
    """Bare per-head parameters of an attention module split by heads (attention sinks,
    ``[num_heads]``): each rank keeps the rows of its query heads (``num_heads`` must divide
    by the TP size, as the queries' split needs). The parameters become ``DTensor`` s,
    ``Shard(0)`` of their full shape on the TP mesh (state dicts, DCP and optimizers see the
    whole); the module's forward reads their local tensors (Hugging Face's ``local_params``),
    and their gradients land as ``DTensor`` s. Values from ``src_rank``."""

    def __init__(self, names: Tuple[str, ...], num_heads: int) -> None:
        self.names, self.num_heads = tuple(names), int(num_heads)

    def apply(self, module: nn.Module, pg: dist.ProcessGroup, src_rank: Optional[int] = 0):
        from torch.distributed.tensor import DTensor

        from ..group import broadcast_
        from ..sharding import describe_params

        world, rank = pg.size(), dist.get_rank(pg)
        if self.num_heads % world:
            raise ValueError(f"tpx.HeadParams: {self.num_heads} heads do not divide by the TP "
                             f"size {world}")
        names = tuple(n for n in self.names if getattr(module, n, None) is not None)
        params = [getattr(module, n) for n in names]
        if not params:
            return module
        if src_rank is not None and world > 1:
            with torch.no_grad():
                broadcast_(pg, src_rank, [p.data for p in params])
        per = self.num_heads // world
        rows = tuple(((r * per, (r + 1) * per),) for r in range(world))
        with torch.no_grad():
            for p in params:
                p.data = p.detach()[rank * per:(rank + 1) * per].clone()
        # Described as a tpx layer's parameters are: tpx.checkpoint, clipping and the checks
        # read the layout; describe_params makes them DTensors (Shard(0), full shape).
        module._shards = lambda names=names, rows=rows: [(n, 0, rows) for n in names]
        module.group = pg
        module._tpx_dtensor_params = True
        describe_params(module)
        saved: Dict[int, Dict[str, nn.Parameter]] = {}

        def to_local(mod, args):
            dts = [n for n, p in mod._parameters.items() if isinstance(p, DTensor)]
            saved[id(mod)] = {n: mod._parameters[n] for n in dts}
            for n in dts:
                dt = mod._parameters[n]
                mod._parameters[n] = dt.to_local() if torch.is_grad_enabled() else \
                    dt._local_tensor
            return None

        def restore(mod, args, out):
            for n, p in saved.pop(id(mod), {}).items():
                mod._parameters[n] = p
            return None

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"HeadParams({list(self.names)}, num_heads={self.num_heads})"


def _blocks_update(blocks: int, heads: int):
    """``update`` of an attention whose fused projection is ``blocks`` interleaved blocks
    (CodeGen's ``mp_num``): each rank must hold whole blocks."""
    def update(module: nn.Module, local_heads: int, local_kv_heads: int) -> None:
        world = heads // local_heads
        if blocks % world:
            raise ValueError(
                f"tpx.hf_plan: {type(module).__name__}'s fused qkv_proj is {blocks} interleaved "
                f"[q | v | k] blocks; TP size {world} does not divide them: use a TP size that "
                f"divides {blocks}")
        _local_heads_update(module, local_heads, local_kv_heads)
    return update


def _sequence_parallel(model: nn.Module, plan: Plan, entries: Dict[str, str],
                       attn_parents: Dict[str, List[str]], model_type) -> None:
    """Sequence parallelism layered on the translated plan, as for the Llama family: the
    decoder layers run on this rank's block of the sequence (padded to a multiple of the TP
    size), their norms on the block; attention gathers the sequence before it (trimmed to
    the real positions) and its output projection reduce-scatters it; the MLP gathers
    it (padded) and its down projection reduce-scatters; the final norm gathers it back."""

    def fail(why):
        return ValueError(f"tpx.plans.auto: sequence_parallel=True is not supported for "
                          f"model_type={model_type!r}: {why}; use sequence_parallel=False")

    layers = find_module(model, "layers")
    if layers is None or not isinstance(model.get_submodule(layers), nn.ModuleList):
        raise fail("no `layers` list of decoder layers")
    pre = layers + ".*."
    base = layers[: len(layers) - len("layers")]
    layer = model.get_submodule(layers)[0]
    rows = {k: s for k, s in entries.items() if s in _ROWWISE and k.startswith(pre)}
    blocks = {}
    for key in rows:
        block = key[len(pre):].split(".")[0]
        blocks.setdefault(block, []).append(key)
    attn = [p for p in attn_parents if p.startswith(pre)]
    if any(attn_parents[p] != [p] for p in attn):
        raise fail("not every decoder layer has the attention the plan splits by heads")
    if len(attn) != 1 or any(len(v) != 1 for v in blocks.values()) or len(blocks) != 2:
        raise fail("the decoder layer is not one attention and one MLP, each ending in one "
                   "row-parallel projection")
    attn_child = attn[0][len(pre):]
    if "." in attn_child or attn_child not in blocks:
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
        new = RowwiseParallel(input_layouts=st.input_layouts, output_layouts=Shard(1))
        plan[key] = Chain(new, PadSequence(n)) if key.startswith(attn[0] + ".") else new
    plan[attn[0]] = Chain(plan[attn[0]], GatherSequence(n, "input"))
    # tpx's own plan hands local tensors between the blocks (no DTensor on the hot path)
    plan[pre + mlp_child] = PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
    plan[pre.replace("*", "0").rstrip(".")] = SplitSequence(n)
    for name, sub in layer.named_children():
        if name not in (attn_child, mlp_child):
            plan[pre + name] = SequenceParallel(use_local_output=True)
    plan[base + finals[0]] = Chain(SequenceParallel(use_local_output=True),
                                    GatherSequence(n, "output"))
