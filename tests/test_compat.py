"""The tensor-parallel API of earlier PyTorch releases on tpx: the seed's ToyModel example
(``DeviceMesh("cpu", torch.arange(world))``, ``PairwiseParallel()``, SGD on
``torch.rand(20, 10)``) with only the import changed equals one device over several steps at
world 2 and 3 (32 hidden and 5 outputs over 3 ranks); each ``make_input_*`` /
``make_output_*`` helper on plain tensors and inside the older styles; the older
``SequenceParallel``; ``tp_mesh_dim``; the deprecation warnings and the errors."""

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks, local_vs
from tpx.parallel import compat


def close(a, b, what):
    a = local_vs(a, b)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _from_rank0(module):
    module = copy.deepcopy(module)
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p, 0)
    return module


def _check_toy(rank, world):
    # The seed's example, with its import changed to tpx and "cuda" -> "cpu" (no GPU here).
    from torch.distributed._tensor import DeviceMesh
    from tpx import PairwiseParallel, parallelize_module

    torch.manual_seed(1000 + rank)  # torchrun-like: every rank seeded differently
    device_mesh = DeviceMesh("cpu", torch.arange(0, world))
    model = ToyModel()
    ref = _from_rank0(model)  # the one-device model: rank 0's
    LR = 0.25
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.warns(DeprecationWarning, match="ColwiseParallel"):
        style = PairwiseParallel()
    model = parallelize_module(model, device_mesh, style)  # noqa: F841 (the example's line)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    assert isinstance(model.net1, tpx.ColumnParallelLinear)
    assert isinstance(model.net2, tpx.RowParallelLinear)
    # The optimizer was built before parallelize_module (as in the example): the sharded
    # layers hold the same Parameter objects, now with their shards.
    assert {id(p) for p in model.parameters()} == {id(p) for g in optimizer.param_groups
                                                   for p in g["params"]}
    for i in range(4):
        torch.manual_seed(i)
        inp = torch.rand(20, 10)
        output = model(inp)
        output.sum().backward()
        optimizer.step()
        ref_out = ref(inp)
        ref_out.sum().backward()
        ref_opt.step()
        close(output, ref_out.detach(), f"step {i} output")
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        close(full[key], value, f"after 4 SGD steps: {key}")


@pytest.mark.parametrize("world", [2, 3])
def test_toy_model_pairwise_equals_one_device(world):
    run_ranks(_check_toy, world)


class MLP(nn.Module):
    def __init__(self, d=6, h=8, o=4, layers=2):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(h, o)
        if layers == 3:
            self.fc3 = nn.Linear(o, o)

    def forward(self, x):
        x = self.fc2(self.act(self.fc1(x)))
        return self.fc3(x) if hasattr(self, "fc3") else x


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn(*args, **kwargs)


def _compare(rank, world, ref, model, x_full, to_local_in, to_local_out, gen, what):
    """Runs ``model`` on this rank's part of ``x_full`` and ``ref`` on all of it; compares
    the outputs (this rank's part), the input gradient and the parameter gradients."""
    x = to_local_in(x_full).clone().requires_grad_(True)
    xr = x_full.clone().requires_grad_(True)
    y, y_ref = model(x), ref(xr)
    close(y, to_local_out(y_ref.detach()), f"{what} forward")
    g_full = torch.randn(y_ref.shape, generator=gen)
    (y * to_local_out(g_full)).sum().backward()
    (y_ref * g_full).sum().backward()
    close(x.grad, to_local_in(xr.grad), f"{what} grad input")
    assert_like_unsharded(model, ref, what, grad=True)


