"""tpx's sharded parameters are DTensors, so PyTorch's own tools read them right: ``model.
state_dict()`` with ``torch.distributed.checkpoint`` (saved at one TP degree, loaded at another
or into the unsharded model), ``get_state_dict`` / ``set_state_dict`` with AdamW's state,
``torch.nn.utils.clip_grad_norm_``, foreach and fused AdamW; a layout no DTensor states raises
in ``state_dict()`` instead of writing a shard under a full name."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks

transformers = pytest.importorskip("transformers")
from test_hf import V, tiny  # noqa: E402


def _llama(dtype=torch.float32):
    # 12 heads and 6 KV heads divide by 2 and 3; the vocabulary (1003) and the MLP (88) do not.
    return tiny("llama", hidden_size=48, num_attention_heads=12,
                num_key_value_heads=6).to(dtype)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (2, 10), generator=g)


def _train(model, opt, steps, seed0):
    for i in range(steps):
        ids = _batch(seed0 + i)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _check_params_are_dtensors(model, sp=False):
    from torch.distributed.tensor import DTensor, Replicate

    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    # Every projection, the embedding and the LM head; and the norms, Replicate() DTensors
    # (as under PyTorch's sequence parallelism; without it, tpx makes what a plan keeps whole
    # a replica too, where PyTorch's TP leaves it plain).
    norms = 2 * len(model.model.layers) + 1
    assert len(sharded) == 2 + 7 * len(model.model.layers) + norms, sharded
    for n, p in model.named_parameters():
        if "norm" in n:
            assert tuple(p.placements) == (Replicate(),), n
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            assert p.shape == model.get_parameter(n).shape
    ref = _llama()
    for n, p in ref.named_parameters():
        assert tuple(model.get_parameter(n).shape) == tuple(p.shape), n


def _save_plain_dcp(rank, world, ckpt, full_path, sp):
    """dcp.save(model.state_dict()) of a TP model, as PyTorch users write it (``sp``: with
    sequence parallelism, whose norms' parameters are Replicate() DTensors)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = _llama()
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=sp))
    _check_params_are_dtensors(model, sp)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.5), 1, 0)
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save(full, full_path)
    dist.barrier()


def _load_plain_dcp(rank, world, ckpt, full_path):
    import torch.distributed.checkpoint as dcp

    ref = _llama()
    ref.load_state_dict(torch.load(full_path))
    torch.manual_seed(7)  # another initialisation: everything must come from the checkpoint
    model = _llama()
    if world > 1:
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
    state = model.state_dict()
    dcp.load(state, checkpoint_id=ckpt)  # in place: the DTensors are views of the parameters
    ids = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    model.load_state_dict(state)  # and through load_state_dict, as the DCP recipes do
    assert_like_unsharded(model, ref, f"loaded at TP {world}")


@pytest.mark.parametrize("save_world,load_worlds,sp", [
    (2, (3, 1), False), (2, (3, 1), True), pytest.param(3, (2,), False, marks=pytest.mark.slow)])
def test_dcp_of_model_state_dict(tmp_path, save_world, load_worlds, sp):
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_save_plain_dcp, save_world, ckpt, full, sp)
    for w in load_worlds:
        run_ranks(_load_plain_dcp, w, ckpt, full)


