"""LoRA (peft) on models sharded by tpx, in both orders (peft first, then
``tpx.parallelize_module(pm, None, tpx.plans.auto(pm))``; or tpx first, then
``get_peft_model(model, config)``, with or without ``tpx.nn.lora.register``): the loss of every AdamW step, every
parameter after the steps and the merged model equal one device's; adapters saved at one TP
degree (or on one device) load at another; what tpx does not shard is a clear error."""

import copy
import os

import pytest
import torch

from harness import assert_like_unsharded, run_ranks
from torch_compat import SHARD_HAS_LOCAL_SIZE

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is an optional dependency (make test installs it)")

V = 101  # divides by none of 2, 3, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(family: str):
    """A tiny causal LM (float64, eager attention, 6 heads of 8: TP 2 and 3 split them;
    intermediate sizes that split unevenly)."""
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                  max_position_embeddings=32, attn_implementation="eager",
                  tie_word_embeddings=False)
    if family == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=70, num_key_value_heads=6, **common)
    elif family == "llama_2d":  # sizes the 2-D / 2.5-D layouts' blocks divide (q = 2)
        cfg = transformers.LlamaConfig(intermediate_size=70, num_key_value_heads=6,
                                       **dict(common, vocab_size=V + 1))
    elif family == "llama_gqa":  # 2 KV heads: at TP 4 each is held by two ranks
        cfg = transformers.LlamaConfig(intermediate_size=70, num_key_value_heads=2,
                                       **dict(common, num_attention_heads=8))
    elif family == "llama8":  # 8 heads, 4 KV heads: TP 4 splits both
        cfg = transformers.LlamaConfig(intermediate_size=70, num_key_value_heads=4,
                                       **dict(common, num_attention_heads=8))
    elif family == "qwen2":  # biases on q, k, v
        cfg = transformers.Qwen2Config(intermediate_size=70, num_key_value_heads=6, **common)
    elif family == "qwen2_moe":  # layer 0 a dense MLP; layer 1 experts and a shared expert
        cfg = transformers.Qwen2MoeConfig(intermediate_size=70, moe_intermediate_size=22,
                                          shared_expert_intermediate_size=30, num_experts=4,
                                          num_experts_per_tok=2, mlp_only_layers=[0],
                                          num_key_value_heads=6, **common)
    elif family == "qwen3_moe":  # peft wraps its experts' parameters (ParamWrapper)
        cfg = transformers.Qwen3MoeConfig(intermediate_size=70, moe_intermediate_size=22,
                                          num_experts=4, num_experts_per_tok=2,
                                          num_key_value_heads=6, head_dim=8, **common)
    elif family == "gpt2":  # Conv1D layers (fan_in_fan_out), a fused [q | k | v]
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=48, n_layer=2, n_head=6,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="eager")
    else:
        raise ValueError(family)
    cfg._experts_implementation = "eager"  # grouped GEMM does not take float64
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def lora_config(targets=TARGETS, **kw):
    # init_lora_weights=False: B starts random (not zero), so the adapters change the logits
    # from the first step on.
    kw.setdefault("init_lora_weights", False)
    targets = targets if isinstance(targets, str) else list(targets)
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, **kw)


def sharded_lora(model, config, order: str, sp: bool = False):
    """``model`` with the LoRA adapters of ``config`` (drawn from seed 1), sharded by tpx over
    the default group in ``order`` (``sp``: with sequence parallelism)."""
    import tpx
    import tpx.nn.lora

    torch.manual_seed(1)
    if order == "peft":
        pm = peft.get_peft_model(model, config)
        tpx.parallelize_module(pm, None, tpx.plans.auto(pm, sequence_parallel=sp))
    else:  # "tpx": peft's own call; "tpx+register": the explicit registration kept working
        tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=sp))
        if order == "tpx+register":
            config = tpx.nn.lora.register(config)
        pm = peft.get_peft_model(model, config)
    return pm