def _check_helpers_in_styles(rank, world):
    gen = torch.Generator().manual_seed(5)
    mesh = compat.DeviceMesh("cpu", torch.arange(world))

    def block(d):  # this rank's block of dim d (equal blocks)
        return lambda t: t.chunk(world, d)[rank]

    same = lambda t: t  # noqa: E731
    n = 2 * world  # rows: divisible by the group size
    cases = [
        # (style, layers, input to local, output to local)
        (lambda: compat.PairwiseParallel(), 3, same, same),
        (lambda: compat.SequenceParallel(), 2, block(0), block(0)),
        (lambda: compat.PairwiseParallel(compat.make_input_shard_1d, compat.make_output_tensor),
         2, block(0), same),
        (lambda: compat.PairwiseParallel(
            compat.make_input_replicate_1d,
            functools.partial(compat.make_output_shard_1d, dim=-1)), 2, same, block(-1)),
        (lambda: compat.PairwiseParallel(compat.make_input_reshard_replicate,
                                         compat.make_output_replicate_1d), 2, block(0), same),
    ]
    for i, (style, layers, in_local, out_local) in enumerate(cases):
        torch.manual_seed(20 + rank)
        model = MLP(d=6, h=4 * world + 1, o=2 * world, layers=layers)
        ref = _from_rank0(model)
        model = tpx.parallelize_module(model, mesh, _quiet(style))
        if layers == 3:  # the unpaired last layer stays whole, with rank 0's weights
            assert type(model.fc3) is nn.Linear
            assert torch.equal(model.fc3.weight.to_local(), ref.fc3.weight)  # Replicate()
        x_full = torch.randn(n, 6, generator=gen)
        _compare(rank, world, ref, model, x_full, in_local, out_local, gen, f"pairwise case {i}")

    # The older ColwiseParallel / RowwiseParallel with each remaining helper.
    lin_cases = [
        (lambda: compat.ColwiseParallel(compat.make_input_shard_1d_last_dim,
                                        compat.make_output_replicate_1d), block(-1), same),
        (lambda: compat.ColwiseParallel(compat.make_input_reshard_replicate,
                                        compat.make_sharded_output_tensor), block(0), block(-1)),
        (lambda: compat.ColwiseParallel(), same, block(-1)),
        (lambda: compat.RowwiseParallel(compat.make_input_replicate_1d,
                                        compat.make_output_reshard_tensor), same, block(0)),
        (lambda: compat.RowwiseParallel(functools.partial(compat.make_input_shard_1d, dim=0),
                                        compat.make_output_tensor), block(0), same),
        (lambda: compat.RowwiseParallel(), block(-1), same),
    ]
    for i, (style, in_local, out_local) in enumerate(lin_cases):
        torch.manual_seed(40 + rank)
        model = nn.Sequential(nn.Linear(3 * world, 2 * world))
        ref = _from_rank0(model)
        model = tpx.parallelize_module(model, mesh, {"0": _quiet(style)})
        x_full = torch.randn(n, 3 * world, generator=gen)
        _compare(rank, world, ref, model, x_full, in_local, out_local, gen, f"linear case {i}")


@pytest.mark.parametrize("world", [2, 3])
def test_helpers_inside_older_styles(world):
    run_ranks(_check_helpers_in_styles, world)


def _check_helpers_on_tensors(rank, world):
    gen = torch.Generator().manual_seed(9)
    mesh = compat.DeviceMesh("cpu", torch.arange(world))
    full = torch.randn(2 * world, 3 * world, generator=gen)
    local0 = full.chunk(world, 0)[rank]
    modern = {
        "make_input_replicate_1d": "ColwiseParallel(input_layouts=Replicate())",
        "make_input_shard_1d": "input_layouts=Shard(dim)",
        "make_input_shard_1d_last_dim": "RowwiseParallel(input_layouts=Shard(-1))",
        "make_input_reshard_replicate": "ColwiseParallel(input_layouts=Shard(0))",
        "make_output_replicate_1d": "output_layouts=Replicate()",
        "make_output_tensor": "output_layouts=Replicate()",
        "make_sharded_output_tensor": "ColwiseParallel(output_layouts=Shard(-1))",
        "make_output_shard_1d": "RowwiseParallel(output_layouts=Shard(dim))",
        "make_output_reshard_tensor": "RowwiseParallel(output_layouts=Shard(0))",
    }

    def call(name, *args, **kwargs):
        with pytest.warns(DeprecationWarning) as record:
            out = getattr(compat, name)(*args, **kwargs)
        assert any(modern[name] in str(w.message) for w in record), (name, record[0].message)
        return out

    # Input helpers: a plain tensor is this rank's part of the placement named.
    assert call("make_input_replicate_1d", full, mesh) is full
    assert call("make_input_shard_1d", local0, mesh, dim=0) is local0
    assert call("make_input_shard_1d_last_dim", (local0,), mesh) is local0  # a tuple: its first
    x = local0.clone().requires_grad_(True)
    gathered = call("make_input_reshard_replicate", x, mesh)
    assert torch.equal(gathered, full)
    g = torch.randn(full.shape, generator=gen)
    (gathered * g).sum().backward()
    assert torch.equal(x.grad, g.chunk(world, 0)[rank])
    # Output helpers: a plain tensor is replicated.
    assert call("make_output_replicate_1d", full, mesh) is full
    assert call("make_output_tensor", full, mesh) is full
    assert call("make_sharded_output_tensor", local0) is local0
    assert torch.equal(call("make_output_shard_1d", full, mesh, dim=1),
                       full.chunk(world, 1)[rank])
    assert torch.equal(call("make_output_reshard_tensor", full, None), local0)
    # A DTensor is redistributed as PyTorch did.
    from torch.distributed.tensor import Replicate as TR, Shard as TS, distribute_tensor

    dt = distribute_tensor(full, mesh, [TS(0)])
    out = call("make_output_tensor", dt, mesh)
    assert type(out) is torch.Tensor and torch.equal(out, full)
    out = call("make_input_shard_1d_last_dim", distribute_tensor(full, mesh, [TR()]))
    assert out.placements == (TS(1),) and torch.equal(out.to_local(), full.chunk(world, 1)[rank])
    with pytest.raises(RuntimeError, match="expect a torch.Tensor"):
        _quiet(compat.make_input_replicate_1d, [1, 2], mesh)


