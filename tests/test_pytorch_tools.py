"""PyTorch's behaviour where tpx's TP meets PyTorch's own tools and conventions.

* ``CommDebugMode`` counts tpx's collectives under the keys of PyTorch's functional
  collectives, per module, as PyTorch's TP issues them; the results under the mode equal
  those outside it and the unsharded module's.
* A row-wise embedding's ``output_layouts=Shard(d)`` names a dimension of the OUTPUT
  (``[*ids.shape, D]``), as in PyTorch: with 1-D ids ``Shard(1)`` splits the features.
* ``parallelize_module(..., src_data_rank=None)`` on an existing module communicates nothing
  that ``CommDebugMode`` sees and keeps each rank's slice of its own module (warning when the
  ranks' modules differ); ``src_data_rank=1`` takes rank 1's weights.
* Under PyTorch's simulated ranks (``LocalTensorMode``, one process) tpx's plans and
  ``loss_parallel`` run through PyTorch's implementation of the same styles.
* ``loss_parallel`` takes class weights (``F.cross_entropy(..., weight=)``), equal to
  ``F.cross_entropy`` on the full logits, with label smoothing, ``ignore_index`` and every
  reduction, at uneven vocabulary splits.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import tpx
from harness import run_cases, run_ranks

funcol = torch.ops.c10d_functional


def _counts(mode) -> dict:
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items() if v}


def _run(model, x, watch: bool, weight=None):
    """Forward and backward of ``model`` on ``x``; the output, the input's gradient, the
    parameters' gradients (full tensors) and the counts of the forward and of both passes."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    for p in model.parameters():
        p.grad = None
    counts = None
    if watch:
        with CommDebugMode() as mode:
            out = model(x)
            fwd = _counts(mode)
            (out.float() * (weight if weight is not None else 1)).sum().backward()
            counts = (fwd, _counts(mode))
    else:
        out = model(x)
        (out.float() * (weight if weight is not None else 1)).sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return out, x.grad, grads, counts


def _linear_counts(rank, world, mesh):
    torch.manual_seed(0)
    ref = nn.Linear(12, 18)
    x = torch.randn(4 * world, 12)
    cases = [
        ("colwise", tpx.ColwiseParallel(), x, ({}, {"all_reduce": 1})),
        ("colwise, sequence-sharded input", tpx.ColwiseParallel(input_layouts=Shard(0)),
         x.chunk(world)[rank], ({"all_gather_into_tensor": 1},
                                {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1})),
        ("rowwise", tpx.RowwiseParallel(), x.tensor_split(world, -1)[rank],
         ({"all_reduce": 1}, {"all_reduce": 1})),
        ("rowwise, sequence-sharded output", tpx.RowwiseParallel(output_layouts=Shard(0)),
         x.tensor_split(world, -1)[rank],
         ({"reduce_scatter_tensor": 1},
          {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1})),
    ]
    for name, style, inp, expected in cases:
        model = tpx.parallelize_module(copy.deepcopy(ref), mesh, style)
        plain = _run(model, inp, False)
        watched = _run(model, inp, True)
        assert watched[3] == expected, (name, watched[3])
        torch.testing.assert_close(watched[0], plain[0], msg=name)
        torch.testing.assert_close(watched[1], plain[1], msg=name)
        for key in plain[2]:
            torch.testing.assert_close(watched[2][key], plain[2][key], msg=f"{name} {key}")
    # the unsharded module: the colwise case's gradients
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh, tpx.ColwiseParallel())
    _, gx, grads, _ = _run(model, x, True)
    r = copy.deepcopy(ref)
    xr = x.clone().requires_grad_()
    r(xr).sum().backward()
    torch.testing.assert_close(gx, xr.grad)
    torch.testing.assert_close(grads["weight"], r.weight.grad)


