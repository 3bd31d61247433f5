"""An optimizer built before ``parallelize_module`` over a 2-D mesh (as scripts written for the
1-D API do) steps the sharded weights: the optimizer is handed the blocks' ``DTensor`` parameters in the
places of the plain ones."""

import copy

import torch
import torch.nn.functional as F

import tpx
import tpx.checkpoint
from harness import run_ranks
from tiny_llama import Decoder


def _optimizer_before(rank, world):
    torch.manual_seed(0)
    ref = Decoder(vocab=36, dim=16, n_heads=4, n_kv_heads=2, hidden=24)
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    mesh = tpx.init_mesh("2d")
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout="2d"))
    # The optimizer holds the model's parameters now (the blocks' DTensors in the places of
    # the plain ones).
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert {id(p) for p in model.parameters()} <= held
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 36, (4, 6), generator=gen)
        labels = torch.randint(0, 36, (4, 6), generator=gen)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            F.cross_entropy(m(ids).flatten(0, 1), labels.flatten()).backward()
            o.step()
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


def test_optimizer_built_before_mesh_parallelize():
    run_ranks(_optimizer_before, 4)


def _nothing_changes_on_error(rank, world):
    torch.manual_seed(0)
    model = Decoder(vocab=36, dim=16, n_heads=4, n_kv_heads=2, hidden=24)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    mesh = tpx.init_mesh("2d")
    plan = tpx.plans.auto(model, layout="2d")
    bad = {k: (tpx.MeshAttention(num_heads=3) if isinstance(v, tpx.MeshAttention) else v)
           for k, v in plan.items()}
    assert bad != plan
    try:
        tpx.parallelize_module(model, mesh, bad)
    except ValueError as e:
        assert "3 attention heads" in str(e), e
    else:
        raise AssertionError("3 heads on a 2 x 2 mesh must be an error")
    assert {n: type(m) for n, m in model.named_modules()} == types
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_mesh_plan_error_changes_nothing():
    run_ranks(_nothing_changes_on_error, 4)