def one_device(model, config):
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (2, 12), generator=g)  # 12 tokens: sequence-parallel at TP 2, 3, 4


def train_step(pm, opt, step: int, clip=None) -> float:
    """One AdamW step; ``clip``: the gradient clipping function to call (max_norm 0.05)."""
    ids = batch(step)
    loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    if clip is not None:
        norm = clip([p for p in pm.parameters() if p.requires_grad], 0.05)
        assert norm > 0.05  # the clipping scales
    opt.step()
    opt.zero_grad()
    return loss.item()


def adamw(pm):
    return torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)


def assert_state_equal(sharded, ref, what: str, tol: float = 1e-10) -> None:
    """``tpx.checkpoint.full_state_dict(sharded)`` equals ``ref.state_dict()`` key by key."""
    import tpx.checkpoint

    full = tpx.checkpoint.full_state_dict(sharded)
    expected = ref.state_dict()
    assert sorted(full) == sorted(expected), (what, sorted(set(full) ^ set(expected)))
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=tol,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


def _lora_layers(pm):
    return [m for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]


def _train_like_one_device(rank, world, family, order, targets, extra, sp=False):
    import tpx
    from tpx.nn.lora import ColumnParallelLoraLinear, RowParallelLoraLinear

    what = f"{family} {order} first, TP {world}" + (", sequence parallel" if sp else "")
    model = tiny(family)
    ref = one_device(copy.deepcopy(model), lora_config(targets, **extra))
    pm = sharded_lora(model, lora_config(targets, **extra), order, sp)
    named = [(n, m) for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(named) == len(_lora_layers(ref)), what
    # Hugging Face's plan does not name qwen2_moe's shared expert; tpx.plans.auto completes
    # the plan with it where it sees the model's own modules (tpx first), and a plan read
    # through peft's wrappers leaves it whole: peft's own LoRA layer then.
    whole = [(n, m) for n, m in named if type(m) is peft.tuners.lora.Linear]
    layers = [m for n, m in named if type(m) is not peft.tuners.lora.Linear]
    assert all(".shared_expert." in n for n, _ in whole), (what, [n for n, _ in whole])
    assert layers and all(isinstance(m, (ColumnParallelLoraLinear, RowParallelLoraLinear))
                          for m in layers), (what, [type(m).__name__ for m in layers])
    if family == "qwen2_moe" and order.startswith("tpx"):
        assert not whole, (what, "the completed plan splits the shared expert")
    # Sharded: every projection's base layer holds its part only.
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                for m in layers for p in m.base_layer.parameters())
    split = {n for n, m in named if type(m) is not peft.tuners.lora.Linear}
    whole_size = sum(p.numel() for n, m in ref.named_modules() if n in split
                     for p in m.base_layer.parameters())
    assert local < whole_size * (1.0 / world + 0.2), (what, local, whole_size)
    opt, ref_opt = adamw(pm), adamw(ref)
    for step in range(3):
        loss = train_step(pm, opt, step, tpx.clip_grad_norm_)
        ref_loss = train_step(ref, ref_opt, step, torch.nn.utils.clip_grad_norm_)
        assert abs(loss - ref_loss) < 1e-10, (what, step, loss, ref_loss)
    assert_state_equal(pm, ref, what + ", after 3 AdamW steps with gradient clipping")
    with pm.disable_adapter(), ref.disable_adapter():
        ids = batch(9)
        torch.testing.assert_close(pm(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=1e-10)
    merged, ref_merged = pm.merge_and_unload(), ref.merge_and_unload()
    assert not _lora_layers(merged)
    assert_state_equal(merged, ref_merged, what + ", merged")
    ids = batch(10)
    torch.testing.assert_close(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits,
                               rtol=0, atol=1e-10)


# qwen2_moe: LoRA on the attention, on layer 0's dense MLP (split by the plan) and on layer 1's
# shared expert (which Hugging Face's plan leaves whole: its LoRA layer stays peft's own).
CASES = [("llama", "peft", 2), ("llama", "tpx", 3), ("qwen2_moe", "peft", 3),
         ("qwen2_moe", "tpx+register", 2)]
SLOW_CASES = [("llama", "tpx", 2), ("llama", "peft", 3), ("qwen2_moe", "tpx", 3),
              ("qwen2_moe", "peft", 2), ("llama", "peft", 1), ("llama_gqa", "peft", 4),
              ("llama_gqa", "tpx", 4)]


@pytest.mark.parametrize("family,order,world", CASES + [
    pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES])
def test_lora_trains_like_one_device(family, order, world):
    run_ranks(_train_like_one_device, world, family, order, TARGETS, {})


@pytest.mark.parametrize("order,world", [("peft", 2), pytest.param("tpx", 3,
                                                                    marks=pytest.mark.slow)])
def test_lora_with_sequence_parallelism(order, world):
    """The adapters ride in the base layers' all-gather / reduce-scatter GEMMs."""
    run_ranks(_train_like_one_device, world, "llama", order, TARGETS, {}, True)


@pytest.mark.parametrize("family,order,targets,extra", [
    # LoRA with biases on projections that have biases (merged into them).
    ("qwen2", "peft", ["q_proj", "k_proj", "v_proj"], {"lora_bias": True}),
    # Conv1D layers (fan_in_fan_out) and a fused [q | k | v] split in segments: its B is split
    # like the segments, not as one block.
    ("gpt2", "tpx", ["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True}),
])
def test_lora_variants_of_linear(family, order, targets, extra):
    run_ranks(_train_like_one_device, 2, family, order, targets, extra)


# peft's initialisations that draw: A by kaiming_uniform_ and B zero (the default), A normal
# and B zero, A and B by nn.Linear's own init (False: B random), A and B from randn and a QR
# ("orthogonal": B random). With lora_bias=True peft takes the first and the third only.
INITS = [True, "gaussian", False, "orthogonal"]


def _draws_like_one_device(rank, world, order, layout, family, targets, extra):
    """From the same seed, get_peft_model on the sharded model (and peft's ``add_adapter``
    after it) draws the adapters one device draws: each rank holds its part of them, bit for
    bit, and the global random stream goes on as one device's."""
    import tpx
    import tpx.nn.lora

    mesh = (None if layout == "1d" else
            tpx.init_mesh(layout, **({"depth": 2} if layout == "2.5d" else {})))
    for init in [True, False] if extra.get("lora_bias") else INITS:
        what = f"{family} {order} first, {layout}, TP {world}, init_lora_weights={init!r}"

        def config():
            cfg = lora_config(targets, init_lora_weights=init, **extra)
            return tpx.nn.lora.register(cfg) if order == "tpx+register" else cfg

        model = tiny(family)
        ref = copy.deepcopy(model)
        torch.manual_seed(7)
        ref = peft.get_peft_model(ref, config())
        ref_after = torch.rand(16)
        ref.add_adapter("later", config())
        ref_later = torch.rand(16)
        if order == "peft":
            torch.manual_seed(7)
            pm = peft.get_peft_model(model, config())
            tpx.parallelize_module(pm, mesh, tpx.plans.auto(pm))
        else:
            tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout))
            torch.manual_seed(7)
            pm = peft.get_peft_model(model, config())
        assert torch.equal(torch.rand(16), ref_after), (what, "the stream after get_peft_model")
        pm.add_adapter("later", config())
        assert torch.equal(torch.rand(16), ref_later), (what, "the stream after add_adapter")
        layers = _lora_layers(pm)
        assert layers and len(layers) == len(_lora_layers(ref)), what
        assert all(type(m).__module__.startswith("tpx.") for m in layers), what
        assert_like_unsharded(pm, ref, what, rtol=0, atol=0)
        if init in (False, "orthogonal"):  # B random: the comparison saw its values
            assert all(p.abs().sum() > 0 for n, p in ref.named_parameters()
                       if ".lora_B." in n), what


@pytest.mark.parametrize("order,world,layout,family,targets,extra", [
    ("tpx", 2, "1d", "llama", TARGETS, {}), ("peft", 3, "1d", "llama", TARGETS, {}),
    # peft's shorthand for every linear layer but the head names tpx's layers too
    ("tpx", 2, "1d", "llama", "all-linear", {}),
    # B's bias random (init_lora_weights=False), split with B's rows.
    ("tpx", 3, "1d", "qwen2", ["q_proj", "k_proj", "v_proj"], {"lora_bias": True}),
    pytest.param("peft", 2, "1d", "llama", TARGETS, {}, marks=pytest.mark.slow),
    pytest.param("tpx", 3, "1d", "llama", TARGETS, {}, marks=pytest.mark.slow),
    pytest.param("tpx+register", 2, "1d", "llama", TARGETS, {}, marks=pytest.mark.slow),
    pytest.param("tpx", 4, "2d", "llama_2d", TARGETS, {}, marks=pytest.mark.slow),
    pytest.param("tpx", 8, "2.5d", "llama_2d", TARGETS, {}, marks=pytest.mark.slow)])
def test_lora_draws_like_one_device(order, world, layout, family, targets, extra):
    """torch.manual_seed(s); get_peft_model(sharded model, config) starts the adapters where
    one device starts them from the same seed, in every initialisation of peft that draws."""
    run_ranks(_draws_like_one_device, world, order, layout, family, targets, extra)


def _round_trips(rank, world, order, d):
    import torch.distributed as dist

    import tpx.checkpoint

    model = tiny("llama8" if world == 4 else "llama")
    base = copy.deepcopy(model)
    ref = one_device(copy.deepcopy(base), lora_config())
    pm = sharded_lora(model, lora_config(), order)
    opt, ref_opt = adamw(pm), adamw(ref)
    for step in range(2):
        train_step(pm, opt, step)
        train_step(ref, ref_opt, step)
    # peft's save_pretrained on every rank: each writes its part; the files are what one
    # device writes after the same steps.
    mine = pm.save_pretrained(os.path.join(d, f"tp{world}"))["default"]
    if rank == 0:
        ref.save_pretrained(os.path.join(d, f"one{world}"))
    dist.barrier()
    _assert_same_adapter_dirs(os.path.join(d, f"tp{world}"), os.path.join(d, f"one{world}"))
    total = torch.tensor([mine.bytes_written])
    dist.all_reduce(total)
    assert int(total) == _data_bytes(os.path.join(d, f"tp{world}", "adapter_model.safetensors"))
    # The full adapter gathered on rank 0 and peft's own writer: the same files.
    full = tpx.checkpoint.full_state_dict(pm, rank0_only=True)
    if rank == 0:
        pm.save_pretrained(os.path.join(d, f"full{world}"), state_dict=full)
    dist.barrier()
    _assert_same_adapter_dirs(os.path.join(d, f"full{world}"), os.path.join(d, f"one{world}"))
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), os.path.join(d, f"tp{world}"))
    ids = batch(7)
    torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=0, atol=1e-10)
    # One device -> TP, as a second adapter.
    if not SHARD_HAS_LOCAL_SIZE:  # transformers' loader needs torch >= 2.6 (torch_compat)
        with pytest.raises(AttributeError, match="local_shard_size_and_offset"):
            pm.load_adapter(os.path.join(d, f"one{world}"), adapter_name="from_one")
        return
    pm.load_adapter(os.path.join(d, f"one{world}"), adapter_name="from_one")
    pm.set_adapter("from_one")
    torch.testing.assert_close(pm(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=0, atol=1e-10)
    # Two adapters: the second in its sub-folder, as peft writes it; only the selected ones.
    pm.save_pretrained(os.path.join(d, f"both{world}"))
    pm.save_pretrained(os.path.join(d, f"second{world}"), selected_adapters=["from_one"])
    dist.barrier()
    _assert_same_adapter_dirs(os.path.join(d, f"both{world}", "from_one"),
                              os.path.join(d, f"one{world}"))
    assert sorted(os.listdir(os.path.join(d, f"second{world}"))) == ["README.md", "from_one"]
    with pytest.raises(ValueError, match="selected_adapters"):
        pm.save_pretrained(os.path.join(d, "none"), selected_adapters=["nope"])
    with pytest.raises(ValueError, match="safe_serialization=False"):
        pm.save_pretrained(os.path.join(d, "none"), safe_serialization=False)
    assert not os.path.exists(os.path.join(d, "none"))


def _data_bytes(path) -> int:
    with open(path, "rb") as f:
        head = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - head


def _assert_same_adapter_dirs(got, expected) -> None:
    """Two adapter directories hold the same adapter files: the same tensors (names, dtypes,
    values to 1e-10) and the same adapter config (the model card, README.md, is written once
    at the top of a save)."""
    import json

    from safetensors.torch import load_file

    def files(path):
        return sorted(f for f in os.listdir(path) if f.startswith("adapter_"))

    assert files(got) == files(expected) == ["adapter_config.json", "adapter_model.safetensors"]
    a = load_file(os.path.join(got, "adapter_model.safetensors"))
    b = load_file(os.path.join(expected, "adapter_model.safetensors"))
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for key in b:
        assert a[key].dtype == b[key].dtype, key
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-10, msg=key)
    with open(os.path.join(got, "adapter_config.json")) as f, \
            open(os.path.join(expected, "adapter_config.json")) as g:
        mine, theirs = json.load(f), json.load(g)

    def same(a, b):  # peft keeps target_modules as a set: its list's order is the set's
        return sorted(a) == sorted(b) if isinstance(a, list) and isinstance(b, list) else a == b

    differ = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
              if not same(mine.get(k), theirs.get(k))}
    assert not differ, differ


