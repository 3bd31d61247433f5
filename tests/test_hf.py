"""Hugging Face models (tiny configs, random weights, nothing downloaded) sharded with
``tpx.plans.auto`` + ``tpx.parallelize_module``: logits, loss and every gradient equal the
unsharded model; one SGD step, then ``full_state_dict`` equals the unsharded state."""

import copy

import pytest
import torch

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks

transformers = pytest.importorskip("transformers")

V = 1003  # does not divide by 2, 3 or 4


def tiny(family: str, **overrides):
    """A tiny randomly initialised causal LM of ``family`` (fp32, no dropout)."""
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config}[family]
        kw = dict(vocab_size=V, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
        kw.update(overrides)
        config = cls(**kw)
    elif family == "gpt2":
        kw = dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        kw.update(overrides)
        config = transformers.GPT2Config(**kw)
    elif family == "gpt_neox":
        kw = dict(vocab_size=V, hidden_size=64, intermediate_size=120, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                  hidden_dropout=0.0, attention_dropout=0.0)
        kw.update(overrides)
        config = transformers.GPTNeoXConfig(**kw)
    elif family == "phi3":  # its plan gathers the attention's and the MLP's projections
        import hf_tiny

        config = hf_tiny.tiny_config(family, vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attention_dropout=0.0, **overrides)
    else:
        raise ValueError(family)
    return transformers.AutoModelForCausalLM.from_config(config)


def _grad_check(model, ref, what):
    assert_like_unsharded(model, ref, what, grad=True, rtol=1e-4, atol=2e-5)


def _check_family(rank, world, family, sp, lp, seq=16):
    what = f"{family} TP={world} sp={sp} lp={lp} seq={seq}"
    torch.manual_seed(0)
    ref = tiny(family)
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=sp,
                                                       loss_parallel=lp))
    torch.manual_seed(1 + rank * 0)  # the same batch on every rank
    ids = torch.randint(0, V, (2, seq))
    labels = ids.clone()
    labels[0, :3] = -100
    out_ref = ref(input_ids=ids, labels=labels)
    if lp:
        with tpx.loss_parallel():
            out = model(input_ids=ids, labels=labels)
        start, end = tpx.shard_range(V)
        torch.testing.assert_close(out.logits, out_ref.logits[..., start:end], rtol=1e-4,
                                   atol=1e-5, msg=lambda m: f"logits ({what}): {m}")
    else:
        out = model(input_ids=ids, labels=labels)
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"logits ({what}): {m}")
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"loss ({what}): {m}")
    out_ref.loss.backward()
    out.loss.backward()
    _grad_check(model, ref, what)

    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    full = tpx.checkpoint.full_state_dict(model)
    ref_state = ref.state_dict()
    assert set(full) == set(ref_state), what
    for key, value in ref_state.items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"state {key} ({what}): {m}")
    # The full state loads into a differently initialised sharded copy and reproduces it.
    torch.manual_seed(7)
    other = tiny(family)
    tpx.parallelize_module(other, None, tpx.plans.auto(other, sequence_parallel=sp,
                                                       loss_parallel=lp))
    tpx.checkpoint.load_full_state_dict(other, ref_state)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_llama_gqa(world):
    # 8 query heads, 2 KV heads: at TP 4 every KV head is replicated on two ranks.
    run_ranks(_check_family, world, "llama", False, world == 2)


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_llama_family_sequence_and_loss_parallel(family):
    run_ranks(_check_family, 4 if family == "llama" else 2, family, True, True)


def test_sequence_parallel_over_gathered_blocks():
    """Phi-3, whose Hugging Face plan gathers the outputs of its fused qkv and gate / up
    projections (the heads whole on every rank) and splits the input of o_proj and down_proj:
    under sequence parallelism both blocks run on the real positions (15, padded to 16
    between them) and their row-parallel ends reduce-scatter."""
    run_ranks(_check_family, 2, "phi3", True, True, 15)


def test_mistral():
    run_ranks(_check_family, 2, "mistral", False, False)


