"""Tiny random Hugging Face causal LMs for every architecture that ships a tensor-parallel plan.

``zoo_types()`` lists the ``AutoModelForCausalLM`` model types whose default config builds and
has a non-empty ``base_model_tp_plan``. ``tiny_config(mt)`` starts from that default config and
shrinks it with generic rules keyed on field names; ``tiny(mt)`` builds the float32 model.

Rules (a field is only touched when the default config has it):

* sizes: hidden 64, MLP 88, MoE / shared-expert MLP 40, 8 query heads of dim 8, 2 KV heads
  (GQA; MQA stays MQA), vocabulary 1003 (divisible by neither 2 nor 4), 64 positions, windows
  and chunks 8, MLA ranks kv 16 / q 24 with nope 8 + rope 4 = qk 12 and v 8; linear-attention,
  Mamba, indexer and low-rank fields shrink alike (Mamba heads times head dim = expand * hidden).
  Counts that are already small (experts per token 1, one shared expert, one group) are kept:
  most rules are ``min(default, target)``.
* experts: 4 routed experts, 2 per token, at most 1 shared expert, at most 2 expert groups.
* layers: every per-layer description (lists as long as the layer count, lists of layer indices,
  ``per_layer_config``, "the first k layers are dense", "the last k layers share KV", ...) gives
  each default layer a kind; the tiny model keeps the first layer of every kind, in order, and
  at least 2 layers, and all those descriptions are rewritten for the kept layers.
* no dropout or jitter, token ids inside the vocabulary, eager attention and experts (float64
  runs; grouped GEMM does not take it), ``tie_word_embeddings`` as in the default config.
* ``TYPES`` holds the few per-type settings no rule can guess; ``**overrides`` are applied last.

``python tests/hf_tiny.py [type ...]`` builds each model and runs forward and backward in
float32 and float64.
"""

import math
import sys
import time
import warnings

import torch
import transformers

V = 1003  # does not divide by 2 or 4

# Sizes set outright (the default is ignored).
FIXED = dict(
    vocab_size=V, vocab_size_per_layer_input=V, hidden_size=64, n_embd=64,
    intermediate_size=88, ffn_hidden_size=88, intermediate_size_mlp=88,
    dense_intermediate_size=88, num_attention_heads=8, n_head=8, swa_num_attention_heads=8,
    head_dim=8, swa_head_dim=8, max_position_embeddings=64, n_positions=64, n_ctx=64,
)
# Sizes shrunk to at most the target (None, 0 and small counts stay as they are).
AT_MOST = dict(
    unpadded_vocab_size=V, prefix_dense_intermediate_size=88, n_inner=88,
    moe_intermediate_size=40, expert_ffn_hidden_size=40, shared_expert_intermediate_size=40,
    moe_shared_expert_intermediate_size=40, shared_experts_intermediate_size=40,
    shared_intermediate_size=40, num_key_value_heads=2, swa_num_key_value_heads=2,
    kv_lora_rank=16, q_lora_rank=24, o_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, qk_head_dim=12, rotary_dim=4, original_max_position_embeddings=64,
    model_max_length=64, sliding_window=8, sliding_window_size=8, attention_chunk_size=8,
    block_size=8, keep_window_size=8, rel_extent=8, d_rel=8,
    n_routed_experts=4, num_experts=4, num_local_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, num_experts_per_token=2, moe_topk=2, moe_k=2, top_k_experts=2,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1, zero_expert_num=2,
    n_group=2, num_expert_group=2, topk_group=1,
    index_topk=8, index_head_dim=8, index_n_heads=4, index_block_size=4, index_topk_blocks=2,
    linear_head_dim=8, linear_num_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_n_heads=8, mamba_num_heads=8, mamba_d_state=8, ssm_state_size=8, mamba_chunk_size=8,
    chunk_size=8, mamba_dt_rank=8, n_groups=2, mamba_n_groups=2,
    hidden_size_per_layer_input=8, laurel_rank=8, hc_lowrank=8, loop_gate_rank=8,
    gated_norm_rank=8,
)
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")
# Lists of layer indices (the other per-layer lists have one entry per layer).
INDEX_LISTS = ("moe_layers", "mlp_only_layers", "full_attn_idxs", "local_layer_ids",
               "ple_layer_ids", "attn_layer_indices")
# "The first k layers" / "the last k layers" counts.
FIRST_K = ("first_k_dense_replace", "num_dense_layers")
LAST_K = ("num_kv_shared_layers",)

# What no rule can guess, per model type.
TYPES = {
}


