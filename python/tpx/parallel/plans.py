"""Ready-made TP plans: ``tpx.plans.auto(model)`` recognises the model family and returns the
plan (a dict from module-name patterns to styles) for ``tpx.parallelize_module``.

Families:

* Any Hugging Face model whose config has a ``base_model_tp_plan`` (Llama, Mistral, Qwen2/3,
  Gemma 2/3, Phi, Phi-3, Starcoder2, OLMo/OLMo-2, Cohere, Granite, GLM, GPT-NeoX, ...): its
  own plan read through :mod:`tpx.parallel.hf_plan` (one table from Hugging Face's style
  names to tpx styles), with what tpx adds on top: attention in whole heads and KV heads
  replicated when there are fewer than ranks, the attention told its local head counts,
  per-head norms' gradients summed, the embedding vocab-parallel and the LM head colwise,
  sequence parallelism where the decoder layer is one attention, one MLP and norms.
  ``tpx.plans.llama`` and ``tpx.plans.gpt_neox`` are that translation under their old names.
* Hugging Face GPT-2 (no ``base_model_tp_plan``; planned by hand): the fused ``c_attn``
  (``Conv1D``, ``[q | k | v]``) split per q, k and v; ``c_proj`` rowwise; ``wte`` rowwise and
  the LM head colwise, still tied.
* A plain PyTorch decoder in torchtitan's naming (``tok_embeddings``,
  ``layers.*.attention.wq/wk/wv/wo``, ``layers.*.feed_forward.w1/w2/w3``, ``norm``,
  ``output``), or gpt-fast's fused ``attention.wqkv``. Sequence parallelism supported.

With ``loss_parallel=True`` the LM head's output stays sharded over the vocabulary
(``Shard(-1)``): compute the loss inside ``with tpx.loss_parallel():``. A Hugging Face model's
own ``generate()`` sees the full logits (gathered while it runs), so it generates what one
device generates with every plan here, sequence-parallel ones at any length included (the
sequence is padded to a multiple of the TP size inside the decoder layers).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn

from . import derive as derived
from .base import ModelPlan
from . import completed, hf_plan
from .derive import DerivedPlan, derive
from .generate import MeshInputFullLogits, with_generate
from .mesh_styles import ATTENTION_INPUTS, MeshAttention, MeshInput, MeshParallel
from .sequence import Chain, SeqLength, SplitSequence, find_module, owned_layers
from .style import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput, Replicate,
    RowwiseParallel, SequenceParallel, Shard, ShardedAttention)

__all__ = ["auto", "derive", "DerivedPlan", "ModelPlan", "llama", "gpt2", "gpt_neox", "decoder",
           "check", "PlanReport"]

Plan = Dict[str, ParallelStyle]


def _prefix(name: Optional[str], suffix: str) -> str:
    return name[: len(name) - len(suffix)] if name else ""


def _head_output(loss_parallel: bool, seq) -> ColwiseParallel:
    return ColwiseParallel(input_layouts=seq,
                           output_layouts=Shard(-1) if loss_parallel else Replicate())


def _set_attrs(**names):
    """An ``update`` for ShardedAttention: attribute -> function(local heads, local KV heads,
    module) giving its local value (only attributes the module has are set)."""
    def update(module, heads, kv_heads):
        for attr, fn in names.items():
            if hasattr(module, attr):
                setattr(module, attr, fn(heads, kv_heads, module))
    return update


def llama(model: nn.Module, *, sequence_parallel: bool = False,
          loss_parallel: bool = False) -> Plan:
    """Plan for Hugging Face Llama / Mistral / Qwen2 (``...ForCausalLM`` or the bare model):
    the model's own TP plan read by :func:`tpx.parallel.hf_plan.translate` (q/k/v in whole
    heads, KV heads replicated when there are fewer than ranks, o_proj rowwise, gate/up
    colwise, down rowwise, embedding vocab-parallel, LM head colwise; sequence parallelism
    supported). Kept under this name for the code that calls it."""
    return hf_plan.translate(model, sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)


def gpt2(model: nn.Module, *, sequence_parallel: bool = False,
         loss_parallel: bool = False) -> Plan:
    """Plan for Hugging Face GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``)."""
    if sequence_parallel:
        raise NotImplementedError("tpx.plans.gpt2: sequence_parallel=True is not supported for "
                                  "GPT-2 yet; use sequence_parallel=False")
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise NotImplementedError("tpx.plans.gpt2: cross-attention GPT-2 is not supported")
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    h = find_module(model, "h")
    pre = f"{h}.*." if h else "h.*."
    base = _prefix(h, "h")
    plan: Plan = {
        pre + "attn": ShardedAttention(
            heads, out_proj="c_proj", uneven=True,
            update=_set_attrs(split_size=lambda h, k, m: h * m.head_dim,
                              embed_dim=lambda h, k, m: h * m.head_dim,
                              num_heads=lambda h, k, m: h)),
        base + "wte": RowwiseParallel(input_layouts=Replicate()),
        # heads that do not divide the TP size (GPT-2's 12 at TP 8) in blocks of 2 and 1
        pre + "attn.c_attn": ColwiseParallel(segments=(d, d, d), head_size=d // heads,
                                             heads=(heads, heads)),
        pre + "attn.c_proj": RowwiseParallel(head_size=d // heads, heads=(heads, heads)),
        pre + "mlp.c_fc": ColwiseParallel(),
        pre + "mlp.c_proj": RowwiseParallel(),
    }
    head = "lm_head" if find_module(model, "lm_head") == "lm_head" else None
    if head is not None:
        plan["lm_head"] = _head_output(loss_parallel, Replicate())
    elif loss_parallel:
        raise ValueError("tpx.plans.gpt2: loss_parallel=True needs a model with an `lm_head`")
    return with_generate(plan, model, head, loss_parallel)


def gpt_neox(model: nn.Module, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> Plan:
    """Plan for Hugging Face GPT-NeoX (``GPTNeoXForCausalLM`` or ``GPTNeoXModel``): its own TP
    plan read by :func:`tpx.parallel.hf_plan.translate` (the fused ``query_key_value``, whose
    rows are ``[q k v]`` per head, split in whole heads; ``dense`` rowwise; the MLP; ``embed_in``
    vocab-parallel and the LM head colwise). Kept under this name for the code that calls it."""
    return hf_plan.translate(model, sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)


def decoder(model: nn.Module, *, sequence_parallel: bool = False,
            loss_parallel: bool = False) -> Plan:
    """Plan for a plain PyTorch decoder in torchtitan's names (separate ``wq/wk/wv``) or
    gpt-fast's (fused ``wqkv``). Head counts are read from the attention modules
    (``n_heads``/``n_head``, ``n_kv_heads``/``n_local_heads``, ``head_dim``) or from the
    projections' widths."""
    attn_name = find_module(model, "attention")
    if attn_name is None:
        raise ValueError("tpx.plans.decoder: no `layers.*.attention` module found")
    attn = model.get_submodule(attn_name)
    head_dim = getattr(attn, "head_dim", None)
    fused = hasattr(attn, "wqkv")
    q_out = attn.wq.out_features if not fused else None
    heads = getattr(attn, "n_heads", None) or getattr(attn, "n_head", None)
    if heads is None and head_dim and q_out:
        heads = q_out // head_dim
    kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "n_local_heads", None)
    if kv is None and head_dim and not fused:
        kv = attn.wk.out_features // head_dim
    if not heads or not head_dim:
        raise ValueError("tpx.plans.decoder: cannot read the head counts of "
                         f"{type(attn).__name__}; give it `n_heads` and `head_dim` attributes "
                         "or write the plan by hand")
    kv = kv or heads
    seq = Shard(1) if sequence_parallel else Replicate()
    pre = "layers.*."
    update = _set_attrs(
        n_rep=lambda h, k, m: h // k, n_heads=lambda h, k, m: h, n_head=lambda h, k, m: h,
        n_kv_heads=lambda h, k, m: k, n_local_heads=lambda h, k, m: k,
        dim=lambda h, k, m: h * m.head_dim if hasattr(m, "wqkv") else m.dim)
    plan: Plan = {
        pre + "attention": ShardedAttention(heads, kv, out_proj="wo", update=update),
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        pre + "attention.wo": RowwiseParallel(output_layouts=seq),
        pre + "feed_forward.w1": ColwiseParallel(),
        pre + "feed_forward.w3": ColwiseParallel(),
        pre + "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if fused:
        plan[pre + "attention.wqkv"] = ColwiseParallel(
            segments=(heads * head_dim, kv * head_dim, kv * head_dim), head_size=head_dim,
            replicate_heads=True)
    else:
        plan[pre + "attention.wq"] = ColwiseParallel(head_size=head_dim)
        plan[pre + "attention.wk"] = ColwiseParallel(head_size=head_dim, replicate_heads=True)
        plan[pre + "attention.wv"] = ColwiseParallel(head_size=head_dim, replicate_heads=True)
    if find_module(model, "output") == "output":
        plan["output"] = _head_output(loss_parallel, seq)
    if sequence_parallel:
        # a ready-made plan hands local tensors between the blocks (no DTensor on the hot path)
        gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                      use_local_output=True)
        plan[pre + "attention"] = Chain(plan[pre + "attention"], PrepareModuleInput(**gather))
        plan[pre + "feed_forward"] = PrepareModuleInput(**gather)
        for norm in (pre + "attention_norm", pre + "ffn_norm", "norm"):
            plan[norm] = SequenceParallel(use_local_output=True)
    _decoder_stage(model, plan, sequence_parallel)
    return plan


