"""Mixture-of-experts models under expert TP and expert parallelism, against one device:
Hugging Face's fused 3-D experts (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert,
DeepSeek-V3) with ``tpx.ExpertsTensorParallel`` and ``tpx.ExpertsParallel``, and a user's ``ModuleList`` of expert MLPs with the stock
styles. Tiny random configs, nothing downloaded. Every step compares the logits, the loss, the
router's auxiliary loss and every gradient; after the optimizer steps every parameter and the full
state dict."""

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_cases, run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

transformers = pytest.importorskip("transformers")

V = 211  # divides by neither 2 nor 4


def tiny(family: str, impl: str = "grouped_mm", inter: int = 48):
    """A tiny random MoE causal LM of ``family``; ``inter`` is each expert's intermediate size
    (48 splits into 16-byte aligned slices at TP 2, 3 and 4, as the grouped GEMM needs)."""
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  output_router_logits=True, router_aux_loss_coef=0.1)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=4,
                                            num_experts_per_tok=2, **common)
    elif family == "qwen3_moe":
        # layer 0 a dense MLP, layer 1 the experts
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=inter,
                                             mlp_only_layers=[0],
                                             num_experts=4, num_experts_per_tok=2,
                                             head_dim=8, norm_topk_prob=True, **common)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=inter,
                                             shared_expert_intermediate_size=40, num_experts=4,
                                             num_experts_per_tok=2, **common)
    elif family == "deepseek_v3":
        common.pop("output_router_logits"), common.pop("router_aux_loss_coef")
        config = transformers.DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=inter, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, **dict(common, num_key_value_heads=4))
    elif family == "gpt_oss":  # transposed, interleaved [g0 u0 g1 u1 ...], biases
        config = transformers.GptOssConfig(intermediate_size=inter, num_local_experts=4,
                                           num_experts_per_tok=2, head_dim=8, sliding_window=8,
                                           **common)
    elif family in ("glm4_moe", "llama4_text", "olmoe"):
        # a dense layer, then a sparse one whose shared expert Hugging Face's plan splits
        # (GLM-4-MoE's mlp.shared_experts, Llama 4's feed_forward.shared_expert); Llama 4's
        # MoE block hands back its tokens flattened
        import hf_tiny

        # (OLMoE's plan gathers its attention's projections: the heads whole on every rank)
        size = "moe_intermediate_size" if family == "glm4_moe" else "intermediate_size"
        config = hf_tiny.tiny_config(family, vocab_size=V, **{size: inter})
    else:
        raise ValueError(family)
    if family != "llama4_text":  # its experts have one implementation
        config._experts_implementation = impl
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # Hugging Face starts biases at zero: make them count from step 0
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0, 0.1)
    return model


def plan(family: str, attention: bool = True, experts=None):
    """The family's Hugging Face TP plan written with tpx styles (``attention=False``: the
    attention left whole, for TP sizes its heads do not divide by)."""
    C, R = tpx.ColwiseParallel, tpx.RowwiseParallel
    p = {"model.layers.*.mlp.experts": experts or tpx.ExpertsTensorParallel()}
    # Hugging Face's DeepSeek-V3 plan keeps the MLA attention whole; gpt-oss's attention sinks
    # (one per head) would need splitting with the heads
    if attention and family not in ("deepseek_v3", "gpt_oss"):
        # whole heads of 8; the 2 KV heads replicated where the TP size exceeds them
        p["model.layers.*.self_attn.q_proj"] = C(head_size=8)
        p.update({f"model.layers.*.self_attn.{n}_proj": C(head_size=8, replicate_heads=True)
                  for n in "kv"})
        p["model.layers.*.self_attn.o_proj"] = R()
    if family == "qwen3_moe":
        p["model.layers.*.self_attn.[qk]_norm"] = tpx.ReplicatedWithGradAllReduce()
    shared = {"qwen2_moe": "shared_expert", "deepseek_v3": "shared_experts"}.get(family)
    for mlp in ["mlp"] + ([f"mlp.{shared}"] if shared else []):
        p[f"model.layers.*.{mlp}.gate_proj"] = C()
        p[f"model.layers.*.{mlp}.up_proj"] = C()
        p[f"model.layers.*.{mlp}.down_proj"] = R()
    return p


def _batch(step: int, seq: int = 12):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    return ids, labels


