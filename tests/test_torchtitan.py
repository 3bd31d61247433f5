"""torchtitan's own training step with tpx: its Llama 3 model, its ``apply_tp`` (sequence
parallelism, loss parallelism: the output layer returns vocab-sharded ``DTensor`` logits), its
loss (``cross_entropy_loss`` inside its train context) and an optimizer step, with only the TP
names swapped for tpx's, equal to one device at TP 2 (and 4, slow).

torchtitan 0.2.2 is the last release whose TP goes through ``torch.distributed.tensor.parallel``
(installed with ``--no-deps`` plus ``tyro`` and ``torchdata``). Importing its Llama 3 imports
three modules whose dependencies it does not install and this step never uses (its MoE Triton
kernels, its metrics' tensorboard, its datasets' ``datasets``): where one is missing, a module
whose every name raises when used stands in for it, in the test's processes only."""

import copy
import itertools
import importlib.util
import sys
import types
from unittest import mock

import pytest
import torch

import tpx
from harness import assert_like_unsharded, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (make test installs it)")


class _StandIn(types.ModuleType):
    """A module of torchtitan whose third-party dependency is not installed here and which a
    dense Llama's training step never uses: any name imported from it is a class that raises
    when used."""

    def __init__(self, name: str, needs: str) -> None:
        super().__init__(name)
        self.needs = needs

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        message = f"{self.__name__}.{attr} needs {self.needs}, which is not installed"

        class Unavailable:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(message)

            def __call__(self, *args, **kwargs):  # pragma: no cover
                raise RuntimeError(message)

        Unavailable.__name__ = attr
        return Unavailable


# torchtitan's modules that import a dependency torchtitan does not declare for its core:
# (module, the dependency)
_OPTIONAL = [("torchtitan.models.moe.kernels", "triton"),
             ("torchtitan.components.metrics", "tensorboard"),
             ("torchtitan.hf_datasets.text_datasets", "datasets")]


def _import_torchtitan():
    for module, needs in _OPTIONAL:
        if importlib.util.find_spec(needs) is None and module not in sys.modules:
            sys.modules[module] = _StandIn(module, needs)
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import get_train_context
    from torchtitan.models.llama3.infra import parallelize as titan_parallelize
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    return cross_entropy_loss, get_train_context, titan_parallelize, TransformerModelArgs, Transformer


def _train_step_like_one_device(rank, world, steps=3):
    from torch.distributed.device_mesh import DeviceMesh

    loss_fn, train_context, titan, Args, Transformer = _import_torchtitan()
    args = Args(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1003, multiple_of=16,
                max_seq_len=32)
    torch.manual_seed(0)
    ref = Transformer(args)
    with torch.no_grad():  # as torchtitan calls it (on meta-initialised models)
        ref.init_weights()
    model = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", torch.arange(world))
    # torchtitan's apply_tp, unchanged, with the TP names it imported swapped for tpx's
    with mock.patch.multiple(titan, parallelize_module=tpx.parallelize_module,
                             ColwiseParallel=tpx.ColwiseParallel,
                             RowwiseParallel=tpx.RowwiseParallel,
                             SequenceParallel=tpx.SequenceParallel,
                             PrepareModuleInput=tpx.PrepareModuleInput):
        titan.apply_tp(model, mesh, loss_parallel=True, enable_float8_tensorwise_tp=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        labels = torch.randint(0, args.vocab_size, (2, 16), generator=gen)
        labels[0, :3] = -100  # torchtitan's IGNORE_INDEX
        ref_loss = loss_fn(ref(tokens), labels)
        ref_loss.backward()
        # torchtitan's train context enters torch's loss_parallel(): tpx's in its place
        with mock.patch("torch.distributed.tensor.parallel.loss_parallel", tpx.loss_parallel):
            with train_context(True)():
                pred = model(tokens)
                assert type(pred).__name__ == "DTensor", type(pred)
                loss = loss_fn(pred, labels)
                loss.backward()
        what = f"torchtitan Llama 3, TP={world}, step {step}"
        if type(loss).__name__ == "DTensor":  # a replicated DTensor, as PyTorch's loss_parallel
            loss = loss.full_tensor()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"loss ({what}): {m}")
        assert_like_unsharded(model, ref, what, grad=True, rtol=1e-4, atol=2e-5)
        for opt, m in zip(opts, (ref, model)):
            opt.step()
            m.zero_grad()
    assert_like_unsharded(model, ref, f"torchtitan Llama 3, TP={world}, after {steps} steps",
                          rtol=1e-4, atol=2e-5)


