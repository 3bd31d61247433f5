"""PyTorch's own tensor-parallel examples, run on tpx.

The cases of PyTorch's ``test/distributed/tensor/parallel/test_tp_examples.py``, written here
again, with PyTorch's test models and plans from
``torch.testing._internal.distributed._tensor.common_dtensor`` (``MLPModule``, ``Transformer``,
``Transformer.parallelize``) used as they are: only the tensor-parallel names the plan refers to
(``parallelize_module``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``) are swapped for tpx's. ``Replicate`` / ``Shard`` stay torch's own:
tpx's placements are the same classes.

Every case compares the output, every gradient and the parameters after each optimizer step
with the unsharded model on one device, at TP 2 and 4 on CPU/gloo. Where PyTorch counts
collectives with ``CommDebugMode``, tpx's are counted with ``tpx.comm_stats()``.
"""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch.nn as nn

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, comm_counts, run_cases, run_ranks

# PyTorch's test models (needs torch's test dependency expecttest, installed by `make test`),
# imported in the ranks only: importing torch.testing._internal in the pytest process would
# lock torch.backends' global flags for the other test files.
cd = None


def _load_torch_test_models():
    global cd
    from torch.testing._internal.distributed._tensor import common_dtensor

    cd = common_dtensor


@contextlib.contextmanager
def tpx_names():
    """``common_dtensor``'s module-level TP names, pointed at tpx's."""
    with mock.patch.multiple(cd, parallelize_module=tpx.parallelize_module,
                             ColwiseParallel=tpx.ColwiseParallel,
                             RowwiseParallel=tpx.RowwiseParallel,
                             SequenceParallel=tpx.SequenceParallel,
                             PrepareModuleInput=tpx.PrepareModuleInput):
        yield


def _mesh(world):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world))


def _tol(dtype):
    return dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)


def _check_module(ref: nn.Module, model: nn.Module, case: str, grad: bool = False, **tol):
    """Every parameter (or gradient) of the tpx model equals this rank's part of the unsharded
    model's (``_check_module`` of PyTorch's test), at the model dtype's tolerance."""
    assert_like_unsharded(model, ref, case, grad=grad,
                          **(tol or _tol(next(ref.parameters()).dtype)))


# --------------------------------------------------------------------------------------------
# MLP (MLPModule: net1 10 -> 16, ReLU, net2 16 -> 10)
# --------------------------------------------------------------------------------------------

def _mlp_training(rank, world, is_seq_parallel):
    case = f"mlp_training(seq_parallel={is_seq_parallel}) at TP {world}"
    torch.manual_seed(rank if is_seq_parallel else 0)
    inp = torch.rand(8, 10)
    model = cd.MLPModule("cpu")
    model_tp = copy.deepcopy(model)
    _check_module(model, model_tp, case)
    plan = {"net1": tpx.ColwiseParallel(input_layouts=cd.Shard(0)) if is_seq_parallel
            else tpx.ColwiseParallel(),
            "net2": tpx.RowwiseParallel(output_layouts=cd.Shard(0)) if is_seq_parallel
            else tpx.RowwiseParallel()}
    returned = tpx.parallelize_module(model_tp, _mesh(world), plan)
    assert returned is model_tp
    optim = torch.optim.SGD(model.parameters(), lr=0.25)
    optim_tp = torch.optim.SGD(model_tp.parameters(), lr=0.25)

    output = model(inp)
    output.sum().backward()
    with tpx.comm_stats() as stats:
        output_tp = model_tp(inp)
        output_tp.sum().backward()
    torch.testing.assert_close(output_tp, output, rtol=1e-5, atol=1e-6, msg=case)
    # As PyTorch's counts: SP {all_gather: 2 (net1's input forward, net2's output gradient),
    # reduce_scatter: 1 (net2's output)}; else {all_reduce: 1} (the input needs no gradient).
    expected = ({"all_gather": 2, "reduce_scatter": 1} if is_seq_parallel
                else {"all_reduce": 1})
    assert comm_counts(stats) == expected, (case, comm_counts(stats))
    if is_seq_parallel:
        for p in model.parameters():  # every rank saw its own rows: sum as PyTorch's test does
            torch.distributed.all_reduce(p.grad)
    _check_module(model, model_tp, case, grad=True)
    optim.step()
    optim_tp.step()
    _check_module(model, model_tp, case)
    inp = torch.rand(8, 10)
    torch.testing.assert_close(model_tp(inp), model(inp), rtol=1e-5, atol=1e-6, msg=case)