def _train_like_one_device(rank, world, family, impl="grouped_mm", inter=48, steps=3, ep=False,
                           auto=False, sp=False, idle=False):
    what = (f"{family} ({impl}, I={inter}{', EP' if ep else ''}{', plans.auto' if auto else ''}"
            f"{', sequence parallel' if sp else ''}{', idle experts' if idle else ''}) "
            f"TP={world}")
    torch.manual_seed(0)
    ref = tiny(family, impl, inter)
    if idle:
        # Routers of zeros: every score ties and top-k takes the same two experts for every
        # token, so no token reaches the other two (under expert parallelism at TP 2: one
        # rank's experts are idle).
        chosen = {tuple(r) for r in torch.topk(torch.zeros(24, 4), 2).indices.tolist()}
        assert len(chosen) == 1 and set(chosen.pop()) in ({0, 1}, {2, 3}), chosen
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.zero_()
    model = copy.deepcopy(ref)
    # sequence parallelism: 13 positions, padded to a multiple of the TP size (the router must
    # not see the padding: the load-balancing loss counts every token it routes)
    seq = 13 if sp else 12
    if auto:  # the model's own Hugging Face plan, read by tpx
        tpx.parallelize_module(model, None, tpx.plans.auto(model, experts="ep" if ep else "tp",
                                                           sequence_parallel=sp))
        sharded = [m for m in model.modules() if hasattr(m, "_tpx_experts_group")]
        if "moe_tp_experts" in tpx.parallel.hf_plan.hf_tp_plan(ref).values():
            assert sharded and all(hasattr(m, "_tpx_local_experts") == ep for m in sharded), \
                f"{what}: experts={'ep' if ep else 'tp'} must give expert parallelism exactly then"
        else:  # an older transformers' plan (5.18's Qwen2-MoE) keeps the experts whole
            assert not sharded, what
    else:
        experts = tpx.ExpertsParallel() if ep else None
        tpx.parallelize_module(model, None, plan(family, attention=4 % world == 0,
                                                 experts=experts), strict=False)
    # SGD with momentum: Adam divides by the gradient's own size, so a gradient at round-off
    # level (1e-7, summed in another order on one device) becomes a step of +-lr there.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(steps):
        ids, labels = _batch(step, seq)
        out_ref = ref(input_ids=ids, labels=labels)
        out = model(input_ids=ids, labels=labels)
        at = f"{what}, step {step}"
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"logits ({at}): {m}")
        torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"loss ({at}): {m}")
        if getattr(out_ref, "aux_loss", None) is not None:
            torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"aux loss ({at}): {m}")
        for m, out_m in ((ref, out_ref), (model, out)):
            m.zero_grad()
            out_m.loss.backward()
        assert_like_unsharded(model, ref, at, grad=True, rtol=1e-4, atol=2e-5)
        for opt in opts:
            opt.step()
    assert_like_unsharded(model, ref, f"{what}, parameters after {steps} steps",
                          rtol=1e-4, atol=2e-5)
    full = tpx.checkpoint.full_state_dict(model)
    ref_state = ref.state_dict()
    assert set(full) == set(ref_state), what
    for key, value in ref_state.items():
        torch.testing.assert_close(full[key], value, rtol=1e-4, atol=2e-5,
                                   msg=lambda m: f"state {key} ({what}): {m}")
    # The full state loads into a differently initialised sharded copy and reproduces it.
    torch.manual_seed(7)
    other = tiny(family, impl, inter)
    if auto:
        tpx.parallelize_module(other, None, tpx.plans.auto(other, experts="ep" if ep else "tp",
                                                           sequence_parallel=sp))
    else:
        tpx.parallelize_module(other, None, plan(family, attention=4 % world == 0,
                                                 experts=tpx.ExpertsParallel() if ep else None),
                               strict=False)
    tpx.checkpoint.load_full_state_dict(other, ref_state)
    with torch.no_grad():
        ids, _ = _batch(steps, seq)
        torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits,
                                   msg=lambda m: f"reloaded ({what}): {m}")


FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"]


def _qwen2_moe_auto_sp(rank, world):
    """Qwen2-MoE (shared expert and its gate) through tpx.plans.auto with sequence
    parallelism, equal to one device. An older transformers (5.18, as on torch 2.5) keeps the
    experts out of its plan: tpx then keeps the block whole, and sequence parallelism, whose
    reduce-scatter would sit at the shared expert's end inside it, is refused."""
    hf = tpx.parallel.hf_plan.hf_tp_plan(tiny("qwen2_moe"))
    if "model.layers.*.mlp.experts" in hf:
        _train_like_one_device(rank, world, "qwen2_moe", auto=True, sp=True)
        return
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported for "
                                         "model_type='qwen2_moe'"):
        tpx.plans.auto(tiny("qwen2_moe"), sequence_parallel=True)


