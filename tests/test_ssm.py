"""Mamba-2 mixers split by heads (tpx.parallel.ssm.Mamba2Parallel), added by the completed
plans of the hybrids built on them (Bamba, Falcon-H1, Nemotron-H, GraniteMoE-hybrid), and their
gated norm over features split across ranks (tpx.nn.ssm.GatedRMSNormParallel); Mamba-1 mixers
split by channels (tpx.parallel.ssm.Mamba1Parallel: Jamba, Mamba, Falcon-Mamba); Gated
DeltaNet linear attention split by heads (tpx.parallel.delta_net.GatedDeltaNetParallel:
OLMo-hybrid); LFM2's short convolution split by channels
(tpx.parallel.short_conv.ShortConvParallel: LFM2, LFM2-MoE, LFM3); each against the unsharded
computation."""

import copy
import os
import sys

import pytest
import torch

import tpx
from harness import assert_like_unsharded, local_part, run_ranks

sys.path.insert(0, os.path.dirname(__file__))
import hf_tiny  # noqa: E402
from test_hf_zoo import _batch, _train_like_unsharded  # noqa: E402

transformers = pytest.importorskip("transformers")


def _mixers(model):
    from tpx.parallel.ssm import is_mamba2_mixer

    return [(n, m) for n, m in model.named_modules() if is_mamba2_mixer(m)]


def _step_like_one_device(model, ref, what):
    """One forward and backward of the sharded ``model`` and the unsharded ``ref``: logits
    and every gradient equal (float64; the models' norms compute in float32, hence the
    tolerances)."""
    ids, labels = _batch(0)
    out, out_ref = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-6, atol=1e-7)
    out.loss.backward()
    out_ref.loss.backward()
    assert_like_unsharded(model, ref, what, grad=True, rtol=1e-5, atol=1e-7)


def _split_like_one_device(rank, world, arch, overrides):
    """The mixers' parts hold this rank's rows; logits and every gradient equal one device's
    (float64; the models' norms compute in float32, hence the tolerances)."""
    torch.manual_seed(0)
    ref = hf_tiny.tiny(arch, **overrides).double()
    model = copy.deepcopy(ref)
    plan = tpx.plans.auto(model)
    assert any(g.startswith("mixer ") for g in plan.completion.groups), plan.completion.left
    tpx.parallelize_module(model, None, plan)
    mixers = _mixers(ref)
    assert mixers
    for name, whole in mixers:
        m = model.get_submodule(name)
        heads = whole.num_heads
        assert m.A_log.shape[0] < heads and \
            local_part(m.in_proj.weight).shape[0] < whole.in_proj.out_features
        assert local_part(m.out_proj.weight).shape[1] == m.intermediate_size == \
            m.num_heads * m.head_dim
    _step_like_one_device(model, ref, f"{arch} TP {world}")


@pytest.mark.parametrize("arch,world,overrides", [
    ("bamba", 2, {}),  # one group of B/C on both ranks; the norm's group spans them
    # 6 heads at TP 4: 2, 2, 1, 1 heads; two groups, each on two ranks
    ("bamba", 4, dict(mamba_n_heads=6, mamba_n_groups=2, hidden_size=48, mamba_d_head=16)),
    pytest.param("falcon_h1", 4, {}, marks=pytest.mark.slow),  # its multipliers per row
    pytest.param("nemotron_h", 2, {}, marks=pytest.mark.slow),  # a group on each rank
    pytest.param("granitemoehybrid", 4, {}, marks=pytest.mark.slow)])
def test_mixers_split_by_heads(arch, world, overrides):
    run_ranks(_split_like_one_device, world, arch, overrides)


@pytest.mark.parametrize("arch,world", [
    ("bamba", 2), pytest.param("bamba", 4, marks=pytest.mark.slow),
    pytest.param("falcon_h1", 2, marks=pytest.mark.slow),
    pytest.param("nemotron_h", 4, marks=pytest.mark.slow)])