def _pytorch_checkpoint(model, opt, ckpt, phase):
    """PyTorch's own recipe: get_state_dict + dcp.save, or get_state_dict + dcp.load (in
    place) + set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if phase == "save":
        dcp.save(state, checkpoint_id=ckpt)
        return
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _get_set_state_dict(rank, world, ckpt, phase):
    """get_state_dict / dcp.save at TP ``world`` after 2 AdamW steps; then, in another world,
    dcp.load / set_state_dict and 2 more steps equal 4 uninterrupted steps on one device."""
    # float64: AdamW divides by the root of its second moment, which turns float32 rounding
    # of tiny gradients into visible differences; the comparison is of the checkpoint path.
    torch.manual_seed(0)
    model = _llama(torch.float64)
    ref = _llama(torch.float64)
    ref.load_state_dict(model.state_dict())
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    if phase == "save":
        _train(model, opt, 2, 0)
        _pytorch_checkpoint(model, opt, ckpt, "save")
        return
    _pytorch_checkpoint(model, opt, ckpt, "load")
    _train(model, opt, 2, 2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    _train(ref, ref_opt, 4, 0)
    assert_like_unsharded(model, ref, f"4 AdamW steps, resumed at TP {world}", rtol=1e-9,
                          atol=1e-10)


def test_get_set_state_dict_with_adamw_tp2_to_tp3(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_get_set_state_dict, 2, ckpt, "save")
    run_ranks(_get_set_state_dict, 3, ckpt, "load")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 70)    # 70 rows: uneven at TP 3 and 4
        self.down = nn.Linear(70, 24)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def _clipped_adamw_like_one_device(plan, kind, what):
    """The MLP sharded by ``plan``, trained 3 steps with torch.nn.utils.clip_grad_norm_ (a
    max_norm below the norm, so that clipping scales) and torch's AdamW (``kind``: foreach,
    fused or for-loop), against the same steps on one device, in float64 (AdamW magnifies
    float32 rounding, see above)."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    ref = _MLP().double()
    model = _MLP().double()
    model.load_state_dict(ref.state_dict())
    tpx.parallelize_module(model, None, plan)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values()), sorted(params)
    assert params["up.weight"].device_mesh == params["down.weight"].device_mesh

    def loss(m, i):
        g = torch.Generator().manual_seed(i)
        return m(torch.randn(6, 24, generator=g, dtype=torch.float64)).pow(2).sum()

    _clipped_adamw_steps(model, ref, kind, loss, 3, what)


def _max_norm(model) -> float:
    """The max_norm of torch's clip_grad_norm_ in these tests: 0.5, below the norms, so that
    clipping scales the gradients. Where torch's clip_grad_norm_ adds its 1e-6 to every
    rank's partial norm of DTensor gradients (torch 2.5, PyTorch's TP alike: the scaled
    gradients then differ from one device's by ~1e-8 relative, which Adam turns into
    differences up to lr / eps times larger in gradients near zero), above the norms: the
    norm is still compared, the scaling is 1. A collective."""
    from torch.distributed.tensor import DTensor

    from torch_compat import norm_partial_adds_scalar_per_rank

    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    return 1e9 if norm_partial_adds_scalar_per_rank(mesh) else 0.5


def _clipped_adamw_steps(model, ref, kind, loss, steps, what):
    """``steps`` steps of ``loss(m, step).backward()``, torch.nn.utils.clip_grad_norm_ (a
    max_norm below the norm, so that clipping scales, on a torch whose clipping of DTensor
    gradients is right: :func:`_max_norm`) and torch's AdamW (``kind``: foreach,
    fused or for-loop) on the sharded ``model`` and on ``ref`` (one device, for-loop AdamW):
    the norms equal at every step, the parameters equal after the steps."""
    from torch.distributed.tensor import DTensor

    kw = {"foreach": dict(foreach=True), "fused": dict(fused=True),
          "for-loop": dict(foreach=False)}[kind]
    max_norm = _max_norm(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for i in range(steps):
        norms = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss(m, i).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm))
            o.step()
            o.zero_grad()
        tpx_norm, ref_norm = norms
        if isinstance(tpx_norm, DTensor):
            tpx_norm = tpx_norm.full_tensor()
        torch.testing.assert_close(tpx_norm, ref_norm, rtol=1e-10, atol=1e-12)
        assert ref_norm > 0.5
    assert_like_unsharded(model, ref, f"{what}, {steps} clipped AdamW steps ({kind})",
                          rtol=1e-10, atol=1e-12)


def _torch_tools(rank, world, kind):
    """torch.nn.utils.clip_grad_norm_ and torch's foreach / fused AdamW over a model whose every
    parameter is a DTensor (weights Shard, the row layer's bias Replicate), 3 steps."""
    _clipped_adamw_like_one_device({"up": tpx.ColwiseParallel(), "down": tpx.RowwiseParallel()},
                                   kind, "tpx styles")


@pytest.mark.parametrize("kind", ["foreach", "fused", "for-loop"])
def test_torch_clip_grad_norm_and_adamw(kind):
    run_ranks(_torch_tools, 3, kind)


