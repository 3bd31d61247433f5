"""Optimizer state in tpx checkpoints: Adam / SGD-momentum state saved at one TP degree or
layout and resumed at another (TP 2 -> TP 4 and TP 1, TP 3 -> TP 2, 2-D -> 1-D); the next step
after the resume must equal the step of one device that trained the same steps without
interruption. Also the full (single-file) export both ways, tied and frozen parameters, an
optimizer built before parallelize_module, and the errors."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpx
import tpx.checkpoint
from harness import run_ranks

V, D, H = 13, 8, 12  # V = 13 divides by none of 2, 3, 4: uneven vocabulary shards
STEPS = 3  # steps taken before the checkpoint


class Net(nn.Module):
    """Embedding (vocab-sharded) -> colwise up -> rowwise down (residual) -> norm
    (replicated) -> colwise LM head over the vocabulary, optionally tied to the embedding.
    The norm's bias is frozen: no gradient, no optimizer state."""

    def __init__(self, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.norm.bias.requires_grad_(False)
        with torch.no_grad():
            self.norm.bias.add_(0.1 * torch.randn(D))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.norm(h))


def _plan():
    return {"embed": tpx.RowwiseParallel(), "up": tpx.ColwiseParallel(),
            "down": tpx.RowwiseParallel(),
            "head": tpx.ColwiseParallel(output_layouts=tpx.Replicate())}


def _make_optimizer(kind, params):
    # Adam's eps above the fp32 rounding of the gradients (see _llama).
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.9), eps=1e-3,
                                weight_decay=0.01)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, eps=1e-3, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (3, 7), generator=g), torch.randint(0, V, (3, 7), generator=g)


def _train_step(model, opt, step):
    ids, labels = _batch(step)
    opt.zero_grad()
    F.cross_entropy(model(ids).reshape(-1, V), labels.reshape(-1)).backward()
    opt.step()


def _reference(kind, tie, steps):
    """One device: the unsharded model trained ``steps`` steps without interruption."""
    torch.manual_seed(0)
    ref = Net(tie)
    opt = _make_optimizer(kind, ref.parameters())
    for s in range(steps):
        _train_step(ref, opt, s)
    return ref, opt


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")


def _check_model(model, ref, what):
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(full[key], value, f"{what}: {key}")


