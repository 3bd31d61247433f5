"""Twins: a model's class built at a small size that keeps the structure a plan reads.

A plan tpx completes or derives is proved before it is used, by running the sharded model
beside the unsharded one. A model on the meta device (as ``tpx.from_pretrained`` builds it)
has no values to run, and a model at its released size costs too much to copy; its twin is
the same class built from a config shrunk by the rules below, with the counts a plan depends
on kept (query and KV heads, experts), so that the same plan rules give the same entries on
the twin and the proof there speaks for the model.

Rules (a field is only touched when the config has it; only changed fields are set, so that
whatever the config class derives is derived again):

* sizes (``FIXED``, or ``AT_MOST`` where ``None``, 0 and already small counts are kept):
  hidden 64, MLP 88, MoE / shared-expert MLP 40, vocabulary 1003, 64 positions, sliding
  windows, chunks and blocks 8; linear-attention, Mamba, indexer and low-rank fields shrink
  alike, with Mamba heads * head dim = expand * hidden.
* attention: 8 query heads of dim 8; multi-head attention becomes GQA with 2 KV heads, MLA's
  latent is expanded to every query head (:func:`twin_config` keeps the model's own counts
  instead, with heads of dim 8).
* experts: 4 routed experts, 2 per token, at most 1 shared expert, at most 2 groups
  (:func:`twin_config` keeps the routed count).
* layers: every per-layer description (lists as long as the layer count, lists of layer
  indices, ``per_layer_config``, "the first k layers are dense", "the last k layers share
  KV", period and offset, MoE start / end / interval) gives each layer a kind; the twin keeps
  the first layer of each kind, in order, and at least 2 layers, and every description is
  rewritten for the kept layers.
* no dropout or jitter noise, no KV cache, out-of-vocabulary special ids wrapped into the
  vocabulary, eager attention and experts; sub-configs are shrunk the same way.
* values: the class's own initialisation from a fixed seed, except weight matrices it
  leaves all zero (xLSTM's gates), drawn at random (:func:`build`).
* ``TYPES`` holds the few per-type settings no rule can guess.
"""

from __future__ import annotations


from typing import List, Optional

import torch
from torch import nn

__all__ = ["twin_config", "twin", "build", "layer_map", "shrunk_fields"]

V = 1003  # does not divide by 2 or 4

# Sizes set outright (ints, and lists of them).
FIXED = dict(
    vocab_size=V, vocab_size_per_layer_input=V, hidden_size=64, n_embd=64,
    intermediate_size=88, ffn_hidden_size=88, intermediate_size_mlp=88,
    dense_intermediate_size=88, num_attention_heads=8, n_head=8, swa_num_attention_heads=8,
    head_dim=8, swa_head_dim=8, max_position_embeddings=64, n_positions=64, n_ctx=64,
    # a vision tower's output, a quantizer's codes: the text model's width
    out_hidden_size=64, text_hidden_size=64, audio_hidden_size=64, codebook_dim=64,
    # BLT's local models read the global transformer's width; RecurrentGemma's RG-LRU width
    hidden_size_global=64, lru_width=64,
)
# Sizes shrunk to at most the target (None, 0 and smaller values stay as they are).
AT_MOST = dict(
    # MLPs, vocabulary, positions
    n_inner=88, prefix_dense_intermediate_size=88, moe_intermediate_size=40,
    expert_ffn_hidden_size=40, shared_expert_intermediate_size=40,
    moe_shared_expert_intermediate_size=40, shared_experts_intermediate_size=40,
    shared_intermediate_size=40, block_multiple_of=8, unpadded_vocab_size=V,
    encoder_hash_byte_group_vocab=V,
    original_max_position_embeddings=64, model_max_length=64,
    # attention: KV heads, MLA, rotary, windows, chunks, scales that start at a position
    num_key_value_heads=2, swa_num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24,
    o_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, qk_head_dim=12,
    rotary_dim=4, query_pre_attn_scalar=8, sliding_window=8, sliding_window_size=8,
    attention_chunk_size=8, block_size=8, keep_window_size=8, rel_extent=8, d_rel=8,
    log_scaling_n_floor=8, floor_scale=8, n_layers_per_attn_res_block=2,
    # sparse-attention indexers
    index_topk=8, index_head_dim=8, index_n_heads=4, index_block_size=4, index_topk_blocks=2,
    # experts
    n_routed_experts=4, num_experts=4, num_local_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, top_k_experts=2,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1, zero_expert_num=2,
    n_group=2, num_expert_group=2, topk_group=1,
    # linear attention and Mamba
    linear_head_dim=8, linear_num_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_n_heads=8, mamba_num_heads=8, mamba_d_state=8, ssm_state_size=8, mamba_chunk_size=8,
    chunk_size=8, mamba_dt_rank=8, n_groups=2, mamba_n_groups=2,
    # low-rank and per-layer-input widths
    hidden_size_per_layer_input=8, laurel_rank=8, hc_lowrank=8, loop_gate_rank=8,
    gated_norm_rank=8,
)
# Out-of-vocabulary special tokens go to the ids that the random inputs (3..V-1) never use.
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Lists of layer indices (the other per-layer lists have one entry per layer).
INDEX_LISTS = ("moe_layers", "mlp_only_layers", "full_attn_idxs", "local_layer_ids",
               "attn_layer_indices")