def _cases(rank, world, names):
    """The named cases of this file in one set of ranks (starting ranks costs more than the
    cases); a failure in one is reported with the others'."""
    table = {f: (lambda f=f: _train_like_one_device(rank, world, f)) for f in FAMILIES}
    table.update({f"{f}-ep": (lambda f=f: _train_like_one_device(rank, world, f, ep=True))
                  for f in FAMILIES})
    table.update({f"{f}-auto": (lambda f=f: _train_like_one_device(rank, world, f, auto=True))
                  for f in FAMILIES})
    table.update({f"{f}-auto-ep": (lambda f=f: _train_like_one_device(rank, world, f, ep=True,
                                                                     auto=True))
                  for f in FAMILIES})
    table["qwen3_moe-auto-sp"] = lambda: _train_like_one_device(rank, world, "qwen3_moe",
                                                                auto=True, sp=True)
    table["qwen2_moe-auto-sp"] = lambda: _qwen2_moe_auto_sp(rank, world)
    table.update({f"{f}-auto-sp": (lambda f=f: _train_like_one_device(rank, world, f,
                                                                     auto=True, sp=True))
                  for f in ("glm4_moe", "llama4_text", "deepseek_v3", "olmoe")})
    table["mixtral-auto-ep-sp"] = lambda: _train_like_one_device(rank, world, "mixtral", ep=True,
                                                                 auto=True, sp=True)
    table["mixtral-eager-ep-idle"] = lambda: _train_like_one_device(rank, world, "mixtral",
                                                                    "eager", ep=True, idle=True)
    table["gpt_oss"] = lambda: _train_like_one_device(rank, world, "gpt_oss")
    table["gpt_oss-ep"] = lambda: _train_like_one_device(rank, world, "gpt_oss", ep=True)
    table["mixtral-eager-ep"] = lambda: _train_like_one_device(rank, world, "mixtral", "eager",
                                                               ep=True)
    table.update({
        "mixtral-eager-46": lambda: _train_like_one_device(rank, world, "mixtral", "eager", 46),
        "mixtral-eager-45": lambda: _train_like_one_device(rank, world, "mixtral", "eager", 45),
        "qwen3_moe-eager-46": lambda: _train_like_one_device(rank, world, "qwen3_moe", "eager",
                                                              46),
        "generate": lambda: _generate(rank, world),
        "module-list": lambda: _module_list(rank, world),
        "errors": lambda: _errors(rank, world),
        "bytes": lambda: _bytes(rank, world),
    })
    run_cases([(n, table[n]) for n in names])


def test_moe_tp2():
    """Every family at TP 2 with the grouped GEMM (gpt-oss: transposed, interleaved gate/up,
    biases), by hand and through ``tpx.plans.auto`` (the model's own Hugging Face plan); the
    eager loop over experts with an intermediate size (45) split 23 / 22; expert parallelism,
    generate(), a ModuleList of experts, the errors, the bytes."""
    run_ranks(_cases, 2, FAMILIES + [f"{f}-auto" for f in FAMILIES] + [
        "gpt_oss", "mixtral-eager-45", "mixtral-ep", "deepseek_v3-ep", "gpt_oss-ep",
        "qwen3_moe-auto-ep", "qwen3_moe-auto-sp", "qwen2_moe-auto-sp", "mixtral-auto-ep-sp",
        "glm4_moe-auto-sp", "llama4_text-auto-sp", "deepseek_v3-auto-sp", "olmoe-auto-sp",
        "mixtral-eager-ep-idle", "generate",
        "module-list", "errors", "bytes"])


@pytest.mark.slow
def test_moe_tp3():
    """TP 3: the eager loop over the experts with an intermediate size (46) that does not divide
    by 3 (the attention left whole: its 4 heads do not divide either); a ModuleList of experts."""
    run_ranks(_cases, 3, ["mixtral-eager-46", "mixtral-eager-ep", "qwen2_moe-ep", "module-list",
                          "bytes"])


@pytest.mark.slow
def test_moe_tp4():
    run_ranks(_cases, 4, FAMILIES + [f"{f}-ep" for f in FAMILIES] +
              [f"{f}-auto" for f in FAMILIES] + [f"{f}-auto-ep" for f in FAMILIES] +
              ["gpt_oss", "gpt_oss-ep", "qwen3_moe-eager-46", "mixtral-eager-ep", "module-list",
               "qwen3_moe-auto-sp", "qwen2_moe-auto-sp", "mixtral-auto-ep-sp",
               "glm4_moe-auto-sp", "llama4_text-auto-sp", "deepseek_v3-auto-sp", "olmoe-auto-sp",
               "bytes"])