def _decoder_stage(model: nn.Module, plan: Plan, sequence_parallel: bool) -> None:
    """The plain decoder's plan on a pipeline stage (torchtitan's cut: ``tok_embeddings``,
    ``norm``, ``output`` set to ``None``, the other stages' layers deleted from ``layers``):
    entries only for the pieces it holds; under sequence parallelism the stage takes and
    returns whole hidden states ``R``, as the stage unsharded does (the contract of
    :func:`tpx.parallel.hf_sequence.sequence_parallel_plan`): without ``tok_embeddings`` its
    first layer splits the sequence (in equal blocks: its length must divide by the TP size),
    without ``output`` its ``norm``, or its last layer where it has no ``norm``, gathers it."""
    present = {n for n, _ in model.named_modules()}
    for name in ("tok_embeddings", "norm", "output"):
        if name not in present:
            plan.pop(name, None)
    owned = owned_layers(model, "layers") if "layers" in present else []
    if not sequence_parallel or not owned:
        return
    first, last = f"layers.{owned[0]}", f"layers.{owned[-1]}"
    if "tok_embeddings" not in present:
        plan[first] = SplitSequence(SeqLength(), pad=False)
    if "output" not in present:
        out = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                  use_local_output=True)
        at = "norm" if "norm" in present else last
        plan[at] = Chain(plan[at], out) if at in plan else out