def _module_counts(rank, world, mesh):
    """Per-module counts of an MLP (PyTorch's test_tp_examples idiom)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh,
                                   {"0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel()})
    x = torch.randn(5, 10, requires_grad=True)
    with CommDebugMode() as mode:
        out = model(x)
        out.sum().backward()
    torch.testing.assert_close(out, ref(x))
    per_module = mode.comm_module_counts
    assert per_module["Global"]["forward"] == {funcol.all_reduce: 1}
    assert per_module["Global"]["backward"] == {funcol.all_reduce: 1}
    assert dict(per_module["Sequential.2"]["forward"]) == {funcol.all_reduce: 1}
    assert dict(per_module["Sequential.0"]["backward"]) == {funcol.all_reduce: 1}


def _embedding_and_loss_counts(rank, world, mesh):
    torch.manual_seed(0)
    ref = nn.Embedding(17, 8)
    ids = torch.randint(0, 17, (3, 4))
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh,
                                   tpx.RowwiseParallel(input_layouts=Replicate()))
    with CommDebugMode() as mode:
        out = model(ids)
        out.sum().backward()
    assert _counts(mode) == {"all_reduce": 1}
    torch.testing.assert_close(out, ref(ids))

    logits = torch.randn(6, 19)
    target = torch.randint(0, 19, (6,))
    dist_logits = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with tpx.loss_parallel():
        with CommDebugMode() as mode:
            loss = F.cross_entropy(dist_logits, target, label_smoothing=0.1)
            assert _counts(mode) == {"all_reduce": 4}
            loss.backward()
        assert _counts(mode) == {"all_reduce": 4}
        plain = F.cross_entropy(dist_logits.detach().requires_grad_(), target,
                                label_smoothing=0.1)
    ref_logits = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref_logits, target, label_smoothing=0.1)
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    torch.testing.assert_close(plain.full_tensor(), expected)
    torch.testing.assert_close(dist_logits.grad.full_tensor(), ref_logits.grad)


def _embedding_output_dims(rank, world, mesh):
    """``output_layouts=Shard(d)`` is a dimension of the output, as in PyTorch."""
    torch.manual_seed(0)
    ref = nn.Embedding(16, 12, padding_idx=3)
    for ids, d in [(torch.arange(8), 1), (torch.arange(8), -1),
                   (torch.randint(0, 16, (2, 3 * world)), 1),
                   (torch.randint(0, 16, (2, 3)), 2), (torch.randint(0, 16, (2, 3)), -1)]:
        model = tpx.parallelize_module(copy.deepcopy(ref), mesh, tpx.RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(d)))
        full = copy.deepcopy(ref)
        expected = full(ids)
        od = d % expected.dim()
        weight = torch.randn(expected.shape)
        out = model(ids)
        torch.testing.assert_close(out, expected.chunk(world, od)[rank], msg=f"{ids.shape} {d}")
        (out * weight.chunk(world, od)[rank]).sum().backward()
        (expected * weight).sum().backward()
        torch.testing.assert_close(model.weight.grad.full_tensor(), full.weight.grad)
        dtensor_out = tpx.parallelize_module(copy.deepcopy(ref), mesh, tpx.RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(d), use_local_output=False))(ids)
        assert dtensor_out.placements == (Shard(od),)
        torch.testing.assert_close(dtensor_out.full_tensor(), expected)
    # 7 features do not split over 2 or 3 ranks: a clear error, before any collective
    model = tpx.parallelize_module(nn.Embedding(16, 7), mesh, tpx.RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1)))
    with pytest.raises(ValueError, match="embedding_dim"):
        model(torch.arange(8))


def _class_weights(rank, world, mesh):
    torch.manual_seed(0)
    vocab = 11  # uneven over 2, 3 and 4 ranks
    x = torch.randn(9, vocab)
    target = torch.randint(0, vocab, (9,))
    target[2] = target[5] = -100
    class_weight = torch.rand(vocab)
    start, end = tpx.shard_range(vocab)
    for eps in (0.0, 0.25):
        for reduction in ("mean", "sum", "none"):
            case = f"label_smoothing={eps} reduction={reduction}"
            xr = x.clone().requires_grad_()
            expected = F.cross_entropy(xr, target, weight=class_weight, label_smoothing=eps,
                                       reduction=reduction)
            expected.sum().backward()
            local = x[:, start:end].clone().requires_grad_()
            with tpx.loss_parallel():
                got = F.cross_entropy(local, target, weight=class_weight,
                                      label_smoothing=eps, reduction=reduction)
            got.sum().backward()
            torch.testing.assert_close(got, expected, msg=case)
            torch.testing.assert_close(local.grad, xr.grad[:, start:end], msg=case)
            # DTensor logits (PyTorch's loss_parallel idiom), through nn.CrossEntropyLoss
            dl = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
            with tpx.loss_parallel():
                got = nn.CrossEntropyLoss(weight=class_weight, label_smoothing=eps,
                                          reduction=reduction)(dl, target)
            got.full_tensor().sum().backward() if reduction == "none" else got.backward()
            torch.testing.assert_close(got.full_tensor(), expected, msg=case)
            torch.testing.assert_close(dl.grad.full_tensor(), xr.grad, msg=case)
    with pytest.raises(ValueError, match="FULL weight"):
        with tpx.loss_parallel():
            F.cross_entropy(x[:, start:end], target, weight=class_weight[start:end])


def _src_data_rank(rank, world, mesh):
    torch.manual_seed(rank)  # every rank's module differs
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))
    plan = {"0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel()}
    with CommDebugMode() as mode, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = tpx.parallelize_module(copy.deepcopy(model), mesh, plan, src_data_rank=None)
    assert mode.get_total_counts() == 0
    assert any("ranks' modules differ" in str(w.message) for w in caught)
    start, end = tpx.shard_range(16)
    torch.testing.assert_close(sharded[0].weight.to_local(), model[0].weight[start:end])
    torch.testing.assert_close(sharded[2].weight.to_local(), model[2].weight[:, start:end])
    with CommDebugMode() as mode:
        sharded = tpx.parallelize_module(copy.deepcopy(model), mesh, plan, src_data_rank=1)
    assert mode.get_total_counts() > 0
    full = [p.full_tensor() for p in sharded.parameters()]
    mine = [p.detach() for p in model.parameters()]
    if rank == 1:
        for got, exp in zip(full, mine):
            torch.testing.assert_close(got, exp)


def _layout_length_errors(rank, world, mesh):
    """The messages PyTorch's tests match, in an error that is both ValueError and
    AssertionError."""
    with pytest.raises(AssertionError, match="input_layouts and desired_input_layouts should "
                                             "have same length!"):
        tpx.PrepareModuleInput(input_layouts=(Shard(0), None),
                               desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match="input_kwarg_layouts and desired_input_kwarg_layouts "
                                         "should have same length!"):
        tpx.PrepareModuleInput(input_kwarg_layouts={"x": Shard(0)},
                               desired_input_kwarg_layouts={})
    with pytest.raises(AssertionError, match="output_layouts and desired_output_layouts should "
                                             "have same length!"):
        tpx.PrepareModuleOutput(output_layouts=(Shard(0), None),
                                desired_output_layouts=(Replicate(),))

    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    x = torch.randn(4, 6)
    inputs = tpx.parallelize_module(Two(), mesh, tpx.PrepareModuleInput(
        input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)))
    with pytest.raises(ValueError, match="module inputs and input_layouts should have same "
                                         "length!"):
        inputs(x, x)
    outputs = tpx.parallelize_module(Two(), mesh, tpx.PrepareModuleOutput(
        output_layouts=(Shard(0),), desired_output_layouts=(Replicate(),)))
    with pytest.raises(ValueError, match="module outputs and output_layouts should have same "
                                         "length!"):
        outputs(x, x)


def _cases(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    run_cases([(f.__name__, lambda f=f: f(rank, world, mesh)) for f in (
        _linear_counts, _module_counts, _embedding_and_loss_counts, _embedding_output_dims,
        _class_weights, _src_data_rank, _layout_length_errors)])


@pytest.mark.parametrize("world", [2, 3])
def test_pytorch_tools(world):
    run_ranks(_cases, world)


_SIMULATED = """
import copy, torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
import tpx