# "The first k layers" / "the last k layers" counts.
FIRST_K = ("first_k_dense_replace", "num_dense_layers")
LAST_K = ("num_kv_shared_layers",)

# What no rule can guess, per model type (nested configs are looked up by their own type).
TYPES = {
    # no attention (or conv) layer in the default layout: the second layer gets one
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    # experts unset or single by default; make the first layer dense where the plan covers both
    "deepseek_v2": dict(num_experts_per_tok=2, first_k_dense_replace=1),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "llama4_text": dict(moe_layers=[1]),
    # MoE switched off by default (doge: one switch for all layers; gemma4: a block beside the MLP)
    "doge": dict(is_moe=True),
    "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=40),
    # its layers cycle through block_types (recurrent, recurrent, attention): one cycle
    "recurrent_gemma": dict(num_hidden_layers=3),
    # one input, one recurrent (looped) and one output layer
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # two layers before the loop, two looped layers run twice (loop bounds are whole blocks)
    "inkling2_loop_text": dict(num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid"] * 2,
                               loop_layer_index_start=2, loop_layer_index_end=4,
                               loop_num_passes=2),
    # compression by 2 and 4 (not 4 and 128): 16 tokens make several compressed entries
    "deepseek_v4": dict(compress_rates={"compressed_sparse_attention": 2,
                                        "heavily_compressed_attention": 4},
                        o_groups=2, index_topk=4),
    # the indexer of the indexed attention is unset by default; one n-gram embedding layer
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=8,
                           indexer_budget=8, indexer_compress_ratio=2, ple_layer_ids=[1],
                           heads_per_ngram=2, ngram_vocab_size_base=100,
                           make_ngram_vocab_size_divisible_by=4, eos_token_id=2),
    # no RoPE parameters by default: sliding layers with RoPE, full layers without
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": None}),
    # the audio encoder of phi4_multimodal is built with its causal LM
    "phi4_multimodal_audio": dict(num_blocks=1, ext_pw_out_channel=64, nemo_conv_channels=64,
                                  depthwise_separable_out_channel=64),
}


def _config_class():
    """transformers' config base class (imported when a twin is built, not with tpx)."""
    from transformers import PretrainedConfig

    return PretrainedConfig