def test_hybrids_train_like_one_device(arch, world):
    # three AdamW steps: logits, loss, every gradient and every parameter against one device
    run_ranks(_train_like_unsharded, world, arch, False, False)


def _norm_over_ranks(rank, world):
    from tpx.comm.groups import balanced_bounds
    from tpx.nn.ssm import GatedRMSNormParallel

    features, group_size = 24, 12  # two groups; 24 features over 3 ranks: 8 each
    g = torch.Generator().manual_seed(0)
    # float32: the norm computes in float32 whatever its input (as the models' own)
    x = torch.randn(2, 5, features, generator=g, requires_grad=True)
    z = torch.randn(2, 5, features, generator=g, requires_grad=True)
    w = torch.randn(features, generator=g, requires_grad=True)
    for before in (False, True):
        xs = x * torch.nn.functional.silu(z) if not before else x
        groups = xs.view(2, 5, 2, group_size)
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)).view_as(x) * w
        if before:
            y = y * torch.nn.functional.silu(z)
        grads = torch.autograd.grad(y.pow(2).sum(), (x, z, w))
        cols = [balanced_bounds(features, r, world) for r in range(world)]
        s, e = cols[rank]
        part = torch.nn.Parameter(w.detach()[s:e].clone())
        norm = GatedRMSNormParallel(part, cols=cols, features=features, group_size=group_size,
                                    eps=1e-5, group=torch.distributed.group.WORLD,
                                    norm_before_gate=before, cast_before_weight=not before)
        assert not norm.local  # rank 1's features cross the groups' boundary
        xl = x.detach()[..., s:e].clone().requires_grad_()
        zl = z.detach()[..., s:e].clone().requires_grad_()
        yl = norm(xl, zl)
        torch.testing.assert_close(yl, y.detach()[..., s:e], rtol=1e-5, atol=1e-6)
        # the loss is the sum over ranks of each rank's part
        gl = torch.autograd.grad(yl.pow(2).sum(), (xl, zl, part))
        for got, want in zip(gl, (grads[0][..., s:e], grads[1][..., s:e], grads[2][s:e])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gated_norm_over_features_split_across_ranks():
    run_ranks(_norm_over_ranks, 3)


def _fused_kernel_refused(rank, world):
    import importlib

    torch.manual_seed(0)
    model = hf_tiny.tiny("bamba")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    modeling = importlib.import_module(type(model.model.layers[0].mamba).__module__)
    fused = modeling.mamba2_split_conv1d_scan_combined
    # a fused kernel returns the mixer's output without calling its out_proj
    modeling.mamba2_split_conv1d_scan_combined = lambda zxbcdt, *a, **k: zxbcdt[..., :64]
    try:
        model.train()
        with pytest.raises(RuntimeError, match="without calling its out_proj"):
            model(input_ids=torch.tensor([[5, 6, 7]]))
    finally:
        modeling.mamba2_split_conv1d_scan_combined = fused
    ids = torch.tensor([[5, 6, 7]])
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size  # works again


def test_a_fused_kernel_on_local_weights_is_refused():
    run_ranks(_fused_kernel_refused, 2)


def test_mixer_sizes_that_do_not_fit_are_refused():
    from tpx.parallel.ssm import mamba2_rows

    torch.manual_seed(0)
    mixer = _mixers(hf_tiny.tiny("bamba"))[0][1]
    with pytest.raises(ValueError, match="8 heads in 1 groups at TP size 16"):
        mamba2_rows(mixer, 16)
    mixer.num_heads = 4  # its parts say 8
    with pytest.raises(ValueError, match=r"num_heads \* head_dim = 64, not intermediate_size"):
        mamba2_rows(mixer, 2)


def _loaded_and_saved(rank, world, d, arch):
    import torch.distributed as dist

    from test_plain_loop import _assert_same_files

    one, tp = os.path.join(d, "one"), os.path.join(d, "tp")
    # built on the meta device: the completed plan proved on the model's twin
    ref, model = hf_tiny.written_and_loaded(arch, one)
    path = _MIXER.get(arch, "model.layers.0.mamba")
    proj = "q_proj" if arch == "olmo_hybrid" else "in_proj"  # (LFM3's conv: in_proj too)
    mixer, whole = model.get_submodule(path), getattr(ref.get_submodule(path), proj)
    assert local_part(getattr(mixer, proj).weight).shape[0] < whole.out_features
    ids, _ = _batch(1)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                               rtol=1e-4, atol=2e-5)
    model.save_pretrained(tp)  # every rank writes its part
    dist.barrier()
    _assert_same_files(tp, one, f"{arch} TP {world}", atol=0)