def _mlp_inference(rank, world):
    case = f"mlp_inference at TP {world}"
    with torch.inference_mode():
        torch.manual_seed(0)
        inp = torch.rand(8, 10)
        model = cd.MLPModule("cpu")
        model_tp = copy.deepcopy(model)
        tpx.parallelize_module(model_tp, _mesh(world),
                               {"net1": tpx.ColwiseParallel(), "net2": tpx.RowwiseParallel()})
        torch.testing.assert_close(model_tp(inp), model(inp), rtol=1e-5, atol=1e-6, msg=case)


def _weight_tying(rank, world):
    case = f"weight_tying at TP {world}"

    class TestModule(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.embedding = nn.Embedding(16, 8)
            torch.manual_seed(2)
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            return self.fc(self.embedding(x))

    model = TestModule()
    ref = copy.deepcopy(model)
    tpx.parallelize_module(model, _mesh(world),
                           {"embedding": tpx.ColwiseParallel(), "fc": tpx.RowwiseParallel()})
    torch.manual_seed(0)
    inp = torch.randint(16, [5])
    assert not torch.equal(model.embedding.weight, model.fc.weight), case
    model(inp).sum().backward()
    ref(inp).sum().backward()
    _check_module(ref, model, case, grad=True)
    assert not torch.equal(model.embedding.weight.grad, model.fc.weight.grad), case
    model.zero_grad()
    ref.zero_grad()

    # With weight tying: the embedding's columns and the row-parallel weight's columns are the
    # same block, so the tied parameter is one local tensor with both gradients.
    model.fc.weight = model.embedding.weight
    ref.fc.weight = ref.embedding.weight
    assert id(model.embedding.weight) == id(model.fc.weight)
    out, ref_out = model(inp), ref(inp)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6, msg=case)
    out.sum().backward()
    ref_out.sum().backward()
    assert id(model.embedding.weight.grad) == id(model.fc.weight.grad)
    _check_module(ref, model, case, grad=True)


def _mlp_cases(rank, world):
    _load_torch_test_models()
    run_cases([("mlp_training seq_parallel", lambda: _mlp_training(rank, world, True)),
                ("mlp_training", lambda: _mlp_training(rank, world, False)),
                ("mlp_inference", lambda: _mlp_inference(rank, world)),
                ("weight_tying", lambda: _weight_tying(rank, world))])


@pytest.mark.parametrize("world", [2, 4])
def test_mlp_and_weight_tying(world):
    run_ranks(_mlp_cases, world)


# --------------------------------------------------------------------------------------------
# Transformer (common_dtensor.Transformer with its own Transformer.parallelize plan)
# --------------------------------------------------------------------------------------------

def _transformer_step_check(model, model_tp, optim, optim_tp, inp, case, tol):
    output = model(inp)
    with tpx.comm_stats() as fwd:
        output_tp = model_tp(inp)
    torch.testing.assert_close(output_tp, output, **tol, msg=case)
    output.sum().backward()
    with tpx.comm_stats() as bwd:
        output_tp.sum().backward()
    _check_module(model, model_tp, case, grad=True, **tol)
    optim.step()
    with tpx.comm_stats() as opt:
        optim_tp.step()
    _check_module(model, model_tp, case, **tol)
    assert comm_counts(opt) == {}, (case, "optimizer step communicates", comm_counts(opt))
    optim.zero_grad()
    optim_tp.zero_grad()
    return comm_counts(fwd), comm_counts(bwd)