def _check_optimizer_state(model, opt, ref, ref_opt, what):
    """The gathered optimizer state equals the reference optimizer's, name by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    got = tpx.checkpoint.get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True))
    names = {id(p): n for n, p in ref.named_parameters()}
    want = {names[id(p)]: s for p, s in ref_opt.state.items()}
    assert sorted(got["state"]) == sorted(want), (what, sorted(got["state"]), sorted(want))
    assert "norm.bias" not in got["state"]  # frozen: no state
    for fqn, entry in want.items():
        assert sorted(got["state"][fqn]) == sorted(entry), (what, fqn)
        for k, v in entry.items():
            _close(got["state"][fqn][k], v, f"{what}: state {fqn}.{k}")


def _train_and_save(rank, world, kind, tie, ckpt, before):
    torch.manual_seed(0)
    model = Net(tie)
    opt = _make_optimizer(kind, model.parameters()) if before else None
    tpx.parallelize_module(model, None, _plan())
    if opt is None:
        opt = _make_optimizer(kind, model.parameters())
    for s in range(STEPS):
        _train_step(model, opt, s)
    ref, ref_opt = _reference(kind, tie, STEPS)
    _check_model(model, ref, f"TP {world} after {STEPS} steps")
    _check_optimizer_state(model, opt, ref, ref_opt, f"TP {world} after {STEPS} steps")
    tpx.checkpoint.save(model, ckpt, optimizer=opt)


def _resume_and_step(rank, world, kind, tie, ckpt, before):
    torch.manual_seed(7 + rank)  # different weights: everything must come from the files
    model = Net(tie)
    opt = _make_optimizer(kind, model.parameters()) if before else None
    tpx.parallelize_module(model, None, _plan())
    if opt is None:
        opt = _make_optimizer(kind, model.parameters())
    for g in opt.param_groups:
        g["lr"] = 123.0  # the saved hyper-parameters must come back
    tpx.checkpoint.load(model, ckpt, optimizer=opt)
    ref, ref_opt = _reference(kind, tie, STEPS)
    _check_model(model, ref, f"TP {world} after resume")
    _check_optimizer_state(model, opt, ref, ref_opt, f"TP {world} after resume")
    _train_step(model, opt, STEPS)
    _train_step(ref, ref_opt, STEPS)
    _check_model(model, ref, f"TP {world}: step after resume")
    _check_optimizer_state(model, opt, ref, ref_opt, f"TP {world}: step after resume")
    # The hyper-parameters came from the checkpoint, not from the optimizer built here.
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]


def _single_device_resume(kind, tie, ckpt):
    """TP 1 without tpx: the plain model and torch optimizer, read with DCP's own loader and
    PyTorch's set_optimizer_state_dict (the checkpoint holds global shapes, original names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    torch.manual_seed(9)
    model = Net(tie)
    opt = _make_optimizer(kind, model.parameters())
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    flat = dict(state["model"])
    flat["optim"] = state["optim"]
    dcp.load(flat, checkpoint_id=ckpt)
    model.load_state_dict({k: v for k, v in flat.items() if k != "optim"})
    set_optimizer_state_dict(model, opt, flat["optim"])
    ref, ref_opt = _reference(kind, tie, STEPS)
    for k, v in ref.state_dict().items():
        _close(model.state_dict()[k], v, f"plain TP 1: {k}")
    _train_step(model, opt, STEPS)
    _train_step(ref, ref_opt, STEPS)
    for k, v in ref.state_dict().items():
        _close(model.state_dict()[k], v, f"plain TP 1 step after resume: {k}")
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in ref_opt.state[q].items():
            _close(opt.state[p][k], v, f"plain TP 1 optimizer state {k}")


def test_adam_resume_tp2_at_tp4_tp1(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_train_and_save, 2, "adam", False, ckpt, False)
    run_ranks(_resume_and_step, 4, "adam", False, ckpt, False)
    run_ranks(_resume_and_step, 1, "adam", False, ckpt, False)  # tpx at world 1
    _single_device_resume("adam", False, ckpt)  # plain torch, DCP's own loader


def test_sgd_momentum_resume_tp3_at_tp2_tied(tmp_path):
    # Tied embedding / LM head; the optimizer built before parallelize_module when saving,
    # after it when resuming.
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_train_and_save, 3, "sgd", True, ckpt, True)
    run_ranks(_resume_and_step, 2, "sgd", True, ckpt, False)
    _single_device_resume("sgd", True, ckpt)


# ---------------------------------------------------------------------------------------------
# Full export: one file that the unsharded model's optimizer loads, and back.