def _fields(cfg) -> dict:
    """The config's serialised fields with their live values (``to_dict`` may re-encode)."""
    out = {}
    for k, v in cfg.to_dict().items():
        try:
            live = getattr(cfg, k, v)
        except Exception:  # a per-layer attribute that may differ between layers
            live = v
        plain = (int, float, str, list, tuple, dict, type(None), _config_class())
        out[k] = live if isinstance(live, plain) else v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _sizes(d: dict) -> dict:
    """The size, expert, dropout and token-id rules (everything but the layer layout)."""
    c = {}
    for k, v in d.items():
        if k in FIXED and (_is_int(v) or isinstance(v, list)):
            c[k] = [FIXED[k]] * len(v) if isinstance(v, list) else FIXED[k]
        elif k in AT_MOST and _is_int(v) and v > 0:
            c[k] = min(v, AT_MOST[k])
        elif ("dropout" in k or "pdrop" in k or "jitter" in k or "drop_path" in k) and isinstance(
                v, float):
            c[k] = 0.0
        elif k.endswith(("token_id", "token_index")) and _is_int(v) and v >= V:
            c[k] = SPECIAL.get(k, v % V)
        elif k.endswith("token_id") and isinstance(v, list):
            c[k] = [t if t < V else SPECIAL.get(k, t % V) for t in v]
    if "kv_lora_rank" in d and "num_key_value_heads" in d:
        c["num_key_value_heads"] = 8  # MLA: one latent, expanded to every query head
    elif d.get("num_key_value_heads", 0) in (None, d.get("num_attention_heads")):
        c["num_key_value_heads"] = 2  # multi-head attention becomes GQA
    kv, swa = d.get("num_key_value_heads"), d.get("swa_num_key_value_heads")
    if _is_int(kv) and _is_int(swa) and kv != swa and "kv_lora_rank" not in d:
        # sliding and full layers of other KV counts (Inkling: 16 and 8) stay two kinds
        c["num_key_value_heads"], c["swa_num_key_value_heads"] = (1, 2) if kv < swa else (2, 1)
    for k in ("head_dim", "n_inner"):  # None: derived from the hidden size
        if k in d and d[k] is None:
            c[k] = FIXED.get(k, AT_MOST.get(k))
    if _is_int(d.get("qk_rope_head_dim")) and _is_int(d.get("head_dim")):
        # rotary part sized apart (MLA): head_dim keeps its ratio to it (often it *is* it)
        c["head_dim"] = max(1, c["qk_rope_head_dim"] * d["head_dim"] // d["qk_rope_head_dim"])
    if "qk_head_dim" in c:
        c["qk_head_dim"] = c.get("qk_nope_head_dim", 8) + c.get("qk_rope_head_dim", 4)
    # linear attention: 4 key heads, value heads in the default ratio
    if _is_int(d.get("linear_num_key_heads")):
        c["linear_num_key_heads"] = 4
        c["linear_num_value_heads"] = 4 * d["linear_num_value_heads"] // d["linear_num_key_heads"]
    # Mamba: heads * head dim = expand * hidden (or the explicit SSM width)
    heads = c.get("mamba_n_heads", c.get("mamba_num_heads"))
    if heads:
        expand = d.get("mamba_expand", d.get("expand", 2))
        dim = 8 if "mamba_d_ssm" in d else expand * 64 // heads
        for k in ("mamba_d_head", "mamba_head_dim"):
            if k in d:
                c[k] = dim
        if "mamba_d_ssm" in d:
            c["mamba_d_ssm"] = heads * dim
    _mamba2_width(d, c)
    if "original_max_position_embeddings" in repr(d.get("rope_parameters")):
        c["rope_parameters"] = _rope(d["rope_parameters"])
    if d.get("use_cache"):
        c["use_cache"] = False  # training only: no KV / state caches
    patch, size = d.get("patch_size"), d.get("image_size")
    if isinstance(patch, (list, tuple)) and patch and _is_int(patch[0]):
        patch = patch[0]
    if _is_int(patch) and _is_int(size) and size > 8 * patch:
        c["image_size"] = 8 * patch  # a vision tower sees 8 x 8 patches
    elif (_is_int(patch) and isinstance(size, (list, tuple)) and size
          and all(_is_int(x) for x in size) and max(size) > 8 * patch):
        c["image_size"] = type(size)(8 * patch for _ in size)
    return c


def _mamba2_width(d, c) -> None:
    """Mamba-2's own config (``num_heads * head_dim = expand * hidden_size``): the hidden size
    that fits the shrunk heads."""
    if "hidden_size" in d and all(_is_int(d.get(k)) for k in ("expand", "num_heads",
                                                               "head_dim", "n_groups")):
        c["hidden_size"] = (c.get("num_heads", d["num_heads"]) * c.get("head_dim", d["head_dim"])
                            // d["expand"])


def _rope(p):
    """RoPE parameters whose scaled context (``original_max_position_embeddings * factor``)
    fits the 64 positions."""
    if not isinstance(p, dict):
        return p
    p = {k: _rope(v) for k, v in p.items()}
    if _is_int(p.get("original_max_position_embeddings")):
        p["original_max_position_embeddings"] = max(1, int(64 // (p.get("factor") or 1)))
    if _is_int(p.get("max_position_embeddings")):
        p["max_position_embeddings"] = 64
    return p


def _periods(d: dict) -> list:
    """``(x_period, x_offset)`` pairs: layer ``i`` is an x layer when ``i % period == offset``."""
    return [(k, k[:-6] + "offset") for k, v in d.items()
            if k.endswith("_period") and _is_int(v) and _is_int(d.get(k[:-6] + "offset"))]


def _kinds(d: dict, n: int) -> list:
    """One hashable description per default layer, from every per-layer field of ``d``."""
    per = [k for k, v in d.items() if isinstance(v, list) and len(v) == n and k not in INDEX_LISTS]
    idx = [k for k in INDEX_LISTS if isinstance(d.get(k), list)]
    plc = d.get("per_layer_config") if isinstance(d.get("per_layer_config"), dict) else {}
    plc = {int(k): repr(v) for k, v in plc.items()}
    kinds = []
    for i in range(n):
        kind = [repr(d[k][i]) for k in per] + [i in d[k] for k in idx] + [plc.get(i)]
        kind += [_is_int(d.get(k)) and i < d[k] for k in FIRST_K]
        kind += [_is_int(d.get(k)) and i >= n - d[k] for k in LAST_K]
        kind += [i % d[p] == d[o] for p, o in _periods(d)]
        if _is_int(d.get("moe_layer_start_index")):
            lo, hi = d["moe_layer_start_index"], d.get("moe_layer_end_index") or n - 1
            kind.append(lo <= i <= hi and (i - lo) % (d.get("moe_layer_interval") or 1) == 0)
        kinds.append(tuple(kind))
    return kinds


def _kept(d: dict, keep_at_least: int = 2):
    """``(key, n, kinds, keep)``: the layer count's field, the count, each layer's kind and
    the layers the twin keeps (the first of each kind, and at least ``keep_at_least``);
    ``None`` for a config without a layer count."""
    key = next((k for k in LAYER_COUNTS if _is_int(d.get(k))), None)
    if key is None:
        return None
    n = d[key]
    kinds = _kinds(d, n)
    keep = sorted({kinds.index(k) for k in kinds})
    for i in range(n):
        if len(keep) >= keep_at_least:
            break
        if i not in keep:
            keep = sorted(keep + [i])
    return key, n, kinds, keep


def layer_map(config) -> Optional[List[int]]:
    """For each layer of a model of ``config``, the index of its twin's layer of the same kind
    (the twin keeps the first layer of each kind, in order); ``None`` where the twin's layers
    are set by type (:data:`TYPES`) or the config has no layer count."""
    d = _fields(config)
    if set(TYPES.get(d.get("model_type"), {})) & set(LAYER_COUNTS + ("layer_types",)):
        return None
    kept = _kept(d)
    if kept is None:
        return None
    _, n, kinds, keep = kept
    return [keep.index(kinds.index(kinds[i])) for i in range(n)]


def _layers(d: dict, c: dict, keep_at_least: int = 2) -> dict:
    """Keep the first layer of each kind (and at least ``keep_at_least``); rewrite the layout."""
    kept = _kept(d, keep_at_least)
    if kept is None:
        return {}
    key, n, kinds, keep = kept
    m = len(keep)
    out = {key: m}
    for k, v in d.items():
        if isinstance(v, list) and len(v) == n and k not in INDEX_LISTS:
            new = [v[i] for i in keep]
            if k in FIXED:
                new = [FIXED[k]] * m
            elif k == "num_attention_heads_per_layer":
                new = [max(1, 8 * h // d["num_attention_heads"]) for h in new]
            elif k == "mlp_layer_types" and set(new) == {"sparse"}:
                new[0] = "dense"  # MoE everywhere by default: the dense MLP is covered too
            out[k] = new
    for k in INDEX_LISTS:
        if isinstance(d.get(k), list):
            out[k] = [j for j, i in enumerate(keep) if i in d[k]]
    if d.get("mlp_only_layers") == []:
        out["mlp_only_layers"] = [0]  # MoE everywhere by default: the dense MLP is covered too
    for k in FIRST_K:
        if _is_int(d.get(k)):
            out[k] = sum(i < d[k] for i in keep)
    for k in LAST_K:
        if _is_int(d.get(k)):
            out[k] = sum(i >= n - d[k] for i in keep)
    for p, o in _periods(d):  # the smallest period and offset that give the kept layers
        hits = [j for j, i in enumerate(keep) if i % d[p] == d[o]]
        fits = [(q, r) for q in range(1, m + 1) for r in range(q)
                if [j for j in range(m) if j % q == r] == hits]
        out[p], out[o] = fits[0] if fits else (d[p], d[o])
    if _is_int(d.get("moe_layer_start_index")):
        moe = [j for j, kind in enumerate(kinds[i] for i in keep) if kind[-1]]
        out.update(moe_layer_start_index=moe[0], moe_layer_end_index=moe[-1],
                   moe_layer_interval=1)
    if isinstance(d.get("per_layer_config"), dict):
        width = max(len(k) for k in d["per_layer_config"]) if d["per_layer_config"] else 2
        out["per_layer_config"] = {
            f"{j:0{width}d}": _scaled(d["per_layer_config"][f"{i:0{width}d}"], d, c)
            for j, i in enumerate(keep) if f"{i:0{width}d}" in d["per_layer_config"]}
    return out


def _scaled(layer: dict, d: dict, c: dict) -> dict:
    """A per-layer override, scaled like the field it overrides (64 heads of 128 -> 4 of 8)."""
    return {k: max(1, round(c[k] * v / d[k])) if k in c and _is_int(v) and d.get(k) else v
            for k, v in layer.items()}


# Widths under the names of families that ship no TP plan (BART and its kin, MPT, XLM,
# XLNet), shrunk only there so that the planned families' tiny configs stay as they were.
NO_PLAN_AT_MOST = dict(d_model=96, encoder_ffn_dim=88, decoder_ffn_dim=88, ffn_dim=88,
                       emb_dim=96, d_inner=88, max_seq_len=64)
# A vision or audio tower's width and depth under names of its own (Qwen2-VL's).
NESTED_AT_MOST = dict(embed_dim=64, depth=2)
# Head counts of a width shrunk above (and a vision or audio tower's ``num_heads``): made to
# divide it.
WIDTH_HEADS = ("encoder_attention_heads", "decoder_attention_heads")
# Text models whose rotary embedding is cut into (time, height, width) sections that default
# to a full-size head: the sections are redrawn for the tiny head.
MROPE = ("glm4v_text", "glm4v_moe_text", "glm_ocr_text", "qwen2_vl_text", "qwen2_5_vl_text",
         "paddleocr_vl_text", "qwen2_5_omni_text", "hunyuan_vl_text", "unlimited_ocr_text",
         "ernie4_5_vl_moe_text")


def _mrope(d: dict, c: dict) -> dict:
    """``rope_parameters`` with ``mrope_section`` summing to half the tiny head's rotary part
    (``qk_rope_head_dim``, else head dim 8 times ``partial_rotary_factor``)."""
    rope = dict(d.get("rope_parameters") or {})
    half = (c["qk_rope_head_dim"] if _is_int(c.get("qk_rope_head_dim")) else int(
        8 * rope.get("partial_rotary_factor", d.get("partial_rotary_factor") or 1))) // 2
    rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    return rope


def shrunk_fields(cfg, nested: bool = False) -> dict:
    """The changes that make ``cfg`` tiny (sub-configs included; ``nested``: ``cfg`` is one,
    e.g. a vision or audio tower)."""
    d = _fields(cfg)
    c = _sizes(d)
    if not getattr(cfg, "base_model_tp_plan", None):
        for k, v in NO_PLAN_AT_MOST.items():
            if _is_int(d.get(k)) and d[k] > v:
                c[k] = v
        if nested:
            for k, v in NESTED_AT_MOST.items():
                if _is_int(d.get(k)) and d[k] > v:
                    c[k] = v
        width = c.get("d_model", c.get("embed_dim", c.get("hidden_size")) if nested else None)
        for k in WIDTH_HEADS + (("num_heads",) if nested else ()):
            if width and _is_int(d.get(k)) and width % d[k]:
                c[k] = max(h for h in range(1, d[k] + 1) if width % h == 0)
    if d.get("model_type") in MROPE or (
            nested and "mrope_section" in (d.get("rope_parameters") or {})):
        c["rope_parameters"] = _mrope(d, c)
    c.update(_layers(d, c))
    for k, v in d.items():
        if isinstance(v, _config_class()):
            sub = shrunk_fields(v, nested=True)
            c[k] = {**v.to_dict(), **sub}
    c.update(TYPES.get(d.get("model_type"), {}))
    return c


# Counts a plan depends on, kept from the model's config: heads divide (or not) the TP size,
# KV heads are split or replicated, experts are dealt out whole under expert parallelism.
KEPT = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads", "num_kv_heads",
        "n_heads", "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TWIN_HEAD_DIM = 8


def twin_config(config):
    """The twin's config: ``config`` (a Hugging Face config, the model's own) shrunk by the
    rules above, with the counts in :data:`KEPT` as the model has them (heads of dim 8)."""
    d = _fields(config)
    c = shrunk_fields(config)
    for k in KEPT:
        if _is_int(d.get(k)) and d[k] > 0:
            c[k] = d[k]
    hkey = next((k for k in ("num_attention_heads", "n_head", "n_heads", "num_heads")
                 if _is_int(c.get(k))), None)
    wkey = next((k for k in ("hidden_size", "n_embd", "d_model") if _is_int(d.get(k))), None)
    heads = c.get(hkey) if hkey else None
    width = c.get(wkey, d.get(wkey)) if wkey else None
    mamba = any("mamba" in k or "ssm" in k for k in d)  # its widths are tied to the hidden size
    if (_is_int(heads) and _is_int(width) and d.get("head_dim") is None and not mamba
            and (width % heads or width // heads < 2)):
        c[wkey] = heads * TWIN_HEAD_DIM  # head_dim derived from the width
    _mamba2_width(d, c)  # with the model's heads kept
    if _is_int(heads) and _is_int(d.get("lru_width")):
        c["lru_width"] = heads * TWIN_HEAD_DIM  # RecurrentGemma: block-diagonal per head
    # The model's own settings where they differ from its class's defaults, then the twin's
    # sizes: only changed fields are set, so that what the class derives is derived again.
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a class whose defaults do not build: all fields
        defaults = {}
    own = {k: v for k, v in config.to_dict().items()
           if k not in defaults or defaults[k] != v}
    for k in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        own.pop(k, None)
    cfg = type(config)(**{**own, **c})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def twin(model: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The twin of the Hugging Face ``model``: its class built from :func:`twin_config` on
    the CPU, in ``dtype``, its values drawn from a fixed seed (the same on every rank)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not isinstance(cfg, _config_class()):
        raise ValueError(f"tpx: {type(model).__name__} has no Hugging Face config to build a "
                         "twin from; build the model with its weights and shard it then")
    return build(type(model), twin_config(cfg), dtype)


def build(cls, cfg, dtype: torch.dtype = torch.float64) -> nn.Module:
    """``cls(cfg)`` on the CPU in ``dtype``, in eval mode, its values drawn from a fixed seed
    (the same on every rank) by the class's own initialisation, with :func:`_unzeroed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("cpu"):
            out = cls(cfg)
        _unzeroed(out)
    return out.to(dtype).eval()


def _unzeroed(model: nn.Module) -> None:
    """Weight matrices the class initialises to zero (xLSTM's gates) drawn at random: a zero
    matrix cuts what reads it from the trace and from the proof (a released model has none)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point() and not p.any():
                p.normal_(0.0, p.shape[-1] ** -0.5)