world = 3
dist.init_process_group("fake", rank=0, world_size=world)
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
x = torch.randn(5, 8)
expected = ref(x)
expected.sum().backward()
logits, target = torch.randn(6, 9), torch.randint(0, 9, (6,))


def each(t):  # every simulated rank's value
    values = list(t._local_tensors.values()) if isinstance(t, LocalTensor) else [t]
    assert values
    return values


with LocalTensorMode(world):
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh,
                                   {"0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel()})
    out = model(x)
    out.sum().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    with tpx.loss_parallel():
        loss = F.cross_entropy(distribute_tensor(logits, mesh, [Shard(1)]), target)
    loss = loss.full_tensor()
for value in each(out):
    torch.testing.assert_close(value, expected)
for name, p in ref.named_parameters():
    for value in each(grads[name]):
        torch.testing.assert_close(value, p.grad)
for value in each(loss):
    torch.testing.assert_close(value, F.cross_entropy(logits, target))
dist.destroy_process_group()
print("simulated ranks: ok")
"""


def test_simulated_ranks():
    """PyTorch's LocalTensorMode (one process, a fake group of 3 ranks): a tpx plan and
    tpx.loss_parallel equal the unsharded module on every simulated rank."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_SIMULATED)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated ranks: ok" in done.stdout