_MIXER = {"mamba": "backbone.layers.0.mixer", "olmo_hybrid": "model.layers.0.linear_attn",
          "lfm3": "model.layers.0.conv"}


@pytest.mark.parametrize("arch,world", [
    ("bamba", 2), pytest.param("bamba", 4, marks=pytest.mark.slow),
    pytest.param("falcon_h1", 2, marks=pytest.mark.slow),  # its mup_vector set whole on load
    ("mamba", 3),  # Mamba-1 mixers: the plan derived on twins, channels 3 ways
    ("olmo_hybrid", 3),  # Gated DeltaNet: 4 key heads 3 ways, proved on the twin
    ("lfm3", 2)])  # LFM3's short convolution by channels
def test_hybrid_loads_and_saves_with_its_mixers_split(tmp_path, arch, world):
    run_ranks(_loaded_and_saved, world, str(tmp_path), arch)


def _mamba1_split_like_one_device(rank, world, arch):
    """Mamba-1 mixers (tpx.parallel.ssm.Mamba1Parallel) hold this rank's channels: in a
    completed plan (Jamba ships one) and a derived one (Mamba, Falcon-Mamba ship none);
    logits and every gradient equal one device's (float64)."""
    from tpx.parallel.ssm import is_mamba1_mixer

    torch.manual_seed(0)
    ref = hf_tiny.tiny(arch).double()
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    mixers = [(n, m) for n, m in ref.named_modules() if is_mamba1_mixer(m)]
    assert mixers
    lo, hi = tpx.shard_range(mixers[0][1].intermediate_size)
    for name, whole in mixers:
        m = model.get_submodule(name)
        i = whole.intermediate_size
        assert m.intermediate_size == i // world + (rank < i % world)
        assert local_part(m.in_proj.weight).shape[0] == 2 * m.intermediate_size
        assert m.A_log.shape[0] == m.D.shape[0] == local_part(m.dt_proj.weight).shape[0] == \
            m.conv1d.weight.shape[0] == local_part(m.x_proj.weight).shape[1] == \
            local_part(m.out_proj.weight).shape[1] == m.intermediate_size
    _step_like_one_device(model, ref, f"{arch} TP {world}")


@pytest.mark.parametrize("arch,world", [("jamba", 2), ("mamba", 3),
                                        pytest.param("falcon_mamba", 2,
                                                     marks=pytest.mark.slow)])
def test_mamba1_mixers_split_by_channels(arch, world):
    run_ranks(_mamba1_split_like_one_device, world, arch)