def _mixed_styles(rank, world, kind):
    """A plan mixing tpx's style (the column layer) with PyTorch's own (the row layer, applied
    by tpx through PyTorch's implementation): every parameter a DTensor on one mesh, so torch's
    clip_grad_norm_ and foreach / fused AdamW train the model equal to one device (3 steps).
    At TP 2, where the 70 features split evenly: PyTorch's RowwiseParallel infers the global
    shape of a plain input from the local one, as if every shard were as wide."""
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

    _clipped_adamw_like_one_device({"up": tpx.ColwiseParallel(), "down": TorchRowwise()},
                                   kind, "tpx + PyTorch styles")


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_mixed_tpx_and_pytorch_styles_with_torch_optimizers(kind):
    run_ranks(_mixed_styles, 2, kind)


def _qwen3_torch_tools(rank, world):
    """Qwen3 with sequence parallelism: its per-head q_norm / k_norm (summed gradients,
    ReplicatedWithGradAllReduce in its plan) are Replicate() DTensors like the layer norms, so
    every parameter is a DTensor and torch's clip_grad_norm_ and foreach AdamW run on the
    model as on PyTorch's TP, equal to one device over 2 steps."""
    import copy

    from torch.distributed.tensor import DTensor, Replicate

    import hf_tiny

    torch.manual_seed(0)  # float64: AdamW magnifies float32 rounding
    # 4 KV heads: whole KV heads per rank at TP 2 and 4 (KV heads replicated over ranks are a
    # layout no DTensor states, which stays a plain tensor)
    ref = hf_tiny.tiny("qwen3", num_key_value_heads=4).double()
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=True))
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == [], plain
    attn = model.model.layers[0].self_attn
    for norm in (attn.q_norm, attn.k_norm):
        assert tuple(norm.weight.placements) == (Replicate(),), norm.weight
    _clipped_adamw_steps(model, ref, "foreach",
                         lambda m, i: m(input_ids=_batch(i), labels=_batch(i)).loss, 2,
                         f"Qwen3 at TP {world}")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_qwen3_every_parameter_a_dtensor(world):
    run_ranks(_qwen3_torch_tools, world)


def _fused_layout_raises(rank, world):
    """GPT-2's fused c_attn splits q, k and v separately: no DTensor states that layout, so
    state_dict() raises naming tpx's way; load_state_dict of the full state works."""
    torch.manual_seed(0)
    model = tiny("gpt2")
    full = {k: v.clone() for k, v in model.state_dict().items()}
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    with pytest.raises(RuntimeError, match="tpx.checkpoint.save"):
        model.state_dict()
    torch.manual_seed(3)
    other = tiny("gpt2")
    tpx.parallelize_module(other, None, tpx.plans.auto(other))
    other.load_state_dict(full)
    ids = _batch(5)
    ref = tiny("gpt2")
    ref.load_state_dict(full)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_fused_layout_state_dict_raises():
    run_ranks(_fused_layout_raises, 2)


def _save_pretrained(rank, world, path):
    """save_pretrained of a tpx model: on every rank, each writing its part (no state_dict=);
    with tpx's full state dict on rank 0, transformers' own. Both are the full model."""
    torch.manual_seed(0)
    ref = _llama()
    model = _llama()
    model.load_state_dict(ref.state_dict())
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    with pytest.raises(ValueError, match="max_shard_size only"):
        model.save_pretrained(path, safe_serialization=False)
    assert not os.path.exists(path)
    model.save_pretrained(path)  # every rank
    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        model.save_pretrained(path + "-full", state_dict=full)
    dist.barrier()
    for where in (path, path + "-full"):
        back = transformers.AutoModelForCausalLM.from_pretrained(where)
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0,
                                       msg=lambda m, key=key: f"{where} {key}: {m}")


def test_save_pretrained(tmp_path):
    run_ranks(_save_pretrained, 3, str(tmp_path / "hf"))


