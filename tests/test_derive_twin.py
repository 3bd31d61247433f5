"""Plans for models that ship none, derived on the model's twins and carried to a model on
the meta device (tpx.parallel.derive_twin): the carried plan equals the plan derived on the
model itself, checkpoints load sharded and train equal to one device, and a model it cannot
carry gets a clear error."""

import copy
import os
import sys

import pytest
import torch
import transformers

import tpx
from harness import assert_like_unsharded, run_ranks
from tpx.parallel.unit_styles import UnitColwise

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny  # noqa: E402


def _rows(plan, world):
    """Pattern -> every rank's rows, for the derived column-parallel entries of ``plan``."""
    from tpx.parallel.derive import layer_pattern as _pattern

    out = {}
    for key, st in plan.items():
        if isinstance(st, UnitColwise):
            out.setdefault(_pattern(key), st.pair.rank_rows(st.source, world))
    return out


@pytest.mark.parametrize("mt,overrides", [
    ("opt", dict(hidden_size=96, ffn_dim=160, num_attention_heads=12, num_hidden_layers=2,
                 word_embed_proj_dim=96, vocab_size=500)),
    ("falcon", dict(hidden_size=96, num_attention_heads=6, num_hidden_layers=2,
                    vocab_size=500, multi_query=True)),
    ("gpt_bigcode", dict(n_embd=96, n_head=6, n_layer=2, n_inner=200, vocab_size=500)),
])
def test_carried_plan_equals_the_plan_derived_on_the_model(mt, overrides):
    # a model of neither twin's sizes: its own trace gives the reference rows
    cfg = transformers.AutoConfig.for_model(mt, **overrides)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    own = tpx.plans.derive(model)
    with torch.device("meta"):
        on_meta = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
    carried = tpx.plans.auto(on_meta)
    from tpx.parallel.derive_twin import TwinDerivedPlan

    assert isinstance(carried, TwinDerivedPlan)
    for world in (2, 3, 6):
        try:
            want = _rows(own, world)
        except ValueError:  # heads that do not divide: the carried plan refuses alike
            with pytest.raises(ValueError):
                _rows(carried, world)
            continue
        assert _rows(carried, world) == want, world


def _load_like_one_device(rank, world, path, mt):
    ref, model = hf_tiny.written_and_loaded(mt, path)
    model.train()
    split = [p for p in model.parameters()
             if (p.to_local() if hasattr(p, "to_local") else p).numel() < p.numel()]
    assert split, "nothing was split"
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    ref.train()
    for step in range(2):
        ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(step))
        out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4,
                                   atol=2e-5 if step == 0 else 1e-4)
        out.loss.backward()
        out_ref.loss.backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("mt", ["bloom", "falcon", "gpt_bigcode",
                                "ctrl"])  # CTRL: a Sequential inside each layer
def test_from_pretrained_without_a_plan(tmp_path, mt):
    run_ranks(_load_like_one_device, 2, str(tmp_path / mt), mt)


def _load_split_like_one_device(rank, world, path, mt, must_split):
    ref, model = hf_tiny.written_and_loaded(mt, path)
    full = {n: p.numel() for n, p in ref.named_parameters()}
    for part in must_split.split(","):
        split = [n for n, p in model.named_parameters() if part in n
                 and (p.to_local() if hasattr(p, "to_local") else p).numel() < full[n]]
        assert split, (part, "is whole")
    if mt == "git":  # its loss needs an image: one step with one
        ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(0))
        batch = hf_tiny.image_batch(ref, ids, torch.Generator().manual_seed(1))
        assert batch is not None and "pixel_values" in batch
        out, out_ref = model(**batch), ref(**batch)
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=2e-5)
        out.loss.backward()
        out_ref.loss.backward()
        assert_like_unsharded(model, ref, "git", grad=True, rtol=1e-4, atol=1e-6)
        return
    _load_like_one_device(rank, world, path + "-again", mt)


@pytest.mark.parametrize("mt,must_split", [
    # a layer holds an attention or a recurrent block at one name; the RG-LRU's width
    ("recurrent_gemma", "mlp_block.down_proj"),
    # widths its config derives (the Mamba head dim) derived again on the wide twin
    ("zamba2", "mamba.in_proj"),
    # gate weights initialised to zero: drawn on the twin, so the trace sees them
    ("xlstm", "ffn.proj_down"),
    # its forward does not run in float64: twins in float32
    ("xglm", "self_attn.k_proj"),
    # a frozen table of positions read by every attention: a constant, not an embedding
    ("roformer", "attention.self.query"),
    # an image before the tokens with no image token (the proof's batch has one), and a mask
    # made like the hidden states (no dependence on their values)
    ("git", "image_encoder.vision_model.encoder.layers.0.mlp.fc1,"
            "git.encoder.layer.0.attention.self.query"),
])
def test_twins_of_hybrids_and_odd_configs(tmp_path, mt, must_split):
    run_ranks(_load_split_like_one_device, 2, str(tmp_path / mt), mt, must_split)