# Hugging Face families planned by hand: GPT-2's config has no base_model_tp_plan. Every other
# family is read from its own plan (tpx.parallel.hf_plan), which the hand-written Llama and
# GPT-NeoX plans equalled.
_HF_FAMILIES = {"gpt2": gpt2}


def _mesh_plan(model: nn.Module, *, heads: int, kv_heads: int, embedding: str,
               layers: str, attention: str, norms: List[str], into: List[str],
               out_of: List[str], head: Optional[str], final_norm: Optional[str],
               update, loss_parallel: bool, input_kwargs) -> Plan:
    """The plan over a 2-D / 2.5-D / 3-D mesh: every Linear, norm and the embedding swapped
    for the layout's layer (3-D: the projections out of attention and the MLP read the
    activation split by "weight"), attention told its local heads, the model's inputs split
    at its entry and the LM head's output gathered (kept sharded with ``loss_parallel``)."""
    pre = f"{layers}.*."
    root = (MeshInputFullLogits(input_kwargs, head)
            if loss_parallel and head is not None
            and callable(getattr(type(model), "generate", None)) else MeshInput(input_kwargs))
    plan: Plan = {"": root, embedding: MeshParallel(),
                  pre + attention: MeshAttention(heads, kv_heads, update=update)}
    for n in norms:
        plan[pre + n] = MeshParallel()
    for n in into:
        plan[pre + n] = MeshParallel(hidden_mesh_dim="output")
    for n in out_of:
        plan[pre + n] = MeshParallel(hidden_mesh_dim="weight")
    if final_norm is not None:
        plan[final_norm] = MeshParallel()
    if head is not None:
        plan[head] = MeshParallel(hidden_mesh_dim="output", gather_output=not loss_parallel)
    elif loss_parallel:
        raise ValueError("tpx.plans.auto: loss_parallel=True needs a model with an LM head")
    return plan