def zoo_types() -> list[str]:
    """Causal-LM model types whose default config builds and carries a tensor-parallel plan."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cfg = transformers.AutoConfig.for_model(mt)
        except Exception:
            continue
        if getattr(cfg, "base_model_tp_plan", None):
            out.append(mt)
    return out


def _fields(cfg) -> dict:
    """The config's serialised fields with their live values (``to_dict`` may re-encode)."""
    return {k: getattr(cfg, k, v) for k, v in cfg.to_dict().items()}


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
        elif ("dropout" in k or "pdrop" in k or "jitter" in k) and isinstance(v, float):
            c[k] = 0.0
        elif k.endswith(("token_id", "token_index")) and _is_int(v) and v >= V:
            c[k] = v % V
        elif k.endswith("token_id") and isinstance(v, list):
            c[k] = [t % V for t in v]
    if d.get("num_key_value_heads") == d.get("num_attention_heads") and "num_key_value_heads" in c:
        c["num_key_value_heads"] = 2  # multi-head attention becomes GQA
    if "qk_rope_head_dim" in d and d.get("head_dim") == d["qk_rope_head_dim"]:
        c["head_dim"] = c["qk_rope_head_dim"]  # MLA: head_dim names the rotary part
    if "qk_head_dim" in c:
        c["qk_head_dim"] = c.get("qk_nope_head_dim", 8) + c.get("qk_rope_head_dim", 4)
    if d.get("n_group", 0) and "topk_group" in d and c.get("n_group") == 1:
        c["topk_group"] = 1
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
    for k in ("use_mamba_kernels",):
        if d.get(k):
            c[k] = False
    return c


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
        if _is_int(d.get("moe_layer_start_index")):
            lo, hi = d["moe_layer_start_index"], d.get("moe_layer_end_index") or n - 1
            kind.append(lo <= i <= hi and (i - lo) % (d.get("moe_layer_interval") or 1) == 0)
        kinds.append(tuple(kind))
    return kinds


def _layers(d: dict, c: dict, keep_at_least: int = 2) -> dict:
    """Keep the first layer of each kind (and at least ``keep_at_least``); rewrite the layout."""
    key = next((k for k in LAYER_COUNTS if _is_int(d.get(k))), None)
    if key is None:
        return {}
    n = d[key]
    kinds = _kinds(d, n)
    keep = sorted({kinds.index(k) for k in kinds})
    for i in range(n):
        if len(keep) >= keep_at_least:
            break
        if i not in keep:
            keep = sorted(keep + [i])
    m = len(keep)
    out = {key: m}
    for k, v in d.items():
        if isinstance(v, list) and len(v) == n and k not in INDEX_LISTS:
            new = [v[i] for i in keep]
            if k in FIXED:
                new = [FIXED[k]] * m
            elif k == "num_attention_heads_per_layer":
                new = [max(1, 8 * h // d["num_attention_heads"]) for h in new]
            out[k] = new
    for k in INDEX_LISTS:
        if isinstance(d.get(k), list):
            out[k] = [j for j, i in enumerate(keep) if i in d[k]]
    for k in FIRST_K:
        if _is_int(d.get(k)):
            out[k] = sum(i < d[k] for i in keep)
    for k in LAST_K:
        if _is_int(d.get(k)):
            out[k] = sum(i >= n - d[k] for i in keep)
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


def _tiny_fields(cfg) -> dict:
    """The changes that make ``cfg`` tiny (sub-configs included)."""
    d = _fields(cfg)
    c = _sizes(d)
    c.update(_layers(d, c))
    for k, v in d.items():
        if isinstance(v, transformers.PretrainedConfig):
            sub = _tiny_fields(v)
            c[k] = {**v.to_dict(), **sub}
    c.update(TYPES.get(d.get("model_type"), {}))
    return c


def tiny_config(mt: str, **overrides):
    """A tiny config of model type ``mt`` (see the module docstring for the rules)."""
    cfg = transformers.AutoConfig.for_model(mt)
    c = _tiny_fields(cfg)
    c.update(overrides)
    cfg = transformers.AutoConfig.for_model(mt, **c)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def tiny(mt: str, **overrides):
    """A tiny randomly initialised float32 causal LM of model type ``mt``."""
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(mt, **overrides))
    return model.float()


def check(mt: str) -> tuple[int, float]:
    """Build ``mt`` and run forward and backward in float32 and float64."""
    t = time.perf_counter()
    torch.manual_seed(0)
    model = tiny(mt)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, V, (2, 16))
    for dtype in (torch.float32, torch.float64):
        model.to(dtype).train()
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        if not torch.isfinite(out.logits).all():
            raise RuntimeError(f"non-finite logits in {dtype}")
        out.loss.backward()
    return params, time.perf_counter() - t


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    types = sys.argv[1:] or zoo_types()
    ok, start = 0, time.perf_counter()
    for mt in types:
        t = time.perf_counter()
        try:
            params, secs = check(mt)
            ok += 1
            print(f"{mt:24s} {params:9,d} {secs:6.2f}s OK", flush=True)
        except Exception as e:
            msg = (str(e).strip().splitlines() or [""])[0][:150]
            print(f"{mt:24s} {'':9s} {time.perf_counter() - t:6.2f}s {type(e).__name__}: {msg}",
                  flush=True)
    print(f"{ok}/{len(types)} OK, {len(types) - ok} failed, "
          f"{time.perf_counter() - start:.1f}s")