@pytest.mark.parametrize("world", [2, 3])
def test_helpers_on_tensors(world):
    run_ranks(_check_helpers_on_tensors, world)


def _check_mesh_dim_and_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    # tp_mesh_dim on a 2-D mesh: TP over dim 1 (all ranks), dim 0 has size 1.
    mesh2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(60 + rank)
    model = ToyModel()
    ref = _from_rank0(model)
    with pytest.warns(DeprecationWarning, match=r"device_mesh\['tp'\]"):
        model = tpx.parallelize_module(model, mesh2d, _quiet(compat.PairwiseParallel), 1)
    assert model.net1.world_size == world
    x = torch.rand(3, 10, generator=torch.Generator().manual_seed(2))
    close(model(x), ref(x), "tp_mesh_dim=1")
    with pytest.raises(ValueError, match="tp_mesh_dim=2 is not a dimension"):
        _quiet(tpx.parallelize_module, ToyModel(), mesh2d, _quiet(compat.PairwiseParallel),
               tp_mesh_dim=2)
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        tpx.parallelize_module(ToyModel(), mesh2d, _quiet(compat.PairwiseParallel))

    # Clear errors where the older semantics cannot be kept.
    with pytest.raises(ValueError, match="at least two nn.Linear"):
        tpx.parallelize_module(nn.Sequential(nn.Linear(4, 4)), None,
                               _quiet(compat.PairwiseParallel))
    # nn.MultiheadAttention is split by heads (tests/test_pairwise_attention.py); heads that
    # do not divide by the TP size are an error naming both.
    with pytest.raises(ValueError, match=rf"num_heads=3, which does not divide by the TP size "
                                         rf"{world}"):
        tpx.parallelize_module(nn.MultiheadAttention(9, 3), None,
                               _quiet(compat.PairwiseParallel))
    with pytest.raises(ValueError, match="partial sums"):
        _quiet(compat.PairwiseParallel, None, compat.make_sharded_output_tensor)
    with pytest.raises(ValueError, match="cannot translate an arbitrary"):
        _quiet(compat.PairwiseParallel, lambda x, mesh: x)
    with pytest.raises(ValueError, match="output helper"):
        _quiet(compat.ColwiseParallel, compat.make_output_tensor)
    with pytest.raises(ValueError, match="compat.SequenceParallel"):
        tpx.parallelize_module(MLP(), None, tpx.SequenceParallel())
    # Warnings of the styles name the current API.
    with pytest.warns(DeprecationWarning, match=r"RowwiseParallel\(output_layouts=Shard\(0\)\)"):
        compat.SequenceParallel()
    with pytest.warns(DeprecationWarning, match="RowwiseParallel"):
        tpx.PairwiseParallel()
    assert tpx.PairwiseParallel is compat.PairwiseParallel
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


@pytest.mark.parametrize("world", [2])
def test_tp_mesh_dim_warnings_and_errors(world):
    run_ranks(_check_mesh_dim_and_errors, world)
