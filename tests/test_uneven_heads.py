"""Attention whose heads do not divide the TP size: heads dealt in blocks that differ by one
(tpx.comm.groups.head_split), each rank's query heads with the KV heads they read; trained
against one device, loaded from transformers' files, and the split itself."""

import copy
import fnmatch
import os
import sys

import pytest
import torch

import tpx
from harness import assert_like_unsharded, run_ranks
from tpx.comm.groups import head_split

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny  # noqa: E402
from test_hf_zoo import _train_like_unsharded  # noqa: E402


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p  # an uneven split: a plain tensor


def _sizes(split):
    return [(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in split]


def test_head_split():
    # multi-head attention, 12 heads at TP 8: whole heads, 2,2,2,2,1,1,1,1
    assert _sizes(head_split(12, 12, 8)) == [(2, 2)] * 4 + [(1, 1)] * 4
    # 20 heads over 4 KV heads at TP 8: each KV head on 2 ranks, its 5 heads as 3 and 2
    split = head_split(20, 4, 8)
    assert _sizes(split) == [(3, 1), (2, 1)] * 4
    assert [k for _, k in split] == [(0, 1), (0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (3, 4),
                                     (3, 4)]
    # 8 heads over 2 KV heads at TP 3: KV head 0 on ranks 0 and 1, KV head 1 on rank 2
    assert head_split(8, 2, 3) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 8), (1, 2))]
    # where the counts divide: the even split, KV heads replicated when fewer than ranks
    assert _sizes(head_split(32, 8, 8)) == [(4, 1)] * 8
    assert [k for _, k in head_split(32, 2, 8)] == [(r * 2 // 8, r * 2 // 8 + 1)
                                                    for r in range(8)]
    for h, kv, w in [(12, 12, 8), (20, 4, 8), (8, 2, 3), (6, 6, 4), (40, 8, 6)]:
        split = head_split(h, kv, w)
        assert [q for q, _ in split][0][0] == 0 and split[-1][0][1] == h
        assert all(split[r][0][1] == split[r + 1][0][0] for r in range(w - 1))
        for (q0, q1), (k0, k1) in split:  # each query head's KV head is held
            assert all(k0 <= q // (h // kv) < k1 for q in range(q0, q1))
    with pytest.raises(ValueError, match="fewer than the TP size"):
        head_split(6, 6, 8)


@pytest.mark.parametrize("arch,world", [("gpt2", 3), ("llama", 3)])
def test_uneven_heads_train_like_one_device(arch, world):
    # the tiny configs have 8 query heads (Llama: over 2 KV heads): at TP 3, 3,3,2 and 2,2,4
    run_ranks(_train_like_unsharded, world, arch, False, False)


@pytest.mark.slow
@pytest.mark.parametrize("arch,world", [("gpt2", 5), ("qwen3", 3), ("mistral", 5),
                                        ("gpt_oss", 3)])
def test_uneven_heads_train_like_one_device_slow(arch, world):
    run_ranks(_train_like_unsharded, world, arch, False, False)


def _twelve_heads_at_tp8(rank, world):
    torch.manual_seed(0)
    ref = hf_tiny.tiny("gpt2", n_head=12, n_embd=96)
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    attn = model.transformer.h[0].attn
    mine = 2 if rank < 4 else 1
    assert attn.num_heads == mine
    assert _local(attn.c_proj.weight).shape[1] == mine * 8
    ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=2e-5)
    out.loss.backward()
    out_ref.loss.backward()
    assert_like_unsharded(model, ref, "GPT-2, 12 heads at TP 8", grad=True, rtol=1e-4,
                          atol=2e-5)


@pytest.mark.slow
def test_gpt2_twelve_heads_at_tp8():
    run_ranks(_twelve_heads_at_tp8, 8)


def _loaded_uneven(rank, world, path):
    import torch.distributed as dist

    torch.manual_seed(0)
    ref = hf_tiny.tiny("llama")
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tpx.from_pretrained(path, dtype=torch.float32, config=copy.deepcopy(ref.config))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert _local(q).shape[0] == (2, 2, 4)[rank] * 8
    ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=2e-5)
    out = os.path.join(os.path.dirname(path), "saved")
    model.save_pretrained(out)
    dist.barrier()
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for (n, p), p_ref in zip(back.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=0, atol=0, msg=n)


def test_uneven_heads_load_and_save(tmp_path):
    run_ranks(_loaded_uneven, 3, str(tmp_path / "llama"))