def _mesh_resume(rank, world, ckpt, phase):
    """PyTorch's get_state_dict / set_state_dict across layouts: saved from 1-D TP 2 after two
    AdamW steps, resumed over a 2-D (2 x 2) mesh, where the parameters are DTensors over the
    mesh; two more steps equal four on one device."""
    from tiny_llama import Decoder

    torch.manual_seed(0)
    ref = Decoder(vocab=36, dim=16, n_heads=4, n_kv_heads=2, hidden=24).double()
    model = Decoder(vocab=36, dim=16, n_heads=4, n_kv_heads=2, hidden=24).double()
    model.load_state_dict(ref.state_dict())
    if phase == "save":
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
    else:
        tpx.parallelize_module(model, tpx.init_mesh("2d"), tpx.plans.auto(model, layout="2d"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    def steps(m, o, n, seed0):
        for i in range(n):
            g = torch.Generator().manual_seed(seed0 + i)
            ids = torch.randint(0, 36, (4, 6), generator=g)
            labels = torch.randint(0, 36, (4, 6), generator=g)
            F.cross_entropy(m(ids).flatten(0, 1), labels.flatten()).backward()
            o.step()
            o.zero_grad()

    if phase == "save":
        steps(model, opt, 2, 0)
        _pytorch_checkpoint(model, opt, ckpt, "save")
        return
    _pytorch_checkpoint(model, opt, ckpt, "load")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    steps(ref, ref_opt, 2, 0)
    # What was loaded is one device's state after two steps: weights and AdamW's moments.
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-12, atol=1e-14,
                                   msg=lambda m, key=key: f"loaded {key}: {m}")
    mine = tpx.checkpoint.full_optimizer_state_dict(model, opt)["state"]
    for i, entry in ref_opt.state_dict()["state"].items():
        for k, v in entry.items():
            torch.testing.assert_close(mine[i][k], v, rtol=1e-12, atol=1e-14,
                                       msg=lambda m, i=i, k=k: f"loaded state {i}.{k}: {m}")
    # Two more steps over the mesh: AdamW steps the DTensor state. (The 2-D layout's float64
    # rounding differs from one device's, and AdamW magnifies it where a gradient is ~0.)
    steps(model, opt, 2, 2)
    steps(ref, ref_opt, 2, 2)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, key=key: f"{key}: {m}")


def test_get_set_state_dict_1d_to_2d_mesh(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_mesh_resume, 2, ckpt, "save")
    run_ranks(_mesh_resume, 4, ckpt, "load")


