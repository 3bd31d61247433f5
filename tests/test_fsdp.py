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