def _export_import(rank, world, path):
    torch.manual_seed(0)
    model = Net(tie=True)
    tpx.parallelize_module(model, None, _plan())
    opt = _make_optimizer("adamw", model.parameters())
    for s in range(STEPS):
        _train_step(model, opt, s)
    full = tpx.checkpoint.full_optimizer_state_dict(model, opt, rank0_only=True)
    weights = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save({"model": weights, "optim": full}, path)
    else:
        assert full == {} and weights == {}
    dist.barrier()

    # The unsharded model and plain torch.optim.Adam load the export and step like one device.
    saved = torch.load(path)
    plain = Net(tie=True)
    plain.load_state_dict(saved["model"])
    plain_opt = _make_optimizer("adamw", plain.parameters())
    plain_opt.load_state_dict(saved["optim"])
    ref, ref_opt = _reference("adamw", True, STEPS)
    _train_step(plain, plain_opt, STEPS)
    _train_step(ref, ref_opt, STEPS)
    for k, v in ref.state_dict().items():
        _close(plain.state_dict()[k], v, f"exported, stepped unsharded: {k}")

    # Reverse: the unsharded optimizer's state dict (one step further) into a fresh TP run.
    torch.manual_seed(3 + rank)
    model2 = Net(tie=True)
    tpx.parallelize_module(model2, None, _plan())
    opt2 = _make_optimizer("adamw", model2.parameters())
    tpx.checkpoint.load_full_state_dict(model2, ref.state_dict())
    tpx.checkpoint.load_full_optimizer_state_dict(model2, opt2, ref_opt.state_dict())
    _check_optimizer_state(model2, opt2, ref, ref_opt, "load_full_optimizer_state_dict")
    _train_step(model2, opt2, STEPS + 1)
    _train_step(ref, ref_opt, STEPS + 1)
    _check_model(model2, ref, "step after load_full_optimizer_state_dict")

    # FQN-keyed full state dict of PyTorch's own API for the unsharded model, into tpx.
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    torch_sd = get_optimizer_state_dict(ref, ref_opt)
    opt3 = _make_optimizer("adamw", model2.parameters())
    tpx.checkpoint.set_optimizer_state_dict(model2, opt3, torch_sd)
    _check_optimizer_state(model2, opt3, ref, ref_opt, "set_optimizer_state_dict (torch's)")
    # and tpx's sharded (DTensor) form back into the same layout without communication.
    sharded = tpx.checkpoint.get_optimizer_state_dict(model2, opt3)
    opt4 = _make_optimizer("adamw", model2.parameters())
    tpx.checkpoint.set_optimizer_state_dict(model2, opt4, sharded)
    _check_optimizer_state(model2, opt4, ref, ref_opt, "set_optimizer_state_dict (DTensor)")
    # tpx's full form equals torch's for the unsharded model, key by key.
    mine = tpx.checkpoint.get_optimizer_state_dict(
        model2, opt3, options=StateDictOptions(full_state_dict=True))
    assert [g["params"] for g in mine["param_groups"]] == \
        [g["params"] for g in torch_sd["param_groups"]]


def test_full_export_and_import(tmp_path):
    run_ranks(_export_import, 3, str(tmp_path / "full.pt"))


# ---------------------------------------------------------------------------------------------
# 2-D (2 x 2 mesh, 4 ranks) -> 1-D (2 ranks).

def _decoder():
    from tiny_llama import Decoder

    torch.manual_seed(0)
    return Decoder(vocab=24, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden=32)


def _decoder_step(model, opt, step):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, 24, (4, 5), generator=g)
    labels = torch.randint(0, 24, (4, 5), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(ids).reshape(-1, 24), labels.reshape(-1)).backward()
    opt.step()


def _decoder_reference(steps):
    ref = _decoder()
    opt = torch.optim.Adam(ref.parameters(), lr=0.02, eps=1e-3)
    for s in range(steps):
        _decoder_step(ref, opt, s)
    return ref, opt


def _save_2d(rank, world, ckpt):
    mesh = tpx.init_mesh("2d")
    model = _decoder()
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout="2d"))
    opt = torch.optim.Adam(model.parameters(), lr=0.02, eps=1e-3)
    for s in range(STEPS):
        _decoder_step(model, opt, s)
    ref, ref_opt = _decoder_reference(STEPS)
    _check_model(model, ref, "2-D before save")
    tpx.checkpoint.save(model, ckpt, optimizer=opt)


def _resume_1d(rank, world, ckpt):
    model = _decoder()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # away from the saved values
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    tpx.checkpoint.load(model, ckpt, optimizer=opt)
    ref, ref_opt = _decoder_reference(STEPS)
    _check_model(model, ref, "1-D after loading the 2-D checkpoint")
    _decoder_step(model, opt, STEPS)
    _decoder_step(ref, ref_opt, STEPS)
    _check_model(model, ref, "1-D: step after resume from 2-D")


def test_resume_2d_at_1d(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_save_2d, 4, ckpt)
    run_ranks(_resume_1d, 2, ckpt)


# ---------------------------------------------------------------------------------------------
# Errors, raised before anything is modified.