def _moe_experts_as_dtensors(rank, world, ckpt):
    """Qwen3-MoE with expert parallelism (Hugging Face's fused 3-D experts, whole experts per
    rank), its router and norms under NoParallel: every parameter is a DTensor (the experts' Shard(0)), so
    torch's clip_grad_norm_ and foreach AdamW train it equal to one device, and
    dcp.save(model.state_dict()) reloads into a differently initialised sharded copy and, as a
    full state dict, into the unsharded model."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import hf_tiny

    def sharded(seed, experts):
        torch.manual_seed(seed)
        m = hf_tiny.tiny("qwen3_moe", num_key_value_heads=4).double()
        out = copy.deepcopy(m)
        plan = tpx.plans.auto(out, experts=experts)
        # the router and the norms, whole on every rank: left plain by Hugging Face's plan (as
        # under PyTorch's TP), Replicate() DTensors under NoParallel (torchtitan's choice)
        for name in ("mlp.gate", "input_layernorm", "post_attention_layernorm"):
            plan[f"model.layers.*.{name}"] = tpx.NoParallel()
        plan["model.norm"] = tpx.NoParallel()
        tpx.parallelize_module(out, None, plan)
        return m, out

    ref, model = sharded(0, "ep")
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == [], plain
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert tuple(experts.gate_up_proj.placements) == (Shard(0),)
    router = next(m for n, m in model.named_modules() if n.endswith("mlp.gate"))
    assert tuple(router.weight.placements) == (Replicate(),)
    full_shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == full_shapes
    _clipped_adamw_steps(model, ref, "foreach",
                         lambda m, i: m(input_ids=_batch(i), labels=_batch(i)).loss, 2,
                         f"Qwen3-MoE, expert parallelism, TP {world}")
    dcp.save(model.state_dict(), checkpoint_id=ckpt)
    _, other = sharded(7, "ep")
    state = other.state_dict()
    dcp.load(state, checkpoint_id=ckpt)  # in place: the DTensors are views of the parameters
    ids = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    if rank == 0:
        dcp_to_torch_save(ckpt, ckpt + ".pt")
        full = torch.load(ckpt + ".pt")
        assert set(full) == set(ref.state_dict())
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{key} of the checkpoint: {m}")
    dist.barrier()


def _moe_expert_tp_as_dtensors(rank, world, ckpt):
    """Qwen3-MoE under expert TP: the fused [gate | up] (each half split by shard_range) is a
    DTensor of torch's _StridedShard, down_proj Shard(2): torch's clip_grad_norm_ and foreach
    AdamW equal one device; state_dict() gives DTensors whose full tensors are one device's;
    torch.distributed.checkpoint refuses to save the strided DTensor and its optimizer state
    (where a plain local tensor under the full name was written without a word);
    tpx.checkpoint.save / load round-trips model and optimizer exactly."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import hf_tiny

    def sharded(seed):
        torch.manual_seed(seed)
        m = hf_tiny.tiny("qwen3_moe", num_key_value_heads=4).double()
        out = copy.deepcopy(m)
        plan = tpx.plans.auto(out, experts="tp")
        for name in ("mlp.gate", "input_layernorm", "post_attention_layernorm"):
            plan[f"model.layers.*.{name}"] = tpx.NoParallel()
        plan["model.norm"] = tpx.NoParallel()
        tpx.parallelize_module(out, None, plan)
        return m, out

    ref, model = sharded(0)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == [], plain
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert tuple(experts.down_proj.placements) == (Shard(2),)
    assert tuple(experts.gate_up_proj.placements) == (_StridedShard(1, split_factor=2),)
    torch.testing.assert_close(experts.gate_up_proj.full_tensor(),
                               dict(ref.named_parameters())[
                                   next(n for n, p in model.named_parameters()
                                        if p is experts.gate_up_proj)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    _clipped_adamw_steps(model, ref, "foreach",
                         lambda m, i: m(input_ids=_batch(i), labels=_batch(i)).loss, 2,
                         f"Qwen3-MoE, expert TP, TP {world}")
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        got = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
        torch.testing.assert_close(got, value, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{key} of state_dict(): {m}")
    with pytest.raises(BaseException, match="overlapping"):  # DCP: a CheckpointException
        dcp.save(state, checkpoint_id=ckpt + ".model")
    model(input_ids=_batch(5), labels=_batch(5)).loss.backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(BaseException, match="overlapping"):  # DCP: a CheckpointException
        dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=ckpt + ".optim")
    tpx.checkpoint.save(model, ckpt, optimizer=opt)
    _, other = sharded(7)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2, foreach=True)
    tpx.checkpoint.load(other, ckpt, optimizer=other_opt)
    for m, o in ((model, opt), (other, other_opt)):
        m(input_ids=_batch(6), labels=_batch(6)).loss.backward()
        o.step()
    ids = _batch(99)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    # a full state dict, as torch takes it into DTensor parameters
    set_model_state_dict(other, ref.state_dict(),
                         options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_experts_as_dtensors(tmp_path, world):
    run_ranks(_moe_experts_as_dtensors, world, str(tmp_path / "ckpt"))


def _torch_states_strided(world: int) -> bool:
    """Whether this torch's ``DTensor`` states a fused ``[gate | up]`` split segment by segment
    as tpx needs (``tpx.param_dtensors.strided_placement``; torch 2.5's does not, and tpx then
    keeps such a weight a plain local tensor)."""
    from tpx.param_dtensors import strided_placement

    piece = 2
    rows = [[((i * world + r) * piece, (i * world + r + 1) * piece) for i in range(2)]
            for r in range(world)]
    return strided_placement(0, rows, 2 * world * piece) is not None


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_expert_tp_as_dtensors(tmp_path, world):
    if not _torch_states_strided(world):
        pytest.skip(f"torch {torch.__version__}'s DTensor does not state the fused expert "
                    "weight's layout (_StridedShard); tpx keeps it a plain tensor there")
    run_ranks(_moe_expert_tp_as_dtensors, world, str(tmp_path / "ckpt"))


def _expert_tp_model(seed):
    import hf_tiny

    torch.manual_seed(seed)
    model = hf_tiny.tiny("qwen3_moe", num_key_value_heads=4).double()
    tpx.parallelize_module(model, None, tpx.plans.auto(model, experts="tp"))
    return model


def _save_expert_tp(rank, world, ckpt):
    """Qwen3-MoE under expert TP (the strided [gate | up]) after an AdamW step, saved with
    tpx.checkpoint; its full state dict kept beside."""
    model = _expert_tp_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=_batch(0), labels=_batch(0)).loss.backward()
    opt.step()
    tpx.checkpoint.save(model, ckpt, optimizer=opt)
    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save(full, ckpt + ".full.pt")
    dist.barrier()


def _load_expert_tp(rank, world, ckpt):
    """The checkpoint of :func:`_save_expert_tp` read at another TP degree (with its AdamW
    state): the model's full state dict is the saved one."""
    model = _expert_tp_model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tpx.checkpoint.load(model, ckpt, optimizer=opt)
    full = tpx.checkpoint.full_state_dict(model)
    want = torch.load(ckpt + ".full.pt")
    assert set(full) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0,
                                   msg=lambda m: f"{key} at TP {world}: {m}")
    assert all(opt.state[p] for p in model.parameters()), "the AdamW state was not loaded"