def _setup_transformer(world, seq_parallel, dtype, local_output_for_attn=True, **args):
    model_args = cd.ModelArgs(dropout_p=0.0, **args)
    torch.manual_seed(0)
    model = cd.Transformer(model_args).to(dtype=dtype)
    model_tp = copy.deepcopy(model)
    with tpx_names():
        returned = cd.Transformer.parallelize(model_tp, _mesh(world), seq_parallel,
                                              local_output_for_attn=local_output_for_attn)
    assert returned is model_tp
    return model_args, model, model_tp


def _math_sdpa():
    """DTensor has no sharding rule for the CPU flash-attention kernel (PyTorch runs this test
    on GPUs only); the math kernel decomposes into ops it shards, except the causal mask it
    adds as a plain tensor (hence ``use_attn_mask=False`` with DTensor attention on the CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _transformer_training(rank, world, seq_parallel, dtype):
    case = f"transformer_training(seq_parallel={seq_parallel}, {dtype}) at TP {world}"
    # As PyTorch's test: float64 with local attention outputs, float32 with DTensor outputs of
    # wq/wk/wv (ColwiseParallel(use_local_output=False)) and the attention run on DTensors.
    dtensor_attn = dtype == torch.float32
    extra = dict(use_attn_mask=False) if dtensor_attn else {}
    model_args, model, model_tp = _setup_transformer(world, seq_parallel, dtype,
                                                     local_output_for_attn=not dtensor_attn,
                                                     **extra)
    optim = torch.optim.Adam(model.parameters(), lr=0.25)
    optim_tp = torch.optim.Adam(model_tp.parameters(), lr=0.25)
    kinds = []
    model_tp.layers[0].attention.wq.register_forward_hook(
        lambda m, a, y: kinds.append((type(y).__name__, getattr(y, "placements", None))))
    torch.manual_seed(0)
    tol = _tol(dtype)
    if dtype == torch.float32:
        tol = dict(rtol=1e-4, atol=1e-4)  # Adam at lr 0.25 magnifies float32 rounding
    steps = 10 if dtype == torch.float64 else 2
    for step in range(steps):
        inp = torch.randint(model_args.vocab_size, [8, 8])
        with _math_sdpa() if dtensor_attn else contextlib.nullcontext():
            fwd, bwd = _transformer_step_check(model, model_tp, optim, optim_tp, inp,
                                               f"{case} step {step}", tol)
        n = model_args.n_layers
        if seq_parallel:
            assert fwd == {"all_gather": 2 * n + 2, "reduce_scatter": 2 * n + 2}, (case, fwd)
            # backward: per block the partial input gradients of wq, wk and wv are summed and
            # reduce-scattered once (1, as PyTorch), w1 reduce-scatters its input gradient,
            # wo's and w2's output gradients are all-gathered (2), the two SequenceParallel norms
            # sum their weight and bias gradients (one all-reduce per norm and call, 2; PyTorch
            # leaves them partial and reduces them in the optimizer step); the final norm's 1;
            # the head's input gradient is reduce-scattered; the embeddings' output gradients
            # are all-gathered (2).
            assert bwd == {"all_gather": 2 * n + 2, "reduce_scatter": 2 * n + 1,
                           "all_reduce": 2 * n + 1}, (case, bwd)
        else:
            assert fwd == {"all_reduce": 2 * n + 2, "all_gather": 1}, (case, fwd)
            assert bwd == {"all_reduce": 4 * n + 1}, (case, bwd)
    expected = ("DTensor", (cd.Shard(2),)) if dtensor_attn else ("Tensor", None)
    assert kinds and all(k == expected for k in kinds), (case, kinds[:1])


def _transformer_cases(rank, world):
    _load_torch_test_models()
    run_cases([(f"transformer_training seq_parallel={sp} {dt}",
                 lambda sp=sp, dt=dt: _transformer_training(rank, world, sp, dt))
                for sp in (True, False) for dt in (torch.float64, torch.float32)])


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_transformer_training(world):
    run_ranks(_transformer_cases, world)


# PyTorch's test_transformer_req_grad: (params left trainable, seq_parallel, dtype).
REQ_GRAD_CASES = [
    (None, True, torch.float32),
    (None, False, torch.float64),
    (("output.weight", "norm.weight", "norm.bias"), True, torch.float32),
    (("tok_embeddings.weight", "output.weight"), True, torch.float32),
    (("tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias"), True, torch.float32),
    (("tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias",
      "layers.1.ffn_norm.weight", "layers.1.ffn_norm.bias"), True, torch.float32),
    (("tok_embeddings.weight", "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.bias",
      "layers.1.ffn_norm.bias", "layers.1.feed_forward.w2.weight", "output.weight"), True,
     torch.float32),
]


def _transformer_req_grad(rank, world, thaw, seq_parallel, dtype):
    case = f"transformer_req_grad(thaw={thaw}, seq_parallel={seq_parallel}, {dtype}) at TP {world}"
    dtensor_attn = dtype == torch.float32  # as PyTorch's test, see _transformer_training
    extra = dict(use_attn_mask=False) if dtensor_attn else {}
    model_args, model, model_tp = _setup_transformer(world, seq_parallel, dtype,
                                                     local_output_for_attn=not dtensor_attn,
                                                     weight_tying=False, **extra)
    optim = torch.optim.Adam(model.parameters(), lr=0.25)
    optim_tp = torch.optim.Adam(model_tp.parameters(), lr=0.25)
    if thaw:
        for m in (model, model_tp):
            for n, p in m.named_parameters():
                if n not in thaw:
                    p.requires_grad_(False)
    torch.manual_seed(0)
    inp = torch.randint(model_args.vocab_size, [8, 8])
    tol = _tol(dtype) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    with _math_sdpa() if dtensor_attn else contextlib.nullcontext():
        _, bwd = _transformer_step_check(model, model_tp, optim, optim_tp, inp, case, tol)
    if thaw:
        # Nothing upstream of the first trainable parameter needs a gradient: the backward
        # stops there, and the collectives with it. With only the head and the final norm
        # trainable, the backward holds the head's input-gradient reduce-scatter (PyTorch's
        # {reduce_scatter: 1}) and the final norm's gradient sum (weight and bias in one).
        if set(thaw) == {"output.weight", "norm.weight", "norm.bias"}:
            assert bwd == {"all_reduce": 1, "reduce_scatter": 1}, (case, bwd)
    else:
        n = model_args.n_layers
        assert bwd == ({"all_gather": 2 * n + 2, "reduce_scatter": 2 * n + 1, "all_reduce": 2 * n + 1}
                       if seq_parallel else {"all_reduce": 4 * n + 1}), (case, bwd)


def _req_grad_cases(rank, world):
    _load_torch_test_models()
    run_cases([(f"req_grad {i}", lambda c=c: _transformer_req_grad(rank, world, *c))
                for i, c in enumerate(REQ_GRAD_CASES)])


@pytest.mark.parametrize("world", [2, 4])
def test_transformer_req_grad(world):
    run_ranks(_req_grad_cases, world)


def _checkpoint_activations(rank, world):
    _load_torch_test_models()
    for sp in (False, True):
        case = f"transformer checkpoint_activations seq_parallel={sp} at TP {world}"
        model_args, model, model_tp = _setup_transformer(world, sp, torch.float64,
                                                         checkpoint_activations=True)
        optim = torch.optim.Adam(model.parameters(), lr=0.25)
        optim_tp = torch.optim.Adam(model_tp.parameters(), lr=0.25)
        torch.manual_seed(0)
        for step in range(2):
            inp = torch.randint(model_args.vocab_size, [8, 8])
            _transformer_step_check(model, model_tp, optim, optim_tp, inp, f"{case} {step}",
                                    _tol(torch.float64))


@pytest.mark.parametrize("world", [2, 4])
def test_transformer_checkpoint_activations(world):
    run_ranks(_checkpoint_activations, world)