@pytest.mark.parametrize("world,lp", [(2, False), (2, True),
                                       pytest.param(4, False, marks=pytest.mark.slow)])
def test_gpt2_tied_conv1d(world, lp):
    run_ranks(_check_family, world, "gpt2", False, lp)


def _check_gpt2_tied(rank, world):
    torch.manual_seed(0)
    model = tiny("gpt2")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.h[0].attn.c_attn, tpx.ColumnParallelLinear)
    assert model.transformer.h[0].attn.split_size == 64 // world


def test_gpt2_stays_tied():
    run_ranks(_check_gpt2_tied, 2)


@pytest.mark.parametrize("world,lp", [(2, False), (4, True)])
def test_gpt_neox(world, lp):
    run_ranks(_check_family, world, "gpt_neox", False, lp)


def _check_bad(rank, world):
    torch.manual_seed(0)
    # heads that do not divide the TP size are dealt unevenly (tests/test_uneven_heads.py):
    # 6 heads at TP 4 as 2,2,1,1; 12 over 3 KV heads as 2,2 (KV head 0 on 2 ranks), 4, 4
    for heads, kv in ((6, 6), (12, 3)):
        ref = tiny("llama", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=48)
        model = copy.deepcopy(ref)
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
        ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=2e-5)
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="matches no module"):
        tpx.parallelize_module(model, None, {"transformer.h.*.attn.q_proj":
                                             tpx.ColwiseParallel()}, strict=True)
    # no plan shipped, and fewer heads than ranks: the derived plan leaves the attention
    # whole, saying so, and splits the rest
    bert = transformers.AutoModel.from_config(transformers.BertConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32)).eval()
    ref = copy.deepcopy(bert)
    with pytest.warns(UserWarning, match=r"(?s)BertModel cannot be split over TP size 4.*2 "
                                         r"attention heads, fewer than the TP size 4.*"
                                         r"encoder.layer.0.attention"):
        tpx.parallelize_module(bert, None, tpx.plans.auto(bert))
    attn = bert.encoder.layer[0].attention.self
    assert not hasattr(attn.query.weight, "to_local") or (
        attn.query.weight.to_local().shape == attn.query.weight.shape)
    assert type(bert.encoder.layer[0].intermediate.dense).__module__.startswith("tpx")
    ids = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(bert(ids).last_hidden_state, ref(ids).last_hidden_state,
                               rtol=1e-4, atol=2e-5)


def test_bad_hf_plans():
    run_ranks(_check_bad, 4)


# ------------------------------------------------------------------ generation, uneven sequences

def _check_generate(rank, world, family):
    """Greedy ``generate()`` equals one device token for token with every 1-D plan: plain,
    loss-parallel (vocab-sharded logits), and for the Llama family sequence-parallel (prompts
    of 7 tokens and one-token decoding steps, neither a multiple of the TP size) and both; with
    and without a left-padded attention mask."""
    torch.manual_seed(0)
    ref = tiny(family)
    ref.generation_config.eos_token_id = None  # every row generates all its tokens
    ref.generation_config.pad_token_id = 0
    ids = torch.randint(3, V, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 is left-padded
    expected = [ref.generate(ids, max_new_tokens=5, do_sample=False),
                ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)]
    cases = [(False, False), (False, True)]
    if family in ("llama", "mistral", "qwen2"):  # the plans with sequence parallelism
        cases += [(True, False), (True, True)]
    for sp, lp in cases:
        model = copy.deepcopy(ref)
        tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=sp,
                                                           loss_parallel=lp))
        got = [model.generate(ids, max_new_tokens=5, do_sample=False),
               model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)]
        for g, e, m in zip(got, expected, ("no mask", "left-padded mask")):
            assert torch.equal(g, e), (f"{family} TP={world} sp={sp} lp={lp} {m}, rank {rank}:"
                                       f"\n{g.tolist()}\nexpected\n{e.tolist()}")
        if lp:  # outside generate() the logits stay vocab-sharded for tpx.loss_parallel()
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            assert logits.shape[-1] == tpx.shard_range(V)[1] - tpx.shard_range(V)[0]