def test_expert_tp_checkpoint_reshards(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save_expert_tp, 2, ckpt)
    for world in (4, 1):
        run_ranks(_load_expert_tp, world, ckpt)


def _raises_inplace(step):
    """Whether ``step()`` raises autograd's "modified by an inplace operation" error (any other
    exception propagates)."""
    try:
        step()
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        return True
    return False


def _check_inplace_between_forward_and_backward(rank, world):
    """A DTensor parameter changed in place between a layer's forward and its backward (an
    optimizer step taken too early) makes the backward raise exactly where the same change to
    the unsharded torch module does: where the backward reads the parameter. Elsewhere the
    backward runs, with torch's gradients."""
    from tiny_llama import Decoder

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    seq = 2 * world

    def compare(case, build_pair, make_input, change, loss_of=lambda y: y.float().sum(),
                call=lambda model, x: model(x)):
        ref, tp = build_pair()
        full = make_input()
        outcomes = []
        for model, is_tp in ((ref, False), (tp, True)):
            x = full.clone().requires_grad_(full.requires_grad) if full.is_floating_point() \
                else full

            def step():
                y = call(model, x)
                y = y.full_tensor() if isinstance(y, DTensor) else y
                with torch.no_grad():
                    change(model)
                loss_of(y).backward()
            outcomes.append(_raises_inplace(step))
        assert outcomes[0] == outcomes[1], (
            f"{case}: torch {'raises' if outcomes[0] else 'runs'}, tpx "
            f"{'raises' if outcomes[1] else 'runs'}")
        return outcomes[0]

    seen = set()
    for sp in (False, True):
        for xgrad in (False, True):
            for kind in ("column", "row"):
                n_in, n_out = (8, 3 * world + 1) if kind == "column" else (3 * world + 1, 8)

                def pair(kind=kind, n_in=n_in, n_out=n_out, sp=sp):
                    lin = nn.Linear(n_in, n_out)
                    style = (tpx.ColwiseParallel(input_layouts=Shard(1) if sp else Replicate())
                             if kind == "column" else
                             tpx.RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1) if sp else Replicate()))
                    return lin, tpx.parallelize_module(copy.deepcopy(lin), None, style)

                def inp(n_in=n_in, xgrad=xgrad):
                    return torch.randn(2, seq, n_in, generator=gen).requires_grad_(xgrad)

                seen.add(compare(f"{kind} sp={sp} input grad={xgrad}", pair, inp,
                                 lambda m: m.weight.mul_(1.5)))
                # the bias alone: never saved by nn.Linear
                seen.add(compare(f"{kind} sp={sp} input grad={xgrad}, bias", pair, inp,
                                 lambda m: m.bias.add_(1.0)))

                def under_autocast(model, x, pair=pair):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        return model(x)
                # under autocast the weight's cast copy is what is kept
                seen.add(compare(f"{kind} sp={sp} input grad={xgrad}, autocast", pair, inp,
                                 lambda m: m.weight.mul_(1.5), call=under_autocast))

    # A vocabulary-parallel embedding: its backward never reads the table.
    def emb_pair():
        emb = nn.Embedding(3 * world + 2, 6)
        return emb, tpx.parallelize_module(copy.deepcopy(emb), None,
                                           tpx.RowwiseParallel(input_layouts=Replicate()))
    seen.add(compare("embedding", emb_pair,
                     lambda: torch.randint(0, 3 * world + 2, (2, seq), generator=gen),
                     lambda m: m.weight.mul_(1.5)))

    # A decoder from tpx.plans.auto with sequence and loss parallelism: a norm (a Replicate()
    # DTensor under sequence parallelism), a projection, the LM head.
    for what, change in (("final norm", lambda m: m.norm.weight.add_(0.5)),
                         ("attention wq", lambda m: m.layers[1].attention.wq.weight.mul_(1.5)),
                         ("LM head", lambda m: m.output.weight.mul_(1.5))):
        def dec_pair():
            torch.manual_seed(1)
            ref = Decoder(vocab=101, dim=24, n_heads=6, n_kv_heads=6)  # heads divide by 2 and 3
            return ref, tpx.parallelize_module(copy.deepcopy(ref), None,
                                               tpx.plans.auto(ref, sequence_parallel=True))
        seen.add(compare(f"decoder {what}", dec_pair,
                         lambda: torch.randint(0, 101, (2, seq), generator=gen), change))
    assert seen == {False, True}, "the cases must include both outcomes"