def _lora_on_uneven_heads(rank, world):
    # peft's LoRA on q_proj and o_proj of attention split 2,2,4 at TP 3: drawn and trained as
    # on one device
    import peft

    torch.manual_seed(0)
    ref = hf_tiny.tiny("llama")
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], lora_dropout=0.0,
                          init_lora_weights=False)
    torch.manual_seed(1)
    ref = peft.get_peft_model(ref, cfg)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, copy.deepcopy(cfg))
    ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(1))
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=2e-5)
    out.loss.backward()
    out_ref.loss.backward()
    # every parameter and gradient, the uneven splits gathered through their descriptions
    assert_like_unsharded(model, ref, "LoRA on heads split 2,2,4", grad=True, rtol=1e-4,
                          atol=2e-5)


def test_lora_on_uneven_heads():
    run_ranks(_lora_on_uneven_heads, 3)


# Derived plans (models that ship none): 8 heads at TP 3 as 3, 3, 2 (OPT's multi-head,
# GPT BigCode's and Falcon's multi-query, Bloom's ALiBi biases cut to each rank's heads).
@pytest.mark.parametrize("arch", ["opt", pytest.param("gpt_bigcode", marks=pytest.mark.slow),
                                  pytest.param("falcon", marks=pytest.mark.slow),
                                  pytest.param("bloom", marks=pytest.mark.slow)])
def test_derived_plans_split_uneven_heads(arch):
    run_ranks(_train_like_unsharded, 3, arch, False, False)


def _derived_uneven_loaded(rank, world, path, arch):
    # on the meta device: the plan derived on the model's twins and carried over
    ref, model = hf_tiny.written_and_loaded(arch, path)
    sink = dict(model.named_modules())[_ATTN_OUT[arch]]
    assert _local(sink.weight).shape[1] == (3, 3, 2)[rank] * 8  # whole heads, 3, 3, 2
    ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=2e-5)


# BERT's attention output (attention.output.dense) also matches the pattern of its MLP's
# (layer.*.output.dense): the carried plan names each module where a pattern would name both
_ATTN_OUT = {"opt": "model.decoder.layers.0.self_attn.out_proj",
             "bert-generation": "bert.encoder.layer.0.attention.output.dense"}


@pytest.mark.parametrize("arch", ["bert-generation", pytest.param("opt", marks=pytest.mark.slow)])
def test_derived_plan_with_uneven_heads_loads(tmp_path, arch):
    run_ranks(_derived_uneven_loaded, 3, str(tmp_path / arch), arch)


_FEW = {"opt": ("model.decoder.layers.0.self_attn", "out_proj", "model.decoder.layers.0.fc1"),
        "llama": ("model.layers.0.self_attn", "o_proj", "model.layers.0.mlp.gate_proj")}


def _fewer_heads_than_ranks(rank, world, arch):
    # 2 heads at TP 3, in a derived plan (OPT ships none) and a shipped one (Llama's): the
    # attention cannot give every rank a head, so it stays whole, with a warning naming it
    # and what it costs; the MLPs are split, and the model trains like one device
    torch.manual_seed(0)
    ref = hf_tiny.tiny(arch, num_attention_heads=2, num_key_value_heads=2)
    model = copy.deepcopy(ref)
    plan = tpx.plans.auto(model)
    with pytest.warns(UserWarning, match=r"cannot be split over TP size 3 .*2 attention heads.*"
                                         r"self_attn.*of the model's parameters"):
        tpx.parallelize_module(model, None, plan)
    attn_name, out_name, mlp_name = _FEW[arch]
    mods = dict(model.named_modules())
    out = getattr(mods[attn_name], out_name)
    assert _local(out.weight).shape == out.weight.shape  # whole
    assert any(fnmatch.fnmatchcase(attn_name, k) for k in plan.kept_whole)
    mlp = mods[mlp_name]
    lo, hi = tpx.shard_range(mlp.weight.shape[0])
    assert _local(mlp.weight).shape[0] == hi - lo  # split
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, model)]
    for step in range(2):
        ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(step))
        outs = [m(input_ids=ids, labels=ids) for m in (ref, model)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-4)
        for o, res in zip(opts, outs):
            res.loss.backward()
            o.step()
            o.zero_grad()
    assert_like_unsharded(model, ref, f"{arch}, 2 heads at TP 3", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_fewer_heads_than_ranks_stay_whole(arch):
    run_ranks(_fewer_heads_than_ranks, 3, arch)