def test_layers_of_several_plans_carried_by_name(tmp_path):
    # Gemma 3n: its shipped plan, completed (its sparse-activation MLPs split with their
    # statistic over the ranks; its later layers' attention reads the KV of earlier ones)
    run_ranks(_load_like_one_device, 2, str(tmp_path / "g3n"), "gemma3n_text")


def _step_like_one_device(model, ref, what):
    """One forward and backward of a random batch: logits and every gradient (this rank's
    part of the split ones) against the unsharded model."""
    ids = torch.randint(3, hf_tiny.V, (2, 9), generator=torch.Generator().manual_seed(0))
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=2e-5)
    out.loss.backward()
    out_ref.loss.backward()
    assert_like_unsharded(model, ref, what, grad=True, rtol=1e-4, atol=1e-6)


def _gemma3n_more_layers_than_its_twin(rank, world, path):
    import torch.distributed as dist

    # 10 layers of 6 kinds (sliding / full attention, sparse / dense activations, KV shared
    # or not): the twin keeps 6, and the entries only some of them have (the later
    # layers' MLPs split, the first ones' whole; the KV-sharing layers' attention without
    # its own k and v) are carried to each layer by its kind
    layout = dict(num_hidden_layers=10, intermediate_size=[88] * 10,
                  layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
                  activation_sparsity_pattern=[0.95] * 3 + [0.0] * 7, num_kv_shared_layers=4)
    torch.manual_seed(0)
    ref = hf_tiny.tiny("gemma3n_text", **layout)
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    # the plan derived on the twins of the model built on the meta device (its own plan, which
    # splits every MLP with its statistic over the ranks, set aside)
    from tpx.parallel.derive_twin import derive_on_twins

    with torch.device("meta"):
        shell = hf_tiny.auto_class("gemma3n_text").from_config(copy.deepcopy(ref.config))
    plan = derive_on_twins(shell)
    model = tpx.from_pretrained(path, dtype=torch.float32, config=copy.deepcopy(ref.config),
                                model_class=hf_tiny.auto_class("gemma3n_text"), plan=plan)
    full = {n: p.numel() for n, p in ref.named_parameters()}

    def split(n):
        p = model.get_parameter(n)
        return (p.to_local() if hasattr(p, "to_local") else p).numel() < full[n]

    assert not split("model.layers.0.mlp.gate_proj.weight")  # sparse activations: whole
    assert split("model.layers.5.mlp.gate_proj.weight") and split(
        "model.layers.9.mlp.down_proj.weight")
    _step_like_one_device(model, ref, "gemma3n, 10 layers")


def test_entries_of_some_layers_carried_by_kind(tmp_path):
    run_ranks(_gemma3n_more_layers_than_its_twin, 2, str(tmp_path / "g3n10"))


def _layers_of_two_kinds(rank, world, path):
    """Inkling with 7 layers: sliding ones of 4 KV heads and a full one (layer 5) of 2, every
    MLP a mixture of experts. Its twin keeps one layer of each kind and adds a dense MLP (for
    checkpoints that have them): the dense MLP's entries, a kind the model lacks, are dropped
    (the model was refused), and each attention takes its own kind's entry (the sliding
    layers' entry on the full layer put its KV rows out of range). The proof then leaves the
    attention whole (its short convolutions over k and v are not split with them); the
    experts are split, and the model equals one device."""
    import torch.distributed as dist

    layout = dict(num_hidden_layers=7, num_attention_heads=8, swa_num_attention_heads=8,
                  num_key_value_heads=2, swa_num_key_value_heads=4, mlp_layer_types=None,
                  layer_types=None)
    torch.manual_seed(0)
    ref = hf_tiny.tiny("inkling_text", **layout)
    assert ref.config.layer_types[5] != ref.config.layer_types[4]
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tpx.from_pretrained(path, dtype=torch.float32, config=copy.deepcopy(ref.config),
                                model_class=hf_tiny.auto_class("inkling_text"))
    for i in (4, 5):
        e = model.model.layers[i].mlp.experts.down_proj
        whole = ref.model.layers[i].mlp.experts.down_proj
        assert (e.to_local() if hasattr(e, "to_local") else e).numel() < whole.numel(), i
    _step_like_one_device(model, ref, "inkling, 7 layers")


def test_layers_of_two_kinds_and_a_kind_the_model_lacks(tmp_path):
    run_ranks(_layers_of_two_kinds, 2, str(tmp_path / "inkling7"))


@pytest.mark.slow
@pytest.mark.parametrize("mt,world", [("opt", 4), ("mpt", 4), ("bert-generation", 2),
                                      ("gpt_neo", 4), ("bloom", 4), ("falcon", 4)])
def test_from_pretrained_without_a_plan_slow(tmp_path, mt, world):
    run_ranks(_load_like_one_device, world, str(tmp_path / mt), mt)


def test_a_model_whose_twin_cannot_be_built_is_a_clear_error(monkeypatch):
    from tpx.parallel import derive_twin

    def broken(model, dtype=torch.float64):
        raise RuntimeError("no twin here")

    monkeypatch.setattr(derive_twin, "twin", broken)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model("opt"))
    with pytest.raises(ValueError, match=r"(?s)ships no TP plan.*twins of the model.*"
                                         r"no twin here.*from_pretrained"):
        tpx.plans.auto(model)