def _mesh_auto(model: nn.Module, layout: str, loss_parallel: bool) -> Plan:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("llama", "mistral", "qwen2"):
        cfg = model.config
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        layers = find_module(model, "layers") or "layers"
        base = _prefix(layers, "layers")
        head = "lm_head" if find_module(model, "lm_head") == "lm_head" else None
        if getattr(cfg, "tie_word_embeddings", False) and head is not None:
            raise NotImplementedError(
                f"tpx.plans.auto(layout={layout!r}): tied input and output embeddings are not "
                "supported beyond 1-D (the embedding table is split by columns, the LM head "
                "by blocks); untie them (tie_word_embeddings=False) or use layout='1d'")
        return _mesh_plan(
            model, heads=heads, kv_heads=kv, embedding=base + "embed_tokens", layers=layers,
            attention="self_attn", norms=["input_layernorm", "post_attention_layernorm"],
            into=["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "mlp.gate_proj", "mlp.up_proj"],
            out_of=["self_attn.o_proj", "mlp.down_proj"], head=head,
            final_norm=base + "norm",
            update=_set_attrs(num_heads=lambda h, k, m: h,
                              num_key_value_heads=lambda h, k, m: k),
            loss_parallel=loss_parallel,
            input_kwargs=("input_ids", "inputs_embeds") + ATTENTION_INPUTS)
    if model_type is not None:
        raise ValueError(f"tpx.plans.auto: no plan for Hugging Face model_type={model_type!r} "
                         f"with layout={layout!r}; beyond 1-D: llama, mistral, qwen2 and the "
                         "plain decoder (torchtitan's names). Write the plan by hand with "
                         "tpx.parallel.mesh_styles")
    attn_name = find_module(model, "attention")
    if attn_name is None or not hasattr(model.get_submodule(attn_name), "wq"):
        raise ValueError(f"tpx.plans.auto(layout={layout!r}): no `layers.*.attention` with "
                         "wq/wk/wv/wo found (torchtitan's names); write the plan by hand with "
                         "tpx.parallel.mesh_styles")
    attn = model.get_submodule(attn_name)
    head_dim = getattr(attn, "head_dim", None)
    heads = getattr(attn, "n_heads", None) or (attn.wq.out_features // head_dim
                                               if head_dim else None)
    kv = getattr(attn, "n_kv_heads", None) or (attn.wk.out_features // head_dim
                                               if head_dim else None)
    if not heads or not kv:
        raise ValueError("tpx.plans.auto: cannot read the head counts of "
                         f"{type(attn).__name__}; give it `n_heads` and `head_dim` attributes "
                         "or write the plan by hand")
    return _mesh_plan(
        model, heads=heads, kv_heads=kv, embedding="tok_embeddings", layers="layers",
        attention="attention", norms=["attention_norm", "ffn_norm"],
        into=["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
              "feed_forward.w3"],
        out_of=["attention.wo", "feed_forward.w2"],
        head="output" if find_module(model, "output") == "output" else None,
        final_norm="norm" if find_module(model, "norm") == "norm" else None,
        update=_set_attrs(n_heads=lambda h, k, m: h, n_kv_heads=lambda h, k, m: k),
        loss_parallel=loss_parallel, input_kwargs=())


def _peft_base_model(model: nn.Module) -> Optional[nn.Module]:
    """The model a peft model (``PeftModel``, a tuner model) wraps; ``None`` for any other."""
    if not any(c.__module__.split(".")[0] == "peft" for c in type(model).__mro__):
        return None
    get = getattr(model, "get_base_model", None) or getattr(getattr(model, "model", None),
                                                              "get_base_model", None)
    inner = get() if callable(get) else getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) and inner is not model else None