@pytest.mark.parametrize("order,world", [("peft", 2), ("tpx", 2),
                                         pytest.param("tpx", 3, marks=pytest.mark.slow),
                                         pytest.param("peft", 4, marks=pytest.mark.slow)])
def test_adapter_round_trips(tmp_path, order, world):
    run_ranks(_round_trips, world, order, str(tmp_path))


def _save_sharded(rank, world, d):
    import tpx.checkpoint

    pm = sharded_lora(tiny("llama"), lora_config(), "peft")
    opt = adamw(pm)
    for step in range(2):
        train_step(pm, opt, step)
    tpx.checkpoint.save(pm, d, optimizer=opt)


def _resume_sharded(rank, world, d):
    import tpx.checkpoint

    model = tiny("llama")
    ref = one_device(copy.deepcopy(model), lora_config())
    pm = sharded_lora(model, lora_config(), "tpx")
    opt = adamw(pm)
    tpx.checkpoint.load(pm, d, optimizer=opt)
    ref_opt = adamw(ref)
    for step in range(2):
        train_step(ref, ref_opt, step)
    loss, ref_loss = train_step(pm, opt, 2), train_step(ref, ref_opt, 2)
    assert abs(loss - ref_loss) < 1e-10, (loss, ref_loss)
    assert_state_equal(pm, ref, f"resumed at TP {world}, one AdamW step")


