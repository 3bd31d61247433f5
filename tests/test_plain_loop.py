"""The lines of an ordinary training script, unchanged, on a Hugging Face model sharded by
``tpx.plans.auto``: torch's ``clip_grad_norm_`` and ``clip_grad_value_``, foreach and fused
``AdamW``, ``model.save_pretrained``, peft's ``get_peft_model`` (no tpx call) and its
``save_pretrained``. Each run beside the same script on one device: the losses and norms of
every step, every parameter after three steps, and the files written."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

transformers = pytest.importorskip("transformers")

V = 101  # divides by none of 2, 3


def _llama(layout="1d"):
    """A tiny Llama in float64 (12 heads, 6 KV heads: TP 2 and 3 split both; sizes that split
    unevenly; for the 2-D layout, sizes its blocks divide)."""
    torch.manual_seed(0)
    sizes = (dict(vocab_size=V, hidden_size=48, intermediate_size=70, num_attention_heads=12,
                  num_key_value_heads=6) if layout == "1d" else
             dict(vocab_size=1000, hidden_size=64, intermediate_size=88, num_attention_heads=8,
                  num_key_value_heads=2))
    cfg = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=32,
                                   attn_implementation="eager", tie_word_embeddings=False,
                                   **sizes)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (4, 12), generator=g)  # 4 rows: the 2-D layout splits them


def _train(model, opt, steps=3):
    """The loop as one writes it on one device; returns each step's loss and norm."""
    out = []
    for step in range(steps):
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torch.nn.utils.clip_grad_value_(model.parameters(), 5e-3)
        opt.step()
        opt.zero_grad()
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        out.append((loss.item(), float(norm)))
    return out


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def _assert_same_files(got, expected, what, atol=1e-10):
    a, b = _tensors(got), _tensors(expected)
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b)))
    for key, value in b.items():
        assert a[key].dtype == value.dtype, (what, key)
        torch.testing.assert_close(a[key], value, rtol=0, atol=atol,
                                   msg=lambda m, key=key: f"{what} {key}: {m}")


def _model(arch: str, layout: str):
    if arch == "llama":
        return _llama(layout)
    import hf_tiny

    torch.manual_seed(0)
    return hf_tiny.tiny(arch).double()


def _full_loop(rank, world, d, optim, layout="1d", arch="llama"):
    import tpx
    import tpx.checkpoint
    from torch.distributed.tensor import DTensor

    ref = _model(arch, layout)
    model = copy.deepcopy(ref)
    if layout == "1d":
        plan = tpx.plans.auto(model)
        assert isinstance(plan, tpx.plans.ModelPlan)  # every block's parameters DTensors
        tpx.parallelize_module(model, None, plan)
    else:
        tpx.parallelize_module(model, tpx.init_mesh(layout), tpx.plans.auto(model, layout=layout))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    def make(params):
        if optim == "sgd":  # foreach SGD with momentum
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)
        return torch.optim.AdamW(params, lr=1e-2, **{optim: True})

    got, want = _train(model, make(model.parameters())), _train(ref, make(ref.parameters()))
    # Hugging Face's RMSNorm normalises in float32 even in a float64 model; the 2-D layout's
    # norm (its rows' features split over ranks) sums those float32 squares in parts (norms
    # differ by 1e-8 relative). SGD there: AdamW's first steps (lr * g / |g|) turn that
    # rounding of a gradient near zero into changes of 1e-6 (measured).
    # AFMoE routes in float32 inside the float64 model: its rounding, as the 2-D layout's.
    exact = layout == "1d" and arch != "afmoe"
    tol = 1e-9 if exact else 1e-6
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= tol and abs(norm - ref_norm) <= tol * ref_norm, \
            (step, got, want)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=1e-10 if exact else tol,
                                   msg=lambda m, key=key: f"after 3 steps, {key}: {m}")
    model.save_pretrained(os.path.join(d, "tp"))
    if rank == 0:
        ref.save_pretrained(os.path.join(d, "one"))
    dist.barrier()
    _assert_same_files(os.path.join(d, "tp"), os.path.join(d, "one"), f"TP {world} {layout}",
                       atol=1e-10 if exact else tol)


@pytest.mark.parametrize("world,optim,layout", [
    (2, "foreach", "1d"), (2, "fused", "1d"),
    pytest.param(3, "foreach", "1d", marks=pytest.mark.slow),
    pytest.param(4, "sgd", "2d", marks=pytest.mark.slow)])
def test_full_fine_tuning_loop(tmp_path, world, optim, layout):
    run_ranks(_full_loop, world, str(tmp_path), optim, layout)


# Models whose plan leaves parts whole that a plan written by hand would leave plain: GPT-OSS
# ships a plan naming its embedding only (every decoder block whole), AFMoE's plan names the
# experts of its MoE layers and not its dense first layer. tpx.plans.auto's plan covers the
# whole model, so every parameter is a DTensor and the loop runs unchanged.
# AFMoE routes in float32 inside the float64 model: foreach SGD there (AdamW's first steps,
# lr * g / |g|, turn float32 rounding of a gradient near zero into changes of 1e-6).
@pytest.mark.parametrize("arch,optim,world", [
    ("gpt_oss", "foreach", 2), pytest.param("gpt_oss", "foreach", 4, marks=pytest.mark.slow),
    pytest.param("afmoe", "sgd", 2, marks=pytest.mark.slow)])
def test_loop_where_the_plan_leaves_blocks_whole(tmp_path, arch, optim, world):
    run_ranks(_full_loop, world, str(tmp_path), optim, "1d", arch)


def _lora_loop(rank, world, d):
    import tpx
    import tpx.checkpoint

    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                  init_lora_weights=False)  # B random: the adapters change the first loss
    ref = _llama()
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    torch.manual_seed(1)
    pm = peft.get_peft_model(model, peft.LoraConfig(**config))
    torch.manual_seed(1)
    ref_pm = peft.get_peft_model(ref, peft.LoraConfig(**config))
    got = _train(pm, torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad],
                                       lr=1e-2, fused=True))
    want = _train(ref_pm, torch.optim.AdamW([p for p in ref_pm.parameters()
                                             if p.requires_grad], lr=1e-2, fused=True))
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= 1e-9 and abs(norm - ref_norm) <= 1e-9, (step, got, want)
    full = tpx.checkpoint.full_state_dict(pm)
    for key, value in ref_pm.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=1e-10,
                                   msg=lambda m, key=key: f"after 3 steps, {key}: {m}")
    pm.save_pretrained(os.path.join(d, "tp"))
    if rank == 0:
        ref_pm.save_pretrained(os.path.join(d, "one"))
    dist.barrier()
    _assert_same_files(os.path.join(d, "tp"), os.path.join(d, "one"), f"LoRA TP {world}")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lora_loop(tmp_path, world):
    run_ranks(_lora_loop, world, str(tmp_path))