@pytest.mark.parametrize("family,world", [("llama", 2),
                                          pytest.param("qwen2", 4, marks=pytest.mark.slow),
                                          ("gpt2", 2), ("gpt_neox", 2)])
def test_generate_like_one_device(family, world):
    run_ranks(_check_generate, world, family)


def test_sequence_parallel_uneven_sequence():
    # 15 and 31 positions at TP 2 (padded to 16 / 32 inside the decoder layers): logits, loss,
    # gradients, one step and the checkpoint equal the unsharded model.
    run_ranks(_check_family, 2, "llama", True, True, 15)
    run_ranks(_check_family, 2, "qwen2", True, False, 31)


def _check_uneven_errors(rank, world):
    from tiny_llama import Decoder

    # A plain-tensor split that the way back could not undo: a clear error on every rank.
    layer = torch.nn.Linear(8, 8)
    tpx.parallelize_module(layer, None, tpx.PrepareModuleInput(
        input_layouts=(tpx.Replicate(),), desired_input_layouts=(tpx.Shard(1),)))
    with pytest.raises(ValueError, match=r"size 15\) does not divide by the group size 2.*pad"):
        layer(torch.randn(2, 15, 8))
    # The plain decoder's plan says the same.
    torch.manual_seed(0)
    model = Decoder(vocab=V, n_layers=1)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=True))
    with pytest.raises(ValueError, match="pad the sequence"):
        model(torch.randint(0, V, (2, 15)))


def test_uneven_sequence_errors():
    run_ranks(_check_uneven_errors, 2)


# ------------------------------------------------------------------ multi-dimensional layouts

def _check_mesh_token_inputs(rank, world, layout):
    """2-D / 2.5-D / 3-D plans take every per-token input Hugging Face passes in the batch
    order of the layer that reads it: a left-padded attention mask, packed sequences (explicit
    position_ids), both; and greedy generate() with a left-padded mask, with and without
    loss_parallel=True."""
    mesh = tpx.init_mesh(layout, **({"depth": 2} if layout == "2.5d" else {}))
    torch.manual_seed(0)
    # Sizes divide by the 3-D q^2 = 4 (batch, vocabulary, MLP width).
    ref = tiny("llama", vocab_size=1000, hidden_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 1000, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 3), (2, 1), (3, 6)):  # left padding, different in every row
        mask[row, :pad] = 0
    packed = torch.tensor([list(range(4)) + list(range(6)), list(range(10)),
                           list(range(7)) + list(range(3)), list(range(5)) * 2])
    what = f"HF Llama {layout} rank {rank}"
    for kwargs, name in ((dict(attention_mask=mask), "left-padded mask"),
                         (dict(position_ids=packed), "packed sequences"),
                         (dict(attention_mask=mask, position_ids=packed), "mask and positions")):
        with torch.no_grad():
            expected = ref(input_ids=ids, **kwargs).logits
            got = model(input_ids=ids, **kwargs).logits
        keep = mask.bool() if "attention_mask" in kwargs else torch.ones_like(mask, dtype=bool)
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{what} {name}: {m}")
    out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, out_ref), f"{what} generate:\n{out.tolist()}\n{out_ref.tolist()}"
    # With the logits kept in the layout's blocks for the loss: full logits in generate() only.
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout, loss_parallel=True))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, out_ref), (f"{what} generate (loss_parallel):\n{out.tolist()}\n"
                                       f"{out_ref.tolist()}")
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] < 1000  # still blocks outside generate()


@pytest.mark.parametrize("layout,world", [("2d", 4), pytest.param("2.5d", 8, marks=pytest.mark.slow),
                                          pytest.param("3d", 8, marks=pytest.mark.slow)])
def test_mesh_plans_masks_and_positions(layout, world):
    run_ranks(_check_mesh_token_inputs, world, layout)