def _errors(rank, world, with_opt, without_opt, other):
    torch.manual_seed(0)
    model = Net()
    tpx.parallelize_module(model, None, _plan())
    opt = _make_optimizer("adam", model.parameters())
    _train_step(model, opt, 0)
    tpx.checkpoint.save(model, with_opt, optimizer=opt)
    tpx.checkpoint.save(model, without_opt)

    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="holds no optimizer state"):
        tpx.checkpoint.load(model, without_opt, optimizer=opt)

    # A model whose up projection is wider: the checkpoint's shapes disagree.
    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(D, H + 2)
            self.down = nn.Linear(H + 2, D)

    wide = Wider()
    tpx.parallelize_module(wide, None, _plan())
    wide_opt = _make_optimizer("adam", wide.parameters())
    with pytest.raises(ValueError, match=r"up\.weight has shape \(12, 8\)"):
        tpx.checkpoint.load(wide, with_opt, optimizer=wide_opt)
    # The optimizer part alone (state saved for the wider model) names the parameter too.
    _train_step(wide, wide_opt, 0)
    wide_sd = tpx.checkpoint.get_optimizer_state_dict(wide, wide_opt)
    with pytest.raises(ValueError, match=r"of parameter 'up\.weight' has shape \(14, 8\)"):
        tpx.checkpoint.set_optimizer_state_dict(model, opt, wide_sd)
    full = _make_optimizer("adam", Net().parameters())  # unsharded optimizer, Net shapes
    full.load_state_dict(tpx.checkpoint.full_optimizer_state_dict(wide, wide_opt))
    with pytest.raises(ValueError, match=r"parameter 'up\.weight' \(id \d+\) has shape "):
        tpx.checkpoint.load_full_optimizer_state_dict(model, opt, full.state_dict())

    # An optimizer over another model's parameters.
    with pytest.raises(ValueError, match="not a parameter of the model"):
        tpx.checkpoint.save(model, other, optimizer=wide_opt)

    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    state_after = opt.state_dict()
    for i, entry in state_before["state"].items():
        for k, v in entry.items():
            assert torch.equal(state_after["state"][i][k], v), (i, k)


def test_errors(tmp_path):
    run_ranks(_errors, 2, str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"))


# ---------------------------------------------------------------------------------------------
# A Hugging Face Llama with 2 KV heads: at TP 4 its k/v projections replicate heads (a 1-D
# layout other than shard_range, saved and loaded as the full tensor).

def _llama_step(model, opt, step):
    from test_hf import V as HV

    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, HV, (2, 6), generator=g)
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _llama(steps, parallel):
    from test_hf import tiny

    torch.manual_seed(0)
    model = tiny("llama")
    if parallel:
        tpx.parallelize_module(model, None, tpx.plans.auto(model))
    # eps well above the gradients' rounding: Adam's m / sqrt(v) divides by sqrt(v), which
    # magnifies the fp32 rounding of a near-zero gradient element beyond any tolerance.
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    for s in range(steps):
        _llama_step(model, opt, s)
    return model, opt


def _llama_save(rank, world, ckpt):
    model, opt = _llama(2, True)
    tpx.checkpoint.save(model, ckpt, optimizer=opt)


def _llama_resume(rank, world, ckpt):
    from test_hf import tiny

    torch.manual_seed(4)
    model = tiny("llama")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    params = tpx.checkpoint.ParamSet(model)
    kinds = {lay.kind for lay in params.by_id.values()}
    assert "gather" in kinds, kinds  # the replicated KV heads
    opt = torch.optim.Adam(model.parameters(), lr=1.0)  # lr and eps come from the checkpoint
    tpx.checkpoint.load(model, ckpt, optimizer=opt)
    ref, ref_opt = _llama(2, False)
    _llama_step(model, opt, 2)
    _llama_step(ref, ref_opt, 2)
    _check_model(model, ref, "llama TP 4 step after resume from TP 2")
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    got = tpx.checkpoint.get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True))
    for name, p in ref.named_parameters():
        for k, v in ref_opt.state[p].items():
            _close(got["state"][name][k], v, f"llama optimizer state {name}.{k}")


def test_resume_replicated_kv_heads(tmp_path):
    pytest.importorskip("transformers")
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_llama_save, 2, ckpt)
    run_ranks(_llama_resume, 4, ckpt)