def _generate(rank, world):
    torch.manual_seed(0)
    ref = tiny("mixtral")
    model = copy.deepcopy(ref)
    # the model's own plan with the vocab-parallel head (loss_parallel): generate() sees the
    # full logits
    tpx.parallelize_module(model, None, tpx.plans.auto(model, loss_parallel=True))
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want), (got, want)


# ------------------------------------------------------------- a user's ModuleList of experts

class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Top-k routing over a ModuleList of SwiGLU experts, with a capacity limit (tokens past
    it are dropped) and the Switch-Transformer load-balancing loss."""

    def __init__(self, d=24, h=20, experts=4, k=2, capacity=5):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))
        self.k, self.capacity = k, capacity

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, index = probs.topk(self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            token, slot = token[:self.capacity], slot[:self.capacity]  # capacity: drop the rest
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        counts = F.one_hot(index[:, 0], len(self.experts)).float().mean(0)
        aux = len(self.experts) * (counts * probs.mean(0)).sum()
        return out.view_as(x), aux


def _module_list(rank, world):
    torch.manual_seed(0)
    ref = nn.Sequential(MoE())
    model = copy.deepcopy(ref)
    C, R = tpx.ColwiseParallel, tpx.RowwiseParallel
    tpx.parallelize_module(model, None, {"0.experts.*.w1": C(), "0.experts.*.w3": C(),
                                         "0.experts.*.w2": R()})
    x = torch.randn(3, 4, 24, generator=torch.Generator().manual_seed(5), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    (y, aux), (y_ref, aux_ref) = model(x), ref(xr)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, aux_ref)
    ((y * y).sum() + aux).backward()
    ((y_ref * y_ref).sum() + aux_ref).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    assert_like_unsharded(model, ref, f"ModuleList experts TP={world}", grad=True)


# ------------------------------------------------------------------------------------ errors

def _errors(rank, world):
    torch.manual_seed(0)
    model = tiny("mixtral")
    with pytest.raises(ValueError, match="no parameter 'w1'"):
        tpx.parallelize_module(model, None, {"model.layers.0.mlp.experts":
                                             tpx.ExpertsTensorParallel(gate_up="w1")})
    with pytest.raises(ValueError, match="ModuleList of expert MLPs"):
        tpx.parallelize_module(nn.Sequential(MoE()), None,
                               {"0.experts": tpx.ExpertsTensorParallel()})
    # sequence parallelism with shared experts split inside a mixture-of-experts block that
    # also holds a module computed whole (Qwen2-MoE's shared_expert_gate): the block's output
    # cannot be left Partial() for one reduce-scatter without knowing how the two combine
    shared = tiny("qwen2_moe")
    hf = tpx.parallel.hf_plan.hf_tp_plan(shared)
    hf.update({"model.layers.*.mlp.shared_expert.gate_proj": "colwise",
               "model.layers.*.mlp.shared_expert.up_proj": "colwise",
               "model.layers.*.mlp.shared_expert.down_proj": "rowwise"})
    # (an older transformers, as on torch 2.5, keeps Qwen2-MoE's experts out of its plan: the
    # shared expert's end then is the only row-parallel projection of a block kept whole)
    why = ("a module with parameters computed whole" if "model.layers.*.mlp.experts" in hf else
           "'model.layers.*.mlp.shared_expert.down_proj' is not a direct child of its block")
    with pytest.raises(ValueError, match=why):
        tpx.parallel.hf_plan.translate(shared, tp_plan=hf, sequence_parallel=True)
    tpx.parallelize_module(model, None, {"model.layers.0.mlp.experts": tpx.ExpertsTensorParallel()})
    with pytest.raises(ValueError, match="sharded already"):
        tpx.parallelize_module(model, None, {"model.layers.0.mlp.experts":
                                             tpx.ExpertsTensorParallel()})



def _bytes(rank, world):
    """Wire bytes per token of one MoE layer (benchmarks/bench_moe.py) equal the derivation
    exactly: for the fused experts one all-reduce forward and one backward, whatever the
    family; for a ModuleList of experts one per expert a token visits."""
    import bench_moe

    for layout, family in ([("fused", f) for f in FAMILIES] + [("expert-parallel", "mixtral"),
                           ("module-list", None)]):
        r = bench_moe.measure(rank, world, layout, family or "mixtral")
        assert (r["forward"], r["backward"]) == (r["derived"]["forward"],
                                                 r["derived"]["backward"]), r
        if layout != "module-list":
            assert r["calls"] == dict(forward=1, backward=1), r
