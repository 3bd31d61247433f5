"""TP (tpx) on one mesh dimension and FSDP2 (``fully_shard``) on the other: a 2-D (dp x tp)
mesh of 4 CPU processes over gloo. One training step equals the single-device step."""

import pytest
import torch
import torch.nn.functional as F

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks
from torch_compat import fully_shard, needs_fsdp2_on_cpu
from tiny_llama import Decoder

V = 1003


def _check_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = Decoder(vocab=V)
    model = Decoder(vocab=V)
    model.load_state_dict(ref.state_dict())
    tpx.parallelize_module(model, mesh["tp"], tpx.plans.auto(model))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 16), generator=g)      # the global batch
    labels = torch.randint(0, V, (4, 16), generator=g)
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)           # this dp rank's half

    # Single device: the whole batch. 2-D: each dp rank its half (FSDP averages the grads).
    ref_loss = F.cross_entropy(ref(ids).reshape(-1, V), labels.reshape(-1))
    ref_loss.backward()
    loss = F.cross_entropy(model(ids[mine]).reshape(-1, V), labels[mine].reshape(-1))
    loss.backward()
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()

    # full_tensor(): the tp rank's block, gathered over dp.
    assert_like_unsharded(model, ref, "after one step", rtol=1e-4, atol=1e-5,
                          local=lambda p: p.full_tensor())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=1e-4, atol=1e-5)


@needs_fsdp2_on_cpu
def test_fsdp2_dp_by_tpx_tp():
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_check_2d, 4)


def _tp_fsdp(mesh, seed):
    torch.manual_seed(seed)
    model = Decoder(vocab=V)
    tpx.parallelize_module(model, mesh["tp"], tpx.plans.auto(model))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _checkpoints(rank, world, d):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mine = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 16), generator=g)
    labels = torch.randint(0, V, (4, 16), generator=g)

    def step(model, opt):
        loss = F.cross_entropy(model(ids[mine]).reshape(-1, V), labels[mine].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = _tp_fsdp(mesh, 0)
    step(model, opt)
    tpx.checkpoint.save(model, f"{d}/fsdp", optimizer=opt)
    resumed, resumed_opt = _tp_fsdp(mesh, 5)  # other weights, until loaded
    tpx.checkpoint.load(resumed, f"{d}/fsdp", optimizer=resumed_opt)
    for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    for _ in range(2):  # the optimizer state came back too: the next steps are the same
        assert step(model, opt) == step(resumed, resumed_opt)
    # The same checkpoint into the model sharded by tpx alone, and back.
    torch.manual_seed(7)
    plain = Decoder(vocab=V)
    tpx.parallelize_module(plain, mesh["tp"], tpx.plans.auto(plain))
    tpx.checkpoint.load(plain, f"{d}/fsdp")
    tpx.checkpoint.load(resumed, f"{d}/fsdp")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids), resumed(ids), rtol=0, atol=1e-6)
    tpx.checkpoint.save(plain, f"{d}/plain")
    back, _ = _tp_fsdp(mesh, 9)
    tpx.checkpoint.load(back, f"{d}/plain")
    full, full_plain = tpx.checkpoint.full_state_dict(back), tpx.checkpoint.full_state_dict(plain)
    assert sorted(full) == sorted(full_plain)
    for key, value in full_plain.items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)


@needs_fsdp2_on_cpu
def test_fsdp2_tpx_checkpoint(tmp_path):
    """tpx.checkpoint on a TP x FSDP2 model: save and resume with the optimizer, and the same
    checkpoint read by the model sharded by tpx alone (and the other way)."""
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_checkpoints, 4, str(tmp_path))