def test_torchtitan_train_step_tp2():
    run_ranks(_train_step_like_one_device, 2)


@pytest.mark.slow
def test_torchtitan_train_step_tp4():
    run_ranks(_train_step_like_one_device, 4)


def _grouped_experts_like_one_device(rank, world, ckpt):
    """torchtitan's GroupedExperts (w1 / w3 [E, I, H], w2 [E, H, I], called on tokens grouped by
    expert) under tpx.GroupedExpertsTensorParallel (I = 10, uneven over 3 and 4 ranks) and
    tpx.GroupedExpertsParallel (E = 7 whole experts, uneven too): the parameters are Shard(1) /
    Shard(2), or Shard(0), DTensors of the global shapes; the output (with
    output_layouts=Partial(), as torchtitan's TensorParallel leaves it, summed here; with
    Replicate(), by the style), the input's gradient (summed by the style in both), every
    parameter's gradient and the parameters after 2 SGD steps equal one device; then
    dcp.save(model.state_dict()) reloads into the unsharded module exactly as saved. Experts without tokens, and padding rows after the routed ones, included."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    _import_torchtitan()
    from torchtitan.models.moe.moe import GroupedExperts

    styles = {tpx.GroupedExpertsTensorParallel: {"w1": 1, "w3": 1, "w2": 2},
              tpx.GroupedExpertsParallel: {"w1": 0, "w3": 0, "w2": 0}}
    for (style, dims), out_layout in itertools.product(styles.items(), (Partial(), Replicate())):
        what = f"GroupedExperts TP={world} {style.__name__} output {out_layout}"
        torch.manual_seed(0)
        ref = GroupedExperts(dim=12, hidden_dim=10, num_experts=7, use_grouped_mm=False)
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 0.3)
        model = tpx.parallelize_module(copy.deepcopy(ref), None,
                                       style(output_layouts=out_layout))
        for name, dim in dims.items():
            p = getattr(model, name)
            assert isinstance(p, DTensor) and tuple(p.placements) == (Shard(dim),), (what, name)
            assert p.shape == getattr(ref, name).shape, (what, name, p.shape)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
        for step in range(2):
            g = torch.Generator().manual_seed(10 + step)
            # experts without tokens; at step 1 none reaches rank 0's at TP 3 and 4
            counts = torch.tensor([[3, 0, 5, 2, 1, 0, 4], [0, 0, 0, 5, 2, 1, 4]][step])
            x = torch.randn(int(counts.sum()) + 2, 12, generator=g)  # 2 padding rows
            ref_x, x = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref_out = ref(ref_x, counts)
            # by position, then by name
            out = model(x, counts) if step == 0 else model(x=x, num_tokens_per_expert=counts)
            assert type(out) is torch.Tensor and out.shape == ref_out.shape, (what, out.shape)
            weight = torch.randn(ref_out.shape, generator=g)
            (ref_out * weight).sum().backward()
            (out * weight).sum().backward()
            if isinstance(out_layout, Partial):  # this rank's partial sum
                out = out.detach().clone()
                dist.all_reduce(out)
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"output ({what}): {m}")
            torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"input gradient ({what}): {m}")
            assert_like_unsharded(model, ref, f"{what}, step {step}", grad=True,
                                  rtol=1e-5, atol=1e-5)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert_like_unsharded(model, ref, f"{what}, after 2 steps", rtol=1e-5, atol=1e-5)
        # PyTorch's checkpoint of the sharded experts reloads into the unsharded module
        path = os.path.join(ckpt, f"{style.__name__}-{type(out_layout).__name__}")
        dcp.save(model.state_dict(), checkpoint_id=path)
        whole = GroupedExperts(dim=12, hidden_dim=10, num_experts=7, use_grouped_mm=False)
        state = whole.state_dict()
        dcp.load(state, checkpoint_id=path)
        for name, t in state.items():  # exactly the saved model
            torch.testing.assert_close(t, getattr(model, name).full_tensor(), rtol=0, atol=0,
                                       msg=lambda m: f"{name} reloaded ({what}): {m}")
    if world == 3:  # 4 experts split as tpx.shard_range does leave rank 2 none
        few = GroupedExperts(dim=12, hidden_dim=10, num_experts=4, use_grouped_mm=False)
        with pytest.raises(ValueError, match=r"rank\(s\) \[2\] without an expert"):
            tpx.parallelize_module(few, None, tpx.GroupedExpertsParallel())
        assert not isinstance(few.w1, DTensor)  # nothing changed


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(2, marks=pytest.mark.slow)])
def test_grouped_experts_tensor_parallel(world, tmp_path):
    run_ranks(_grouped_experts_like_one_device, world, str(tmp_path))


def _titan_models(tmp_path, world, only=None):
    """benchmarks/torchtitan_models.py at TP ``world``: torchtitan's Qwen 3 (dense, tied, MoE),
    Llama 4, DeepSeek-V3 (MoE, q LoRA, dense) and gpt-oss, parallelized by their own code,
    with PyTorch's TP and with tpx's names swapped in (for the MoE models also with their
    experts under tpx.GroupedExpertsTensorParallel); ``only``: the benchmark's ``--only``."""
    import json
    import sys
    from pathlib import Path

    from harness import run_command

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "titan.json"
    r = run_command([sys.executable, str(root / "benchmarks" / "torchtitan_models.py"),
                     "--tp", str(world), "--out", str(out)]
                    + (["--only", only] if only else []), timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    if any(row["status"] == "crash" for row in rows):
        print(r.stderr[-6000:])  # a dead rank's traceback is in its stderr
    got = {}
    for row in rows:
        got.setdefault((row["model"], row["loss_parallel"]), {})[row["impl"]] = row
    ran = {m for m, _ in got}
    assert len(got) >= (16 if only is None else 2), sorted(got)
    # the MoE models whose experts are torchtitan's GroupedExperts also ran with them sharded by
    # tpx.GroupedExpertsTensorParallel in place of torchtitan's TensorParallel
    grouped = {m for (m, _), impls in got.items() if "tpx_experts" in impls}
    assert grouped == ran & {"qwen3_moe", "qwen3_moe sbe=False", "llama4", "deepseek_v3",
                             "deepseek_v3 q_lora", "deepseek_v3_dense"}, sorted(grouped)
    for key, impls in got.items():
        assert {"torch", "tpx"} <= set(impls) <= {"torch", "tpx", "tpx_experts"}, (key, impls)
        if impls["torch"]["status"] == "pass":  # tpx trains wherever PyTorch's TP does
            for impl in set(impls) - {"torch"}:
                # the whole record (a message that is not a string is shortened by pytest)
                assert impls[impl]["status"] == "pass", json.dumps(impls[impl], indent=1)
    # torchtitan 0.2.2's own MoE TP with scores applied after the experts (#2387): the router's
    # gradient is wrong under PyTorch's TP, and under tpx alike (the same styles of its own).
    sbe = [v for (m, _), v in got.items() if m.endswith("sbe=False")]
    assert sbe and all(v["torch"]["status"] == v["tpx"]["status"] == "wrong" for v in sbe)


def test_torchtitan_models_tp2(tmp_path):
    # a mixture of experts, with torchtitan's scores applied after the experts too (its
    # attention and dense layers are Qwen 3's); every model in the slow tier
    _titan_models(tmp_path, 2, only="qwen3_moe")


@pytest.mark.slow
def test_torchtitan_all_models_tp2(tmp_path):
    _titan_models(tmp_path, 2)


@pytest.mark.slow
def test_torchtitan_models_tp4(tmp_path):
    _titan_models(tmp_path, 4)