def _check_inplace_lora_and_2d(rank, world):
    """The same on LoRA adapters of sequence-parallel layers (peft) and, at 4 ranks, on a
    decoder sharded in the 2-D layout."""
    from test_lora import _MLP, lora_config, one_device
    from tiny_llama import Decoder

    gen = torch.Generator().manual_seed(4)
    outcomes = set()

    def parity(case, ref, tp, x_ref, x_tp, change):
        got = []
        for model, x in ((ref, x_ref), (tp, x_tp)):
            def step():
                y = model(x)
                with torch.no_grad():
                    change(model)
                y.float().square().sum().backward()
            got.append(_raises_inplace(step))
        assert got[0] == got[1], f"{case}: torch {got[0]}, tpx {got[1]}"
        outcomes.add(got[0])

    lora_b = lambda m: m.base_model.model.down.lora_B["default"].weight.mul_(1.5)  # noqa: E731
    lora_a = lambda m: m.base_model.model.up.lora_A["default"].weight.mul_(1.5)  # noqa: E731
    for what, change in (("B of the row layer", lora_b), ("A of the column layer", lora_a)):
        for xgrad in (False, True):
            torch.manual_seed(0)
            mlp = _MLP()
            ref = one_device(copy.deepcopy(mlp), lora_config(["up", "down"]))
            pm = one_device(mlp, lora_config(["up", "down"]))
            tpx.parallelize_module(pm, None, {
                "base_model.model.up": tpx.ColwiseParallel(input_layouts=Shard(1)),
                "base_model.model.down": tpx.RowwiseParallel(output_layouts=Shard(1))})
            x_ref = torch.randn(2, 4 * world, 16, generator=gen)
            x = x_ref[:, 4 * rank:4 * (rank + 1)].clone().requires_grad_(xgrad)
            parity(f"LoRA {what}, input grad={xgrad}", ref, pm, x_ref.requires_grad_(xgrad), x,
                   change)
    if world == 4:
        for what, change in (("norm", lambda m: m.norm.weight.add_(0.5)),
                             ("wq", lambda m: m.layers[0].attention.wq.weight.mul_(1.5))):
            torch.manual_seed(8)
            ref = Decoder(vocab=32, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, hidden=16)
            model = copy.deepcopy(ref)
            tpx.parallelize_module(model, tpx.init_mesh("2d"),
                                   tpx.plans.auto(model, layout="2d"))
            ids = torch.randint(0, 32, (2, 5), generator=gen)
            parity(f"2-D decoder {what}", ref, model, ids, ids, change)
    assert True in outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_inplace_change_between_forward_and_backward(world):
    run_ranks(_check_inplace_between_forward_and_backward, world)


@pytest.mark.parametrize("world", [2, 4])
def test_inplace_change_lora_and_2d(world):
    pytest.importorskip("peft")
    run_ranks(_check_inplace_lora_and_2d, world)
