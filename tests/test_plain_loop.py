"""The lines of an ordinary training script, unchanged, on a Hugging Face model sharded by
``tpx.plans.auto``: torch's ``clip_grad_norm_`` and ``clip_grad_value_``, foreach and fused
``AdamW``, ``model.save_pretrained``, peft's ``get_peft_model`` (no tpx call), an adapter
added later, peft's ``save_pretrained``, an EMA copy and ``AveragedModel``. Each run beside the
same script on one device: the losses and norms of every step, every parameter after the
steps, and the files written."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from harness import assert_like_unsharded, run_ranks

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


def _model(arch: str, layout: str, world: int = 2):
    if arch == "llama":
        return _llama(layout)
    import hf_tiny

    torch.manual_seed(0)
    # gpt-oss's 8 KV heads divide the TP sizes it runs at; the tiny one's 2 do not divide 4
    # (KV rows held by several ranks stay plain tensors: test_layouts_no_dtensor_states_are_named)
    over = {"num_key_value_heads": world} if arch == "gpt_oss" and world > 2 else {}
    return hf_tiny.tiny(arch, **over).double()


def _full_loop(rank, world, d, optim, layout="1d", arch="llama"):
    import tpx
    import tpx.checkpoint
    from torch.distributed.tensor import DTensor

    ref = _model(arch, layout, world)
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


def _lora_loop(rank, world, d, layout="1d"):
    import tpx
    import tpx.checkpoint

    peft = pytest.importorskip("peft")
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                  init_lora_weights=False)  # B random: the adapters change the first loss
    ref = _llama("1d" if layout == "1d" else "2d")
    model = copy.deepcopy(ref)
    if layout == "1d":
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
    else:
        mesh = tpx.init_mesh(layout, **({"depth": 2} if layout == "2.5d" else {}))
        tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout))
    torch.manual_seed(1)
    pm = peft.get_peft_model(model, peft.LoraConfig(**config))
    torch.manual_seed(1)
    ref_pm = peft.get_peft_model(ref, peft.LoraConfig(**config))
    # The multi-D layouts' norms sum float32 squares in parts: foreach SGD there, as in
    # _full_loop, compared to 1e-6.
    exact = layout == "1d"
    tol = 1e-9 if exact else 1e-6

    def make(m):
        params = [p for p in m.parameters() if p.requires_grad]
        return (torch.optim.AdamW(params, lr=1e-2, fused=True) if exact else
                torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True))

    def same(got, want, what):
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
            assert abs(loss - ref_loss) <= tol and abs(norm - ref_norm) <= tol, \
                (what, step, got, want)

    same(_train(pm, make(pm)), _train(ref_pm, make(ref_pm)), "LoRA")
    full = tpx.checkpoint.full_state_dict(pm)
    for key, value in ref_pm.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=1e-10 if exact else tol,
                                   msg=lambda m, key=key: f"after 3 steps, {key}: {m}")
    pm.save_pretrained(os.path.join(d, "tp"))
    if rank == 0:
        ref_pm.save_pretrained(os.path.join(d, "one"))
    dist.barrier()
    what = f"LoRA TP {world} {layout}"
    _assert_same_files(os.path.join(d, "tp"), os.path.join(d, "one"), what,
                       atol=1e-10 if exact else tol)
    # An adapter added later (drawn full-sized on every rank, as on one device), trained alone
    # with the same lines, then saved beside the first.
    later = dict(config, target_modules=["k_proj", "gate_proj", "up_proj"], r=2)
    for m in (pm, ref_pm):
        torch.manual_seed(2)
        m.add_adapter("later", peft.LoraConfig(**later))
        m.set_adapter("later")
    same(_train(pm, make(pm), steps=2), _train(ref_pm, make(ref_pm), steps=2), "added later")
    pm.save_pretrained(os.path.join(d, "tp2"))
    if rank == 0:
        ref_pm.save_pretrained(os.path.join(d, "one2"))
    dist.barrier()
    for sub in ("", "later"):
        _assert_same_files(os.path.join(d, "tp2", sub), os.path.join(d, "one2", sub),
                           f"{what}, adapter {sub or 'default'}", atol=1e-10 if exact else tol)
    # One device's adapter loaded into the sharded model, and the merged model.
    ids = _batch(8)
    pm.load_adapter(os.path.join(d, "one"), adapter_name="from_one")
    for m in (pm, ref_pm):
        m.set_adapter("default")
    with torch.no_grad():
        pm.set_adapter("from_one")
        torch.testing.assert_close(pm(input_ids=ids).logits, ref_pm(input_ids=ids).logits,
                                   rtol=0, atol=tol, msg=lambda m: f"{what} loaded: {m}")
        pm.set_adapter("default")
        merged, ref_merged = pm.merge_and_unload(), ref_pm.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=ids).logits,
                                   ref_merged(input_ids=ids).logits, rtol=0, atol=tol,
                                   msg=lambda m: f"{what} merged: {m}")


@pytest.mark.parametrize("world,layout", [
    (2, "1d"), pytest.param(3, "1d", marks=pytest.mark.slow), (4, "2d"),
    pytest.param(8, "2.5d", marks=pytest.mark.slow)])
def test_lora_loop(tmp_path, world, layout):
    run_ranks(_lora_loop, world, str(tmp_path), layout)


def _averages_loop(rank, world, layout, sequence_parallel):
    """An EMA copy (``copy.deepcopy`` of the model, ``torch._foreach_lerp_``) and
    ``torch.optim.swa_utils.AveragedModel`` (its own deep copy, EMA's ``multi_avg_fn``, and
    SWA's running mean with ``SWALR``) beside the training model, as written on one device:
    the losses, the copies' losses on a new batch and every parameter of each copy. A copy of
    a tpx model computes with its own parameters (its hooks were copied with it)."""
    import tpx
    import tpx.checkpoint
    from torch.distributed.tensor import DTensor
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

    ref = _llama("1d" if layout == "1d" else "2d")
    model = copy.deepcopy(ref)
    if layout == "1d":
        tpx.parallelize_module(model, None, tpx.plans.auto(
            model, sequence_parallel=sequence_parallel))
    else:
        mesh = tpx.init_mesh(layout, **({"depth": 2} if layout == "2.5d" else {}))
        tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout))

    def run(m):
        # The multi-D layouts' norms sum float32 squares in parts: SGD there, as in
        # _full_loop (AdamW's first steps turn that rounding into changes of 1e-6).
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True) if layout == "1d" else
               torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=True))
        sched = SWALR(opt, swa_lr=5e-3, anneal_epochs=2)
        ema = copy.deepcopy(m).requires_grad_(False)
        ema_avg = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.8))
        swa = AveragedModel(m)
        losses = []
        for step in range(3):
            ids = _batch(step)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            sched.step()
            with torch.no_grad():
                ema_params = list(ema.parameters())
                torch._foreach_lerp_(ema_params, list(m.parameters()), 0.1)
            ema_avg.update_parameters(m)
            swa.update_parameters(m)
            losses.append(loss.item())
        ids = _batch(7)
        with torch.no_grad():
            losses += [x(input_ids=ids, labels=ids).loss.item() for x in (ema, ema_avg, swa)]
        return losses, (ema, ema_avg.module, swa.module)

    (got, copies), (want, ref_copies) = run(model), run(ref)
    tol = 1e-9 if layout == "1d" else 1e-6  # the 2-D norms' float32 sums in parts
    assert max(abs(a - b) for a, b in zip(got, want)) <= tol, (got, want)
    for name, c, r in zip(("EMA copy", "AveragedModel (EMA)", "AveragedModel (SWA)"),
                          copies, ref_copies):
        assert all(isinstance(p, DTensor) for p in c.parameters()), name
        full = tpx.checkpoint.full_state_dict(c)
        for key, value in r.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=1e-10 if tol < 1e-8 else tol,
                                       msg=lambda m, key=key, name=name: f"{name} {key}: {m}")
        # every rank's own part, the replicas (norms, biases) on every rank included
        assert_like_unsharded(c, r, name, rtol=0, atol=1e-10 if tol < 1e-8 else tol)


@pytest.mark.parametrize("world,layout,sp", [
    (2, "1d", False), (2, "1d", True),
    pytest.param(3, "1d", True, marks=pytest.mark.slow),
    pytest.param(4, "2d", False, marks=pytest.mark.slow),
    pytest.param(8, "2.5d", False, marks=pytest.mark.slow),
    pytest.param(8, "3d", False, marks=pytest.mark.slow)])
def test_averaged_copies_of_the_model(world, layout, sp):
    run_ranks(_averages_loop, world, layout, sp)


def _plain_layouts(rank, world, arch):
    """A model with a layout no ``DTensor`` states: parallelize_module names those parameters
    in a warning, and the lines it advises (``tpx.clip_grad_norm_``, ``foreach=False``) train
    it equal to one device."""
    import warnings

    import tpx
    import tpx.checkpoint

    ref = _model(arch, "1d")
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
    said = [str(w.message) for w in caught if "plain tensors" in str(w.message)]
    assert len(said) == 1 and "c_attn.weight" in said[0] and "tpx.clip_grad_norm_" in said[0] \
        and "foreach=False" in said[0], said
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        ids = _batch(0)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # what the warning says
    model.zero_grad()
    out = []
    for m, clip in ((model, tpx.clip_grad_norm_), (ref, torch.nn.utils.clip_grad_norm_)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False)
        losses = []
        for step in range(3):
            ids = _batch(step)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append((loss.item(), float(clip(m.parameters(), 0.5))))
            opt.step()
            opt.zero_grad()
        out.append(losses)
    for (loss, norm), (ref_loss, ref_norm) in zip(*out):
        assert abs(loss - ref_loss) <= 1e-9 and abs(norm - ref_norm) <= 1e-9 * ref_norm, out
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=1e-10,
                                   msg=lambda m, key=key: f"after 3 steps, {key}: {m}")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_layouts_no_dtensor_states_are_named(world):
    run_ranks(_plain_layouts, world, "gpt2")


def _copies(rank, world, arch, options):
    """``copy.deepcopy`` of a sharded model is a model of its own: changed and trained, it
    matches the same done to a copy of the unsharded model, and the original is untouched."""
    import tpx
    import tpx.checkpoint

    ref = _model(arch, "1d")
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, **options))
    twin, ref_twin = copy.deepcopy(model), copy.deepcopy(ref)
    for m in (twin, ref_twin):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.9).add_(0.01)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, foreach=False)
        for step in range(2):
            ids = _batch(step)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    ids = _batch(5)
    # The MoE models route in float32 inside the float64 model: its rounding, in the
    # parameters after the steps.
    tol = 1e-8 if arch in ("mixtral", "qwen3_moe") else 1e-10
    for a, b, what in ((model, ref, "the original"), (twin, ref_twin, "the copy")):
        with torch.no_grad():
            got, want = a(input_ids=ids, labels=ids).loss, b(input_ids=ids, labels=ids).loss
        assert abs(got.item() - want.item()) <= 1e-9, (what, got.item(), want.item())
        full = tpx.checkpoint.full_state_dict(a)
        for key, value in b.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=tol,
                                       msg=lambda m, key=key, what=what: f"{what} {key}: {m}")
        if arch != "gpt2":  # (tpx's layer stores the Conv1D weight [out, in])
            # every rank's own part, the replicas on every rank included
            assert_like_unsharded(a, b, what, rtol=0, atol=tol)


# Each kind of hook tpx registers: kept-whole replicas (Llama), sequence parallelism, experts
# (TP and EP), GPT-2's fused segments, a derived plan (Falcon), Qwen3's per-head norms.
@pytest.mark.parametrize("arch,options,world", [
    ("llama", {}, 2), ("llama", {"sequence_parallel": True}, 2), ("mixtral", {}, 2),
    pytest.param("llama", {"sequence_parallel": True}, 3, marks=pytest.mark.slow),
    pytest.param("mixtral", {"experts": "ep"}, 2, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", {"sequence_parallel": True}, 2, marks=pytest.mark.slow),
    pytest.param("gpt2", {}, 2, marks=pytest.mark.slow),
    pytest.param("falcon", {}, 2, marks=pytest.mark.slow)])
def test_copies_of_a_sharded_model(arch, options, world):
    run_ranks(_copies, world, arch, options)