def auto(model: nn.Module, *, layout: str = "1d", sequence_parallel: bool = False,
         loss_parallel: bool = False, experts: str = "tp", derive: bool = False) -> Plan:
    """The TP plan for ``model``: a Hugging Face model from its own ``base_model_tp_plan``
    (:func:`tpx.parallel.hf_plan.translate`) or, for GPT-2, by hand; a plain decoder in
    torchtitan's or gpt-fast's names by hand; any other model (a Hugging Face model without a
    plan, a module in names tpx has never seen), or any model with ``derive=True``, by a plan
    derived from its computation (:func:`tpx.parallel.derive.derive`: a
    :class:`~tpx.parallel.derive.DerivedPlan`, which ``tpx.parallelize_module`` proves on a
    copy of the model against the unsharded one before it changes anything, raising
    ``ValueError`` naming the first module that differs). A Hugging Face plan that leaves
    attention, gated MLPs or experts whole is completed (:mod:`tpx.parallel.completed`), and a
    model without a plan on the meta device gets its plan from its twins
    (:mod:`tpx.parallel.derive_twin`); both are proved before use. Heads that do not divide
    the TP size are split in whole heads as evenly as they go in Hugging Face's plans and
    GPT-2's (:func:`tpx.comm.groups.head_split`); elsewhere they raise a ``ValueError``
    naming the numbers.

    ``layout``: ``"1d"`` (the default: Megatron-style column/row parallelism over a TP group)
    or ``"2d"``, ``"2.5d"``, ``"3d"`` (apply the plan with a mesh from
    ``tpx.init_mesh(layout)``; Llama / Mistral / Qwen2 and the plain torchtitan-style
    decoder): every Linear, norm and the embedding become the layout's layers, the model's
    inputs are split at its entry and the LM head returns the full logits, so ``model(ids)``
    is called as before. With ``loss_parallel=True`` the logits stay in the layout's blocks:
    compute the loss inside ``with tpx.loss_parallel(mesh):``. Sequence parallelism is a 1-D
    notion (multi-dimensional layouts already split the activations).

    ``experts`` (mixture-of-experts models, whose Hugging Face plan marks the experts
    ``moe_tp_experts``): ``"tp"`` (expert TP: every rank a slice of every expert) or ``"ep"``
    (expert parallelism: every rank whole experts); docs/experts.md.

    A pipeline stage (any contiguous run of the decoder layers, with or without the
    embedding, the final norm and the LM head) gets the plan of the pieces it holds. It may be
    the model itself with what the stage does not own set to ``None`` and the other stages'
    layers removed (torchtitan's cut), or replaced by an ``nn.Identity`` (transformers'
    ``apply_pipeline_parallelism`` and its ``PipelineIdentityLayer``); or a module of the
    user's holding a Hugging Face model's pieces under their names (``embed_tokens``,
    ``layers``, ``norm``, ``lm_head``) and its ``config``. Its input and output hidden states
    are whole (``Replicate()``) on the TP group, with ``sequence_parallel=True`` too (its
    first layer splits the sequence, and where it holds no final norm its last layer gathers
    it back), so the activations the stages exchange have the unsharded stage's shapes. A
    stage without the LM head ignores ``loss_parallel=True``; the one holding it returns its
    logits vocab-sharded. (The plain decoder's stages split the sequence in equal blocks:
    its length must divide by the TP size.)

    The result is a :class:`tpx.plans.ModelPlan` (a ``dict``): applied, every
    parameter it does not split becomes a ``Replicate()`` ``DTensor``, in every block."""
    plan = _auto(model, layout=layout, sequence_parallel=sequence_parallel,
                 loss_parallel=loss_parallel, experts=experts, derive=derive)
    return plan if isinstance(plan, ModelPlan) else ModelPlan(plan)