def test_checkpoint_resumes_at_another_degree(tmp_path):
    """Saved with the optimizer at TP 2 (peft first), resumed at TP 3 (tpx first)."""
    d = str(tmp_path / "ckpt")
    run_ranks(_save_sharded, 2, d)
    run_ranks(_resume_sharded, 3, d)


def _errors(rank, world):
    import tpx
    import tpx.nn.lora

    def fresh():
        return tiny("llama")

    # DoRA: refused in both orders, before anything changes.
    pm = peft.get_peft_model(fresh(), lora_config(["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="DoRA"):
        tpx.parallelize_module(pm, None, tpx.plans.auto(pm))
    model = fresh()
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    with pytest.raises(NotImplementedError, match="DoRA"):
        peft.get_peft_model(model, lora_config(["q_proj"], use_dora=True))
    # Another tuner wrapping a projection: named.
    pm = peft.get_peft_model(fresh(), peft.LoHaConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="loha"):
        tpx.parallelize_module(pm, None, tpx.plans.auto(pm))
    # LoRA on experts' parameters (peft's ParamWrapper): named.
    pm = peft.get_peft_model(tiny("qwen3_moe"), lora_config(["q_proj", "down_proj"]))
    with pytest.raises(ValueError, match="ParamWrapper"):
        tpx.parallelize_module(pm, None, tpx.plans.auto(pm))
    # A plan naming the base layer inside a LoRA layer.
    pm = peft.get_peft_model(fresh(), lora_config(["q_proj"]))
    with pytest.raises(ValueError, match="name the LoRA layer itself"):
        tpx.parallelize_module(pm, None, {
            "base_model.model.model.layers.0.self_attn.q_proj.base_layer":
                tpx.ColwiseParallel()})
    # LoRA dropout under sequence parallelism is not supported yet: refused at the call.
    pm = peft.get_peft_model(fresh(), lora_config(["q_proj", "o_proj"], lora_dropout=0.1))
    tpx.parallelize_module(pm, None, tpx.plans.auto(pm, sequence_parallel=True))
    with pytest.raises(NotImplementedError, match="lora_dropout=0"):
        pm(input_ids=batch(0))
    # peft's mixed-adapter batches.
    pm = sharded_lora(fresh(), lora_config(["q_proj"]), "peft").eval()  # peft: inference only
    with pytest.raises(NotImplementedError, match="adapter_names"):
        pm(input_ids=batch(0), adapter_names=["default", "default"])
    # A multi-dimensional layout, in either order.
    with pytest.raises(ValueError, match="layout='1d'"):
        tpx.plans.auto(peft.get_peft_model(fresh(), lora_config()), layout="2d")
    model = fresh()
    tpx.parallelize_module(model, tpx.init_mesh("2.5d", depth=2),
                           tpx.plans.auto(model, layout="2.5d"))
    with pytest.raises(NotImplementedError, match="lora_dropout must be 0"):
        peft.get_peft_model(model, lora_config(["q_proj"], lora_dropout=0.1))


def test_lora_errors():
    run_ranks(_errors, 2)


def _refuses_3d(rank, world):
    import tpx

    model = tiny("llama")
    tpx.parallelize_module(model, tpx.init_mesh("3d"), tpx.plans.auto(model, layout="3d"))
    with pytest.raises(ValueError, match="LoRA on the '3d' layout's layers"):
        peft.get_peft_model(model, lora_config(["q_proj"]))


def test_lora_refuses_the_3d_layout():
    """The 3-D layout's layers (whose output layout is not their input's) take no adapter:
    refused naming the layouts that do, on a 1 x 1 x 1 mesh."""
    run_ranks(_refuses_3d, 1)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 40)
        self.down = torch.nn.Linear(40, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _no_collective_of_its_own(rank, world):
    import tpx

    torch.manual_seed(0)
    mlp = _MLP().double()
    ref = one_device(copy.deepcopy(mlp), lora_config(["up", "down"]))
    pm = one_device(mlp, lora_config(["up", "down"]))
    tpx.parallelize_module(pm, None, {"base_model.model.up": tpx.ColwiseParallel(),
                                      "base_model.model.down": tpx.RowwiseParallel()})
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    def run(model, inp):
        with tpx.comm_stats() as stats:
            model(inp).square().sum().backward()
        return stats

    with pm.disable_adapter():
        base = run(pm, x.detach().clone().requires_grad_())
    lora = run(pm, x)
    run(ref, x_ref)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    assert_like_unsharded(pm, ref, "MLP with LoRA", grad=True, rtol=0, atol=1e-12)
    # The same collectives as the base layers, each r = 4 columns of 10 tokens wider.
    assert lora.calls() == base.calls() == 2, (lora, base)
    assert lora.bytes() - base.bytes() == 2 * 10 * 4 * 8, (lora, base)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_lora_adds_no_collective(world):
    """Column -> row with LoRA on both: one all-reduce forward (the row layer's) and one
    backward (the column layer's), as without the adapters, each carrying r more columns."""
    run_ranks(_no_collective_of_its_own, world)


def _sequence_parallel_mlp(rank, world):
    import tpx
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    mlp = _MLP().double()
    ref = one_device(copy.deepcopy(mlp), lora_config(["up", "down"]))
    pm = one_device(mlp, lora_config(["up", "down"]))
    tpx.parallelize_module(pm, None, {
        "base_model.model.up": tpx.ColwiseParallel(input_layouts=Shard(1)),
        "base_model.model.down": tpx.RowwiseParallel(output_layouts=Shard(1))})
    x_ref = torch.randn(2, 4 * world, 16, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach()[:, 4 * rank:4 * (rank + 1)].clone().requires_grad_()  # this rank's block
    y, y_ref = pm(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref[:, 4 * rank:4 * (rank + 1)], rtol=0, atol=1e-12)
    weights = torch.randn_like(y_ref)
    (y * weights[:, 4 * rank:4 * (rank + 1)]).sum().backward()
    (y_ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad[:, 4 * rank:4 * (rank + 1)], rtol=0,
                               atol=1e-12)
    assert_like_unsharded(pm, ref, "sequence-parallel MLP with LoRA", grad=True, rtol=0,
                          atol=1e-12)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_lora_sequence_parallel_layers(world):
    """Column layer with a sequence-sharded input (A in its all-gather GEMM) and row layer
    with a sequence-sharded output (A in its GEMM + reduce-scatter), against one device."""
    run_ranks(_sequence_parallel_mlp, world)


def _dcp_save(rank, world, d):
    import torch.distributed.checkpoint as dcp

    pm = sharded_lora(tiny("llama"), lora_config(), "peft")
    opt = adamw(pm)
    for step in range(2):
        train_step(pm, opt, step)
    dcp.save(pm.state_dict(), checkpoint_id=d)


def _dcp_load(rank, world, d):
    import torch.distributed.checkpoint as dcp

    model = tiny("llama")
    ref = one_device(copy.deepcopy(model), lora_config())
    ref_opt = adamw(ref)
    for step in range(2):
        train_step(ref, ref_opt, step)
    pm = sharded_lora(model, lora_config(), "tpx")
    state = pm.state_dict()
    dcp.load(state, checkpoint_id=d)
    pm.load_state_dict(state)
    assert_state_equal(pm, ref, f"torch.distributed.checkpoint, TP 2 -> TP {world}")


def test_dcp_of_state_dict_at_another_degree(tmp_path):
    """PyTorch's own door: dcp.save(model.state_dict()) at TP 2 (peft first), dcp.load into
    the model at TP 3 (tpx first): every parameter, adapters included, as on one device."""
    run_ranks(_dcp_save, 2, str(tmp_path / "dcp"))
    run_ranks(_dcp_load, 3, str(tmp_path / "dcp"))


PEFT_AFTER = """
import os, sys
import torch, torch.distributed as dist, transformers
import tpx
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2))
tpx.parallelize_module(model, None, tpx.plans.auto(model))
assert "peft" not in sys.modules and "tpx.nn.lora" not in sys.modules
import peft
assert "tpx.nn.lora" in sys.modules
pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "o_proj"]))
attn = pm.base_model.model.model.layers[0].self_attn
print(type(attn.q_proj).__name__, type(attn.o_proj).__name__)
"""


def test_peft_imported_after_sharding():
    """peft imported only after tpx sharded the model: get_peft_model still wraps tpx's layers
    with tpx's LoRA layers, with no register step (a fresh interpreter)."""
    import subprocess
    import sys

    from harness import free_port

    r = subprocess.run([sys.executable, "-c", PEFT_AFTER % free_port()], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ColumnParallelLoraLinear", "RowParallelLoraLinear"], r.stdout