def _delta_net_split_like_one_device(rank, world, overrides):
    """OLMo-hybrid's Gated DeltaNet layers (completed into its plan) hold this rank's heads:
    logits and every gradient equal one device's (float64); with fewer key heads than ranks
    the layer stays whole, said, and the rest is split."""
    import warnings

    from tpx.parallel.delta_net import is_gated_delta_net

    torch.manual_seed(0)
    ref = hf_tiny.tiny("olmo_hybrid", **overrides).double()
    model = copy.deepcopy(ref)
    plan = tpx.plans.auto(model)
    assert "mixer model.layers.*.linear_attn" in plan.completion.groups, plan.completion.left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tpx.parallelize_module(model, None, plan)
    layers = [(n, m) for n, m in ref.named_modules() if is_gated_delta_net(m)]
    assert layers
    for name, whole in layers:
        m = model.get_submodule(name)
        hk, hv = whole.num_k_heads, whole.num_v_heads
        if hk < world:  # kept whole on every rank
            assert m.num_k_heads == hk and type(m.q_proj) is torch.nn.Linear
            assert any("cannot be split" in str(w.message) and "linear_attn" in str(w.message)
                       for w in caught), [str(w.message) for w in caught]
            continue
        lo, hi = hk * rank // world, hk * (rank + 1) // world
        assert m.num_k_heads == hk // world + (rank < hk % world)
        assert local_part(m.q_proj.weight).shape[0] == m.key_dim == m.num_k_heads * m.head_k_dim
        assert local_part(m.v_proj.weight).shape[0] == m.value_dim == \
            local_part(m.o_proj.weight).shape[1] == m.num_v_heads * m.head_v_dim
        assert m.A_log.shape[0] == m.dt_bias.shape[0] == m.num_v_heads == \
            m.num_k_heads * hv // hk
        assert m.conv1d.weight.shape[0] == 2 * m.key_dim + m.value_dim, (lo, hi)
    _step_like_one_device(model, ref, f"olmo_hybrid TP {world}")


@pytest.mark.parametrize("world,overrides", [
    (2, {}), (3, {}),  # 4 key heads: 2, 2 and 2, 1, 1
    (2, dict(linear_num_value_heads=8)),  # each key head serves 2 value heads
    (3, dict(linear_num_key_heads=2, linear_num_value_heads=4))])  # fewer than ranks: whole
def test_gated_delta_net_split_by_heads(world, overrides):
    run_ranks(_delta_net_split_like_one_device, world, overrides)


def test_gated_delta_net_trains_like_one_device():
    # three AdamW steps: logits, loss, every gradient and every parameter against one device
    run_ranks(_train_like_unsharded, 2, "olmo_hybrid", False, False)


def _short_conv_split_like_one_device(rank, world, arch):
    """The short convolution mixers (completed into LFM2's plan) hold this rank's channels
    of B, C and x, of the convolution and of out_proj's columns: logits and every gradient
    equal one device's (float64)."""
    from tpx.parallel.short_conv import is_short_conv

    torch.manual_seed(0)
    ref = hf_tiny.tiny(arch).double()
    model = copy.deepcopy(ref)
    plan = tpx.plans.auto(model)
    assert any(g.startswith("mixer ") for g in plan.completion.groups), plan.completion.left
    tpx.parallelize_module(model, None, plan)
    mixers = [(n, m) for n, m in ref.named_modules() if is_short_conv(m)]
    assert mixers
    for name, whole in mixers:
        m, h = model.get_submodule(name), whole.conv.in_channels
        local = h // world + (rank < h % world)
        assert m.conv.weight.shape[0] == m.conv.groups == local
        assert local_part(m.in_proj.weight).shape[0] == 3 * local
        assert local_part(m.out_proj.weight).shape[1] == local
    _step_like_one_device(model, ref, f"{arch} TP {world}")


@pytest.mark.parametrize("arch,world", [("lfm2", 2), ("lfm2", 3), ("lfm3", 3),
                                        pytest.param("lfm2_moe", 2, marks=pytest.mark.slow)])
def test_short_conv_split_by_channels(arch, world):
    run_ranks(_short_conv_split_like_one_device, world, arch)