def _derived(model: nn.Module, loss_parallel: bool) -> Plan:
    """A plan derived from ``model``'s computation; on the meta device (no values to run)
    derived on its twins and carried over (:mod:`tpx.parallel.derive_twin`)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        from .derive_twin import derive_on_twins

        return derive_on_twins(model, loss_parallel=loss_parallel)
    return derived.derive(model, loss_parallel=loss_parallel)


def _auto(model: nn.Module, *, layout: str = "1d", sequence_parallel: bool = False,
          loss_parallel: bool = False, experts: str = "tp", derive: bool = False) -> Plan:
    """:func:`auto` before its result is made a :class:`ModelPlan`."""
    if layout not in ("1d", "2d", "2.5d", "3d"):
        raise ValueError(f"tpx.plans.auto: `layout` must be '1d', '2d', '2.5d' or '3d'; got "
                         f"{layout!r}")
    inner = _peft_base_model(model)
    if inner is not None:
        # A peft model (LoRA): the plan of the model it wraps, under its name there; the
        # column and row styles shard peft's layers with the projections they wrap.
        if layout != "1d":
            raise ValueError(f"tpx.plans.auto: LoRA (a peft model) is sharded with layout='1d' "
                             f"only; got layout={layout!r}")
        prefix = next(n for n, m in model.named_modules() if m is inner)
        plan = auto(inner, layout=layout, sequence_parallel=sequence_parallel,
                    loss_parallel=loss_parallel, experts=experts, derive=derive)
        return _prefixed(plan, prefix)
    if layout != "1d":
        if sequence_parallel:
            raise ValueError(f"tpx.plans.auto: sequence_parallel=True is for layout='1d'; the "
                             f"{layout!r} layout already splits every activation")
        return _mesh_auto(model, layout, loss_parallel)
    if derive:
        return derived.derive(model, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None:
        if model_type in _HF_FAMILIES:
            return _HF_FAMILIES[model_type](model, sequence_parallel=sequence_parallel,
                                            loss_parallel=loss_parallel)
        if hf_plan.has_plan(model):
            try:
                return completed.translate(model, sequence_parallel=sequence_parallel,
                                           loss_parallel=loss_parallel, experts=experts)
            except ValueError as e:
                if sequence_parallel or experts != "tp":
                    raise
                # The shipped plan cannot be applied as written (it splits what must stay
                # whole): a derived plan, proved when applied, in its place.
                import warnings

                warnings.warn(f"tpx.plans.auto: the model's own TP plan cannot be applied "
                              f"({e}); using a plan derived from its computation instead, "
                              "proved against the unsharded model when it is applied",
                              UserWarning, stacklevel=2)
                return _derived(model, loss_parallel)
        # No plan shipped: derived from the model's computation, proved when applied; on the
        # meta device (no values to run) derived on its twins and carried over.
        if not sequence_parallel:
            return _derived(model, loss_parallel)
        return derived.derive(model, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel)
    if _torchtitan_names(model):
        return decoder(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return derived.derive(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def _torchtitan_names(model: nn.Module) -> bool:
    attn = find_module(model, "attention")
    return attn is not None and (hasattr(model.get_submodule(attn), "wq")
                                 or hasattr(model.get_submodule(attn), "wqkv"))


def _prefixed(plan: Plan, prefix: str) -> Plan:
    """``plan`` with ``prefix`` before every key (a derived plan stays one, to be proved on
    the model it was derived from: the wrapper's plan is proved on the wrapper)."""
    out = {(f"{prefix}.{k}" if k else prefix) if prefix else k: v for k, v in plan.items()}
    if isinstance(plan, derived.DerivedPlan):
        return derived.DerivedPlan(out, model_name=plan.model_name, example=plan.example,
                                   proof_plan=_prefixed(dict(plan.proof_plan), prefix),
                                   kept_whole=plan.kept_whole,
                                   members={(f"{prefix}.{k}" if k else prefix): p
                                            for k, p in plan.members.items()})
    return out


from .check import PlanReport, check  # noqa: E402  (tpx.plans.check: a plan against the unsharded model)
