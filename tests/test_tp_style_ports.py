"""The user-visible behaviour of PyTorch's parallel styles and ``parallelize_module``, on tpx.

Cases of PyTorch's ``test_tp_style.py`` and ``test_parallelize_api.py`` written here again with
tpx's names (placements are torch's own classes), at TP 2, 3 (features that do not divide) and
4, each compared with the unsharded ``nn`` module on random inputs; plus the drop-in guarantees
that PyTorch users rely on: ``parallelize_module`` changes the module object it is given,
``use_local_output=False`` hands back a ``DTensor``, tpx layers take ``DTensor`` inputs, and
what tpx cannot do is an error before anything changes.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, comm_counts, run_cases, run_ranks


def _local(size, rank, world):
    s, e = tpx.group.shard_bounds(size, rank, world)
    return s, e


def _check_params(ref, model, case, grad=False, **tol):
    assert_like_unsharded(model, ref, case, grad=grad, **(tol or dict(rtol=1e-5, atol=1e-6)))


# ------------------------------------------------------------------ test_tp_style.py

def _colwise_style(rank, world, mesh):
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    s, e = _local(16, rank, world)
    x = torch.rand(8, 16, requires_grad=True)
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh, tpx.ColwiseParallel())
    with tpx.comm_stats() as fwd:
        out = mod(x)
    assert out.shape == (8, e - s)
    assert comm_counts(fwd) == {}
    with tpx.comm_stats() as bwd:
        out.sum().backward()
    assert comm_counts(bwd) == {"all_reduce": 1}
    ref_x = x.detach().clone().requires_grad_()
    ref = model(ref_x)
    torch.testing.assert_close(out, ref[:, s:e])
    ref.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)

    # Sequence-parallel input: this rank's rows of a [8 * world, 16] input.
    torch.manual_seed(100 + rank)
    xl = torch.rand(8, 16, requires_grad=True)
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh,
                                 tpx.ColwiseParallel(input_layouts=Shard(0)))
    with tpx.comm_stats() as st:
        out = mod(xl)
        assert out.shape == (8 * world, e - s)
        assert comm_counts(st) == {"all_gather": 1}
        out.sum().backward()
    assert comm_counts(st) == {"all_gather": 1, "reduce_scatter": 1}
    full = [torch.empty_like(xl) for _ in range(world)]
    dist.all_gather(full, xl.detach())
    full = torch.cat(full).requires_grad_()
    ref = model(full)
    torch.testing.assert_close(out, ref[:, s:e])
    ref.sum().backward()
    torch.testing.assert_close(xl.grad, full.grad[8 * rank:8 * (rank + 1)])


def _colwise_embedding(rank, world, mesh):
    torch.manual_seed(0)
    model = nn.Embedding(16, 16)
    ids = torch.randint(0, 16, (4, 2))
    s, e = _local(16, rank, world)
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh, tpx.ColwiseParallel())
    with tpx.comm_stats() as st:
        out = mod(ids)
        assert out.shape == (4, 2, e - s)
        out.sum().backward()
    assert comm_counts(st) == {}
    ref = model(ids)
    ref.sum().backward()
    torch.testing.assert_close(out, ref[..., s:e])
    _check_params(model, mod, "colwise embedding", grad=True)


def _preserves_requires_grad(rank, world, mesh):
    for style in (tpx.ColwiseParallel(), tpx.RowwiseParallel()):
        model = nn.Linear(16, 16)
        model.weight.requires_grad = False
        mod = tpx.parallelize_module(copy.deepcopy(model), mesh, style)
        assert not mod.weight.requires_grad and mod.bias.requires_grad, style


def _rowwise_style(rank, world, mesh):
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    s, e = _local(16, rank, world)
    x = torch.rand(12, 16)
    xl = x[:, s:e].clone().requires_grad_()
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh, tpx.RowwiseParallel())
    with tpx.comm_stats() as st:
        out = mod(xl)
        assert out.shape == (12, 16)
        assert comm_counts(st) == {"all_reduce": 1}
        out.sum().backward()
    assert comm_counts(st) == {"all_reduce": 1}
    ref_x = x.clone().requires_grad_()
    ref = model(ref_x)
    torch.testing.assert_close(out, ref)
    ref.sum().backward()
    torch.testing.assert_close(xl.grad, ref_x.grad[:, s:e])
    _check_params(model, mod, "rowwise", grad=True)

    # Output sharded along dim 0 (12 rows: divisible at TP 2, 3 and 4).
    xl = x[:, s:e].clone().requires_grad_()
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh,
                                 tpx.RowwiseParallel(output_layouts=Shard(0)))
    with tpx.comm_stats() as st:
        out = mod(xl)
        assert out.shape == (12 // world, 16)
        assert comm_counts(st) == {"reduce_scatter": 1}
        out.sum().backward()
    assert comm_counts(st) == {"reduce_scatter": 1, "all_gather": 1}
    rows = 12 // world
    torch.testing.assert_close(out, model(x)[rank * rows:(rank + 1) * rows])

    # As the attention of PyTorch's Transformer with sequence parallelism: DTensor q/k/v of
    # [batch, heads, seq, head_dim] sharded by heads, the (math) attention on DTensors, its
    # output viewed as [batch, seq, heads * head_dim] into RowwiseParallel(output_layouts=
    # Shard(1)). The backward's sequence all-gather gives the layer's input gradient in a
    # strided layout; tpx hands DTensors contiguous gradients (torch < 2.6's DTensor ops in the
    # attention's backward fail on a strided one: "view size is not compatible"). 12 heads of
    # 2 and a sequence of 12: whole heads and equal blocks at TP 2, 3 and 4.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = nn.Linear(24, 16)
    q, k, v = (torch.rand(2, 12, 12, 2) for _ in range(3))
    qd, kd, vd = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh,
                                 tpx.RowwiseParallel(output_layouts=Shard(1),
                                                     use_local_output=False))
    g = torch.rand(2, 12, 16)
    with sdpa_kernel(SDPBackend.MATH):
        att = F.scaled_dot_product_attention(qd, kd, vd)
        out = mod(att.transpose(1, 2).contiguous().view(2, 12, 24))
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        out.backward(distribute_tensor(g, mesh, [Shard(1)]))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_att = F.scaled_dot_product_attention(*ref_in)
        ref = model(ref_att.transpose(1, 2).contiguous().view(2, 12, 24))
        ref.backward(g)
    torch.testing.assert_close(out.full_tensor(), ref)
    for got, exp in zip((qd, kd, vd), ref_in):
        torch.testing.assert_close(got.grad.full_tensor(), exp.grad)


def _rowwise_embedding(rank, world, mesh):
    torch.manual_seed(0)
    model = nn.Embedding(16, 16)
    ids = torch.randint(0, 16, (4, 2))
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh,
                                 tpx.RowwiseParallel(input_layouts=Replicate()))
    with tpx.comm_stats() as st:
        out = mod(ids)
        assert out.shape == (4, 2, 16)
        assert comm_counts(st) == {"all_reduce": 1}
        out.sum().backward()
    assert comm_counts(st) == {"all_reduce": 1}
    ref = model(ids)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    _check_params(model, mod, "rowwise embedding", grad=True)

    # Sharded output along the sequence of [batch, seq] ids: [2, 12] -> out [2, 12 / world,
    # 16] (output dim 1; with 1-D ids, Shard(1) splits the features: test_pytorch_tools.py).
    ids = torch.randint(0, 16, (2, 12))
    mod = tpx.parallelize_module(copy.deepcopy(model), mesh,
                                 tpx.RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Shard(1)))
    with tpx.comm_stats() as st:
        out = mod(ids)
        assert comm_counts(st) == {"reduce_scatter": 1}
        out.sum().backward()
    assert comm_counts(st) == {"reduce_scatter": 1, "all_gather": 1}
    rows = 12 // world
    torch.testing.assert_close(out, model(ids)[:, rank * rows:(rank + 1) * rows])


def _prepare_module_input(rank, world, mesh):
    x = torch.rand(2, 16) + rank
    mod = tpx.parallelize_module(nn.Identity(), mesh, tpx.PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate()))
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x)
    out = mod(x)  # PyTorch's default: a DTensor with the desired placement
    assert isinstance(out, DTensor) and out.placements == (Replicate(),)
    assert out.shape == (2 * world, 16)
    torch.testing.assert_close(out.full_tensor(), torch.cat(full))
    mod = tpx.parallelize_module(nn.Identity(), mesh, tpx.PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(), use_local_output=True))
    out = mod(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, torch.cat(full))


def _prepare_module_input_multiple(rank, world, mesh):
    class TestModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x, y):
            return self.linear(x) + y

    with pytest.raises(ValueError, match="same length"):
        tpx.PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=(Replicate(), None))
    s, e = _local(8, rank, world)
    m = TestModule()
    tpx.parallelize_module(m.linear, mesh, tpx.ColwiseParallel())
    tpx.parallelize_module(m, mesh, tpx.PrepareModuleInput(input_layouts=Shard(0),
                                                           desired_input_layouts=Replicate()))
    with pytest.raises(ValueError, match="positional inputs"):
        m(torch.randn(2, 8), torch.ones(world * 2, e - s))
    torch.manual_seed(0)
    m = TestModule()
    ref = copy.deepcopy(m)
    tpx.parallelize_module(m.linear, mesh, tpx.ColwiseParallel())
    assert isinstance(m.linear, tpx.ColumnParallelLinear)   # changed in place
    tpx.parallelize_module(m, mesh, tpx.PrepareModuleInput(
        input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)))
    x = (torch.randn(2, 8) + rank).requires_grad_()
    y = torch.rand(world * 2, e - s)
    with tpx.comm_stats() as st:
        out = m(x, y)  # x reaches the column layer as a Replicate() DTensor
        assert comm_counts(st) == {"all_gather": 1}
        out.backward(torch.ones_like(out))
    # its partial input gradient goes back to the shards in one reduce-scatter
    assert comm_counts(st) == {"all_gather": 1, "reduce_scatter": 1}, comm_counts(st)
    assert not isinstance(out, DTensor) and out.shape == (world * 2, e - s)
    full = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(full, x.detach())
    gathered = torch.cat(full).requires_grad_()
    expect = ref.linear(gathered)
    torch.testing.assert_close(out, expect[:, s:e] + y)
    expect.backward(torch.ones_like(expect))
    torch.testing.assert_close(x.grad, gathered.grad[rank * 2:(rank + 1) * 2])


def _prepare_module_kwargs_input(rank, world, mesh):
    class TestKwargModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x, *, y, z=2):
            return self.linear(x) + y + z

    torch.manual_seed(0)
    m = TestKwargModule()
    ref = copy.deepcopy(m)
    tpx.parallelize_module(m.linear, mesh, tpx.ColwiseParallel(use_local_output=False))
    tpx.parallelize_module(m, mesh, tpx.PrepareModuleInput(
        input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()}))
    x = torch.randn(world, 8)
    y = torch.rand(1, 8) + rank
    with tpx.comm_stats() as st:
        out = m(x, y=y)
    assert comm_counts(st) == {"all_gather": 1}
    assert isinstance(out, DTensor) and out.shape == (world, 8)
    full = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(full, y)
    torch.testing.assert_close(out.full_tensor(), ref.linear(x) + torch.cat(full) + 2)

    # A DTensor kwarg is redistributed and stays a DTensor.
    y_dt = DTensor.from_local(y, mesh, [Shard(0)])
    out = m(x, y=y_dt)
    torch.testing.assert_close(out.full_tensor(), ref.linear(x) + torch.cat(full) + 2)


def _prepare_module_output(rank, world, mesh):
    x = torch.rand(12, 16)
    mod = tpx.parallelize_module(nn.Identity(), mesh, tpx.PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    rows = 12 // world
    torch.testing.assert_close(mod(x), x[rank * rows:(rank + 1) * rows])


def _sequence_parallel_style(rank, world, mesh):
    torch.manual_seed(0)
    batch, n, dim = 4, 3, 12
    global_input = torch.rand(batch, n * world, dim, requires_grad=True)
    sharded = distribute_tensor(global_input.detach(), mesh, [Shard(1)]).requires_grad_()
    for affine in (True, False):
        norm = nn.LayerNorm(dim, elementwise_affine=affine)
        with torch.no_grad():
            for p in norm.parameters():
                p.uniform_(0.5, 1.5)
        sp = tpx.parallelize_module(copy.deepcopy(norm), mesh, tpx.SequenceParallel())
        out = norm(global_input)
        out.sum().backward()
        with tpx.comm_stats() as st:
            sout = sp(sharded)
            assert isinstance(sout, DTensor) and sout.placements == (Shard(1),)
            assert comm_counts(st) == {}
            sout.backward(torch.ones_like(sout))
        # tpx sums the parameter gradients in the backward, weight and bias in one all-reduce
        # (PyTorch leaves them Partial).
        assert comm_counts(st) == ({"all_reduce": 1} if affine else {}), comm_counts(st)
        torch.testing.assert_close(sout.full_tensor(), out)
        if affine:
            # The weight gradient sums batch * seq = 48 terms of size ~1 that nearly cancel:
            # a float32 summation order of its own (per rank, then the all-reduce) differs
            # from one device's by up to ~48 ulp of 1.
            _check_params(norm, sp, "sequence parallel layernorm", grad=True,
                          rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded.grad.full_tensor(), global_input.grad / 1)

    # A plain input is this rank's block: the output is its DTensor (PyTorch's default), or the
    # local block with use_local_output=True; a batch-sharded DTensor is redistributed.
    norm = nn.LayerNorm(dim)
    sp = tpx.parallelize_module(copy.deepcopy(norm), mesh, tpx.SequenceParallel())
    local = global_input.detach()[:, rank * n:(rank + 1) * n]
    out = sp(local)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert out.shape == global_input.shape
    torch.testing.assert_close(out.full_tensor(), norm(global_input.detach()))
    batch_sharded = distribute_tensor(global_input.detach(), mesh, [Shard(0)])
    out = sp(batch_sharded)
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), norm(global_input.detach()))
    sp = tpx.parallelize_module(copy.deepcopy(norm), mesh,
                                tpx.SequenceParallel(use_local_output=True))
    out = sp(local)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, norm(local))
    out = sp(batch_sharded)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, norm(local))


# ------------------------------------------------------------------ test_parallelize_api.py

class MLPModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 12)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def _compare_module(ref, model, inp, case, rowwise=False, rank=0, world=1):
    opt = torch.optim.SGD(ref.parameters(), lr=0.25)
    opt_tp = torch.optim.SGD(model.parameters(), lr=0.25)
    _check_params(ref, model, case)
    out = ref(inp)
    if rowwise:
        s, e = _local(inp.shape[-1], rank, world)
        inp = inp[..., s:e]
    out_tp = model(inp)
    if isinstance(out_tp, DTensor):
        out_tp = out_tp.full_tensor()
    torch.testing.assert_close(out_tp, out, msg=case)
    out.sum().backward()
    out_tp.sum().backward()
    _check_params(ref, model, case, grad=True)
    opt.step()
    opt_tp.step()
    _check_params(ref, model, case)


def _parallelize_api(rank, world, mesh):
    import warnings

    warnings.simplefilter("ignore", DeprecationWarning)
    from tpx.parallel.compat import (ColwiseParallel, make_input_replicate_1d,
                                     make_output_replicate_1d)

    torch.manual_seed(0)
    inp = torch.rand(12, 10)
    # test_parallelize_mlp (PyTorch calls the private _parallelize_mlp; the public call here)
    model, model_tp = MLPModule(), MLPModule()
    tpx.parallelize_module(model_tp, mesh, tpx.PairwiseParallel())
    _compare_module(model, model_tp, inp, "parallelize_mlp")
    # test_parallelize_mlp_with_module_api
    model, model_tp = MLPModule(), MLPModule()
    tpx.parallelize_module(model_tp, mesh, {
        "net1": ColwiseParallel(make_input_replicate_1d, make_output_replicate_1d),
        "net2": ColwiseParallel(make_input_replicate_1d, make_output_replicate_1d)})
    _compare_module(model, model_tp, inp, "mlp_with_module_api")
    # test_parallelize_mlp_with_module_api_nested
    model = nn.Sequential(OrderedDict([("dummy_encoder", MLPModule())]))
    model_tp = nn.Sequential(OrderedDict([("dummy_encoder", MLPModule())]))
    tpx.parallelize_module(model_tp, mesh, {
        "dummy_encoder.net1": ColwiseParallel(make_input_replicate_1d, make_output_replicate_1d),
        "dummy_encoder.net2": ColwiseParallel(make_input_replicate_1d, make_output_replicate_1d)})
    _compare_module(model, model_tp, inp, "mlp_with_module_api_nested")
    # test_linear_row_wise_parallel (the full input on every rank, its columns given to the
    # layer)
    torch.manual_seed(5)
    model = nn.Linear(16, 10)
    model_tp = copy.deepcopy(model)
    tpx.parallelize_module(model_tp, mesh, tpx.RowwiseParallel())
    torch.manual_seed(0)
    _compare_module(model, model_tp, torch.rand(9, 16), "linear_row_wise", rowwise=True,
                    rank=rank, world=world)
    # test_linear_col_wise_parallel
    torch.manual_seed(5)
    model = nn.Linear(10, 16)
    model_tp = copy.deepcopy(model)
    tpx.parallelize_module(model_tp, mesh, ColwiseParallel(make_input_replicate_1d,
                                                           make_output_replicate_1d))
    _compare_module(model, model_tp, torch.rand(8, 10), "linear_col_wise")


# ------------------------------------------------------------------ drop-in guarantees

def _in_place(rank, world, mesh):
    # A leaf given to parallelize_module with one style: the caller's object is the parallel
    # module afterwards, whether or not the return value is used (PyTorch's
    # `parallelize_module(module.output, mesh, ColwiseParallel(...))`).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7))
    ref = copy.deepcopy(model)
    head = model[2]
    tpx.parallelize_module(model[0], mesh, tpx.ColwiseParallel())
    tpx.parallelize_module(head, mesh, tpx.RowwiseParallel())
    assert isinstance(model[0], tpx.ColumnParallelLinear) and model[2] is head
    assert isinstance(head, tpx.RowParallelLinear)
    x = torch.rand(5, 6)
    torch.testing.assert_close(model(x), ref(x))
    # A plan entry: references the caller holds to submodules see the parallel module too.
    model = copy.deepcopy(ref)
    first = model[0]
    tpx.parallelize_module(model, mesh, {"0": tpx.ColwiseParallel(output_layouts=Replicate())})
    assert first is model[0] and isinstance(first, tpx.ColumnParallelLinear)
    torch.testing.assert_close(first(x), ref[0](x))
    # An embedding alone, with a forward hook the user registered before: kept.
    emb = nn.Embedding(11, 4)
    ref_emb = copy.deepcopy(emb)
    seen = []
    emb.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    tpx.parallelize_module(emb, mesh, tpx.RowwiseParallel())
    ids = torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(emb(ids), ref_emb(ids))
    assert seen == [torch.Size([3, 5, 4])]

    # A Linear subclass with its own forward (an LM head scaling its logits): PyTorch's style
    # of the same name shards it, keeping the forward; output and gradients as one device.
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Scaled(nn.Linear):
        def __init__(self, i, o):
            super().__init__(i, o)
            self.scale = nn.Parameter(torch.rand(o) + 0.5)

        def forward(self, x):
            return super().forward(x) * self.scale

    # 13 features split unevenly (PyTorch's row style alone takes a plain input as an even
    # split: tpx gives it the input's global shape first).
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(4, 13), nn.ReLU(), MyLinear(13, 4))
    ref = copy.deepcopy(model)
    tpx.parallelize_module(model, mesh, {"0": tpx.ColwiseParallel(),
                                         "2": tpx.RowwiseParallel()})
    assert type(model[0]) is Scaled and isinstance(model[0].scale, DTensor)
    x = torch.randn(3, 4)
    out, expected = model(x), ref(x)
    torch.testing.assert_close(out, expected)
    (out * x.sum(-1, keepdim=True)).sum().backward()
    (expected * x.sum(-1, keepdim=True)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)

    # What tpx cannot shard raises before anything changes: a parameter PyTorch's row style
    # would leave whole beside the sharded weight.
    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="its own forward"):
        tpx.parallelize_module(model, mesh, {"0": tpx.ColwiseParallel(),
                                             "1": tpx.RowwiseParallel()})
    assert type(model[0]) is nn.Linear and type(model[1]) is Scaled
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _placements(rank, world, mesh):
    import torch.distributed._tensor as old_path

    assert tpx.Replicate is Replicate and tpx.Shard is Shard
    assert old_path.Replicate is Replicate
    torch.manual_seed(0)
    model = nn.Linear(8, 6)
    ref = copy.deepcopy(model)
    tpx.parallelize_module(model, mesh, tpx.RowwiseParallel(input_layouts=old_path.Replicate(),
                                                            output_layouts=Replicate()))
    x = torch.rand(3, 8)
    torch.testing.assert_close(model(x), ref(x))
    with pytest.raises(ValueError, match="partial sums"):
        tpx.RowwiseParallel(input_layouts=Partial())
    with pytest.raises(TypeError, match="Replicate"):
        tpx.ColwiseParallel(input_layouts="replicate")


def _dtensor_io(rank, world, mesh):
    # use_local_output=False: a DTensor with the style's placement and the global shape, also
    # when the features do not divide (13 at TP 2, 3, 4).
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(5, 13), nn.Linear(13, 4)
    ref1, ref2 = copy.deepcopy(fc1), copy.deepcopy(fc2)
    tpx.parallelize_module(fc1, mesh, tpx.ColwiseParallel(use_local_output=False))
    tpx.parallelize_module(fc2, mesh, tpx.RowwiseParallel(use_local_output=False))
    x = torch.rand(3, 5, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    h = fc1(x)
    assert isinstance(h, DTensor) and h.placements == (Shard(1),) and h.shape == (3, 13)
    h = torch.relu(h)                       # DTensor ops run on it
    y = fc2(h)                              # a DTensor input to a tpx layer
    assert isinstance(y, DTensor) and y.placements == (Replicate(),)
    ref = ref2(torch.relu(ref1(xr)))
    torch.testing.assert_close(y.full_tensor(), ref)
    y.to_local().sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    _check_params(ref1, fc1, "dtensor fc1", grad=True)
    _check_params(ref2, fc2, "dtensor fc2", grad=True)
    # A DTensor input in another placement is redistributed to what the layer needs.
    col = tpx.ColumnParallelLinear.from_linear(ref1, mesh)
    xs = distribute_tensor(xr.detach(), mesh, [Shard(0)]) if 3 % world == 0 else \
        distribute_tensor(xr.detach(), mesh, [Replicate()])
    s, e = _local(13, rank, world)
    torch.testing.assert_close(col(xs), ref1(xr)[:, s:e])
    # A DTensor on other ranks than the layer's is an error.
    if world > 2:
        sub = dist.new_group([0, 1])
        if rank in (0, 1):
            from torch.distributed.device_mesh import DeviceMesh

            small = DeviceMesh.from_group(sub, "cpu")
            with pytest.raises(ValueError, match="ranks"):
                col(distribute_tensor(xr.detach(), small, [Replicate()]))


def _style_cases(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = [(f.__name__, lambda f=f: f(rank, world, mesh)) for f in (
        _colwise_style, _colwise_embedding, _preserves_requires_grad, _rowwise_style,
        _rowwise_embedding, _prepare_module_input, _prepare_module_input_multiple,
        _prepare_module_kwargs_input, _prepare_module_output, _sequence_parallel_style,
        _parallelize_api, _in_place, _placements, _dtensor_io)]
    run_cases(cases)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_torch_style_cases(world):
    run_ranks(_style_cases, world)