def _mixer_dcp_save(rank, world, ckpt, full_path, arch):
    """A hybrid with its mixers split after one AdamW step, saved by tpx.checkpoint.save
    (torch.distributed.checkpoint); torch's own dcp.save(model.state_dict()) says why it
    cannot take the mixers' fused rows, before writing anything."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = hf_tiny.tiny(arch).double()
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    ids, labels = _batch(0)
    model(input_ids=ids, labels=labels).loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    try:  # torch's own recipe: where a DTensor can state every part
        dcp.save(model.state_dict(), checkpoint_id=ckpt + "-plain")
    except RuntimeError as e:  # or said, before anything is written
        assert "a DTensor cannot state" in str(e) and "tpx.checkpoint.save" in str(e), e
        assert not os.path.exists(ckpt + "-plain")
    tpx.checkpoint.save(model, ckpt, optimizer=opt)
    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save(full, full_path)
    dist.barrier()


def _mixer_dcp_load(rank, world, ckpt, full_path, arch):
    import torch.distributed.checkpoint as dcp

    ref = hf_tiny.tiny(arch).double()
    ref.load_state_dict(torch.load(full_path))
    torch.manual_seed(7)  # another initialisation: everything must come from the checkpoint
    model = hf_tiny.tiny(arch).double()
    if world > 1:
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tpx.checkpoint.load(model, ckpt, optimizer=opt)
        assert opt.state  # the moments came back, at this TP size
    else:  # the unsharded model reads it with torch's own dcp.load
        state = model.state_dict()
        dcp.load(state, checkpoint_id=ckpt)
        model.load_state_dict(state)
    assert_like_unsharded(model, ref, f"{arch} loaded at TP {world}")
    if os.path.exists(ckpt + "-plain"):  # torch's own recipe, read at another TP size
        torch.manual_seed(8)
        again = hf_tiny.tiny(arch).double()
        if world > 1:
            tpx.parallelize_module(again, None, tpx.plans.auto(again))
        try:
            state = again.state_dict()
        except RuntimeError as e:  # heads this TP size deals to several ranks: said
            assert "a DTensor cannot state" in str(e), e
        else:
            dcp.load(state, checkpoint_id=ckpt + "-plain")
            again.load_state_dict(state)
            assert_like_unsharded(again, ref, f"{arch} loaded by dcp.load at TP {world}")
    ids, _ = _batch(1)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["bamba", "olmo_hybrid", "lfm2"])
def test_mixers_reshard_through_dcp(tmp_path, arch):
    # Mamba-2, Gated DeltaNet and short-convolution mixers saved at TP 2 read back at TP 3
    # (tpx.checkpoint.load) and on one device (torch's dcp.load)
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_mixer_dcp_save, 2, ckpt, full, arch)
    for w in (3, 1):
        run_ranks(_mixer_dcp_load, w, ckpt, full, arch)


def _decode_like_one_device(rank, world, arch):
    """Greedy generate() with the model's cache (its conv and SSM states sized by each rank's
    mixer): every token and every step's logits equal one device's."""
    torch.manual_seed(0)
    ref = hf_tiny.tiny(arch).double()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    split = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Conv1d) and m.weight.shape[0] <
             ref.get_submodule(n).weight.shape[0]]
    assert split, f"{arch}: no mixer's convolution is split"
    ids, _ = _batch(9, seq=7)
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True, use_cache=True)
    want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences), \
        f"{arch} TP {world}: {got.sequences.tolist()} vs {want.sequences.tolist()}"
    assert len(got.logits) == 6
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{arch} step {step}")


@pytest.mark.parametrize("arch,world", [
    ("bamba", 2), ("olmo_hybrid", 2), ("lfm2", 2), ("jamba", 2),
    pytest.param("falcon_h1", 3, marks=pytest.mark.slow),
    pytest.param("nemotron_h", 2, marks=pytest.mark.slow),
    pytest.param("granitemoehybrid", 2, marks=pytest.mark.slow),
    pytest.param("mamba", 3, marks=pytest.mark.slow),
    pytest.param("mamba2", 2, marks=pytest.mark.slow),
    pytest.param("falcon_mamba", 2, marks=pytest.mark.slow),
    pytest.param("lfm2_moe", 3, marks=pytest.mark.slow),
    pytest.param("zamba2", 2, marks=pytest.mark.slow)])
def test_mixers_decode_with_cache_like_one_device(arch, world):
    # Mamba-2, Mamba-1, Gated DeltaNet and short-convolution mixers split, cached decoding
    run_ranks(_decode_like_one_device, world, arch)
