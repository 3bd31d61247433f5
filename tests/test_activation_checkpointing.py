"""Activation checkpointing of a tpx model: the collectives each mode runs again and the
activations it keeps, against PyTorch's TP with the same plan (a 2-layer Llama of transformers
at TP 2, with and without sequence parallelism).

The modes: none; ``torch.utils.checkpoint(..., use_reentrant=False)`` around each decoder
layer; transformers' ``gradient_checkpointing_enable(use_reentrant=False)``; selective
checkpointing with ``tpx.checkpoint_policy`` (PyTorch's TP: its functional collectives saved,
the same policy for its ops); torchtitan's op-level selective checkpointing (its ``apply_ac``,
its Llama 3 save list with ``tpx.SAVE_OPS`` added). In each, the loss and gradients equal one
device; the collectives of one forward and backward, counted by ``tpx.comm_stats`` (what the
engine issues) and by ``CommDebugMode`` (tpx's ops decomposed into PyTorch's functional
collectives, with ``tpx.comm_stats`` agreeing), equal the counts pinned in :data:`EXPECTED` and
are at most PyTorch's TP's (``-m slow``: transformers' and torchtitan's modes; the bytes each
mode keeps for the backward). Op by op: each operator of ``tpx.SAVE_OPS`` runs its collectives
once under ``tpx.checkpoint_policy``; the ops recorded as two autograd nodes under saved-tensor
hooks (``tpx.ops.core.register_saved_first``: the row-parallel linears, ``linear_2d``) give the
bits of the one node without them and are not run again when last in a checkpointed region.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import importlib.util
import time

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import tpx
from harness import assert_like_unsharded, run_ranks

# tpx's collectives in one forward and backward of the model below, per (sequence parallel,
# mode); PyTorch's TP, measured in the same run, may not issue fewer.
EXPECTED = {
    (False, "none"): 17, (False, "checkpoint"): 19, (False, "hf"): 19, (False, "sac"): 17,
    (False, "hf_sac"): 17, (False, "torchtitan"): 17,
    (True, "none"): 26, (True, "checkpoint"): 32, (True, "hf"): 32, (True, "sac"): 26,
    (True, "hf_sac"): 26, (True, "torchtitan"): 26,
}

_FUNCOL = torch.ops._c10d_functional
# PyTorch's TP under selective checkpointing: its own collectives saved, as tpx's policy saves
# tpx's
_TORCH_COLLECTIVES = [_FUNCOL.all_reduce.default, _FUNCOL.reduce_scatter_tensor.default,
                      _FUNCOL.all_gather_into_tensor.default]

_HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def _llama(hidden=32, layers=2, vocab=96):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + hidden // 4,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).train()


def _plan(styles, sp: bool) -> dict:
    """The plan, in the names of ``styles`` (``tpx`` or ``torch.distributed.tensor.parallel``):
    q/k/v and gate/up colwise, o/down rowwise, the embedding vocab-parallel, the LM head
    colwise with replicated logits; with ``sp`` the norms sequence-parallel, the residual
    stream split along the sequence from the first layer's input to the LM head's."""
    seq = Shard(1) if sp else Replicate()
    plan = {
        "model.embed_tokens": styles.RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": styles.ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": styles.ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": styles.ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": styles.RowwiseParallel(output_layouts=seq),
        "model.layers.*.mlp.gate_proj": styles.ColwiseParallel(),
        "model.layers.*.mlp.up_proj": styles.ColwiseParallel(),
        "model.layers.*.mlp.down_proj": styles.RowwiseParallel(output_layouts=seq),
        "lm_head": styles.ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sp:
        plan.update({
            "model.layers.0": styles.PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                use_local_output=True),
            "model.layers.*.input_layernorm": styles.SequenceParallel(),
            "model.layers.*.self_attn": styles.PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True),
            "model.layers.*.post_attention_layernorm": styles.SequenceParallel(),
            "model.layers.*.mlp": styles.PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                use_local_output=True),
            "model.norm": styles.SequenceParallel(),
        })
    return plan


class _Checkpointed(nn.Module):
    """A decoder layer called through ``checkpoint_fn(layer, *args, **kwargs)`` (the layer's
    hooks, tpx's included, inside the checkpoint)."""

    def __init__(self, layer: nn.Module, checkpoint_fn) -> None:
        super().__init__()
        self.layer, self.checkpoint_fn = layer, checkpoint_fn

    def forward(self, *args, **kwargs):
        return self.checkpoint_fn(self.layer, *args, **kwargs)


def _checkpoint_layers(model, checkpoint_fn) -> None:
    layers = model.model.layers
    for i, layer in enumerate(list(layers)):
        layers[i] = _Checkpointed(layer, checkpoint_fn)


def _torchtitan_sac(model) -> None:
    """torchtitan's op-level selective checkpointing: its ``apply_ac`` on the decoder, with its
    Llama 3 save list and ``tpx.SAVE_OPS`` added."""
    from test_torchtitan import _import_torchtitan

    _import_torchtitan()
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    apply_ac(model.model, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
             op_sac_save_list=set(_op_sac_save_list) | set(tpx.SAVE_OPS))
    torch._C._dynamo.eval_frame._set_lru_cache(True)  # apply_ac turns it off process-wide


def _with_ac(model, mode: str, impl: str):
    if mode == "checkpoint":
        _checkpoint_layers(model, functools.partial(checkpoint, use_reentrant=False))
    elif mode == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode in ("sac", "hf_sac"):
        policy = tpx.checkpoint_policy if impl == "tpx" else _TORCH_COLLECTIVES
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        if mode == "hf_sac":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": context_fn})
        else:
            _checkpoint_layers(model, functools.partial(checkpoint, use_reentrant=False,
                                                        context_fn=context_fn))
    elif mode == "torchtitan":
        _torchtitan_sac(model)
    return model


def _sharded(ref, mesh, impl: str, sp: bool, mode: str):
    import torch.distributed.tensor.parallel as torch_tp

    styles = tpx if impl == "tpx" else torch_tp
    model = styles.parallelize_module(copy.deepcopy(ref), mesh, _plan(styles, sp))
    return _with_ac(model, mode, impl)


def _step(model, ids):
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _counted(model, ids):
    """One forward and backward: (tpx.comm_stats's count of the engine's collectives, the
    loss), then under CommDebugMode (its count, tpx.comm_stats's count there)."""
    with tpx.comm_stats() as engine:
        loss = _step(model, ids)
    with tpx.comm_stats() as stats, CommDebugMode() as mode:
        _step(model, ids)
    return engine.calls(), loss, mode.get_total_counts(), stats.calls()


def _collectives(rank, world, sp, modes):
    """Each of ``modes`` on the tpx model, the one-device model and PyTorch's TP model: losses
    and gradients against one device, the counts against :data:`EXPECTED` and PyTorch's TP."""
    mesh = init_device_mesh("cpu", (world,))
    ref = _llama()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    ref_loss = _step(ref, ids)
    for mode in modes:
        what = f"{mode}, sequence parallel {sp}"
        one = _with_ac(copy.deepcopy(ref), mode, "tpx")  # the same module names
        torch.testing.assert_close(_step(one, ids), ref_loss, rtol=0, atol=0)
        model = _sharded(ref, mesh, "tpx", sp, mode)
        engine, loss, watched, stats = _counted(model, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"loss ({what}): {m}")
        assert_like_unsharded(model, one, what, grad=True, rtol=1e-5, atol=1e-5)
        theirs = _sharded(ref, mesh, "torch", sp, mode)
        with CommDebugMode() as mode_torch:
            torch_loss = _step(theirs, ids)
        torch.testing.assert_close(torch_loss, ref_loss, rtol=1e-5, atol=1e-5)
        counts = dict(engine=engine, watched=watched, stats=stats,
                      torch=mode_torch.get_total_counts())
        assert engine == watched == stats == EXPECTED[(sp, mode)], (what, counts)
        assert watched <= counts["torch"], (what, counts)


_FAST = ["none", "checkpoint", "sac"]


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collectives_per_mode(sp):
    run_ranks(_collectives, 2, sp, _FAST)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collectives_transformers_and_torchtitan(sp):
    if not _HAS_TORCHTITAN:
        pytest.skip("torchtitan is not installed (make test installs it)")
    run_ranks(_collectives, 2, sp, ["hf", "torchtitan"])


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collectives_transformers_selective(sp):
    run_ranks(_collectives, 2, sp, ["hf_sac"])


def _settled_bytes() -> int:
    """CPU tensor bytes allocated now, once the process group's threads have freed their
    temporaries (the count stops falling)."""
    last = tpx.memory.cpu_memory_allocated()
    for _ in range(100):
        time.sleep(0.005)
        now = tpx.memory.cpu_memory_allocated()
        if now == last:
            break
        last = now
    return last


def _held_and_peak(model, ids):
    """The CPU bytes a forward leaves allocated for its backward (the loss's graph: saved
    activations, selective checkpointing's saved outputs, the checkpoints' inputs), and the
    peak of forward and backward, both beyond what was allocated before (after a first step,
    so that tpx's own process groups and caches exist)."""
    _step(model, ids)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    base = _settled_bytes()
    with tpx.memory.track_cpu() as peak:
        loss = model(input_ids=ids, labels=ids).loss
        held = _settled_bytes() - base
        loss.backward()
        del loss
    return held, peak.peak_extra


MEMORY_MODES = ["none", "checkpoint", "sac"] + (["torchtitan"] if _HAS_TORCHTITAN else [])


def _memory(rank, world, report):
    mesh = init_device_mesh("cpu", (world,))
    with tpx.memory.track_cpu():  # counting from here on
        pass
    ref = _llama(hidden=128, layers=4, vocab=512)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(1))
    held = {}
    for sp in (False, True):
        for mode in MEMORY_MODES:
            for impl in ("tpx", "torch"):
                model = _sharded(ref, mesh, impl, sp, mode)
                held[(sp, mode, impl)] = _held_and_peak(model, ids)
                del model
                gc.collect()
    for sp in (False, True):
        for impl in ("tpx", "torch"):
            none, full, sac = (held[(sp, m, impl)][0] for m in ("none", "checkpoint", "sac"))
            assert full < sac < none, (sp, impl, full, sac, none)
        for mode in ("none", "checkpoint"):  # the same tensors kept
            assert held[(sp, mode, "tpx")][0] <= held[(sp, mode, "torch")][0], (sp, mode, held)
    if rank == 0:
        report.put(held)


@pytest.mark.slow
def test_activation_memory():
    """What each mode keeps for the backward (hidden 128, 4 layers, 2 x 128 tokens, TP 2):
    checkpointing keeps least, tpx's policy more (the collectives' outputs), no checkpointing
    most; without selective checkpointing tpx keeps no more than PyTorch's TP. The bytes are
    the table of docs/training.md (``-s`` prints them)."""
    import multiprocessing

    report = multiprocessing.Manager().Queue()
    run_ranks(_memory, 2, report)
    held = report.get()
    for (sp, mode, impl), (kept, peak) in sorted(held.items()):
        print(f"sequence parallel {sp!s:5} {mode:10} {impl:5} kept {kept / 2**20:7.2f} MiB, "
              f"peak {peak / 2**20:7.2f} MiB")


def _op_cases(rank, world):
    """(name, function of the inputs, inputs): one tpx operator of ``tpx.SAVE_OPS`` each (the
    layout changes' gathers and sums through ``tpx.mappings``), on the default group."""
    import torch.distributed as dist

    pg = dist.group.WORLD
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    ids, target = torch.randint(0, 10, (4,), generator=g), torch.randint(0, 10, (4,), generator=g)
    start = 5 * rank  # a vocabulary of 10, 5 rows per rank
    ops = tpx.ops
    return [
        ("all_gather_matmul", lambda a, b: ops.all_gather_matmul(a, b, 0)[1],
         (randn(4, 8), randn(8, 6))),
        ("matmul_reduce_scatter", lambda a, b: ops.matmul_reduce_scatter(a, b, 0),
         (randn(4, 8), randn(8, 6))),
        ("matmul_all_reduce", lambda a, b: ops.matmul_all_reduce(a, b), (randn(4, 8), randn(8, 6))),
        ("vocab_parallel_embedding", lambda w: ops.vocab_parallel_embedding(w, ids, start),
         (randn(5, 6),)),
        ("vocab_parallel_cross_entropy", lambda x: ops.vocab_parallel_cross_entropy_rows(
            x, target, start, 10)[0], (randn(4, 5),)),
        ("linear_cross_entropy", lambda h, w: ops.linear_cross_entropy_rows(
            h, w, target, start, 10)[0], (randn(4, 6), randn(5, 6))),
        ("mesh_all_gather", lambda x: tpx.mappings.gather_dim(x, 0, [3] * world, 3 * rank, pg),
         (randn(3, 4),)),
        ("mesh_all_reduce", lambda x: tpx.mappings.all_reduce_sum(x, pg), (randn(3, 4),)),
    ]


def _each_op_saved(rank, world):
    """Under selective checkpointing with ``tpx.checkpoint_policy``, a function of each
    operator whose backward needs the operator's output (``y * y``) runs the operator's
    collectives once, as without checkpointing (plain non-reentrant checkpointing runs them
    again), with the gradients' bits of no checkpointing."""
    context_fn = functools.partial(create_selective_checkpoint_contexts, tpx.checkpoint_policy)
    cases = _op_cases(rank, world)
    for name, fn, inputs in cases:
        def square(*xs, fn=fn):
            y = fn(*xs)
            return y * y

        plain = _calls_and_grads(square, inputs)
        full = _calls_and_grads(square, inputs, checkpoint_kwargs={})
        saved = _calls_and_grads(square, inputs, checkpoint_kwargs=dict(context_fn=context_fn))
        assert saved[0] == plain[0] < full[0], (name, plain[0], full[0], saved[0])
        for a, b in zip(plain[1], saved[1]):
            assert torch.equal(a, b), name
    others = set(tpx.SAVE_OPS) - {getattr(torch.ops.tpx, n).default for n, _, _ in cases}
    assert others == {torch.ops.tpx.linear_2d.default, torch.ops.tpx.linear_3d.default}, others


def test_selective_checkpointing_saves_each_op():
    run_ranks(_each_op_saved, 2)


def _calls_and_grads(fn, inputs, params=(), checkpoint_kwargs=None):
    """One forward and backward of ``fn(*inputs)``, through non-reentrant checkpointing with
    ``checkpoint_kwargs`` unless they are ``None``: tpx's collectives, the gradients of the
    inputs and of ``params`` (``DTensor`` s: their local parts)."""
    xs = [x.clone().requires_grad_() for x in inputs]
    for p in params:
        p.grad = None
    with tpx.comm_stats() as stats:
        out = fn(*xs) if checkpoint_kwargs is None else checkpoint(
            fn, *xs, use_reentrant=False, **checkpoint_kwargs)
        out.sum().backward()
    return stats.calls(), [x.grad for x in xs] + [p.grad.to_local() for p in params]


def _linear_2d_saved(rank, world):
    """A 2-D linear (q = 2) last in a checkpointed function: non-reentrant checkpointing does
    not run its forward again; a function whose backward needs its output runs it once under
    selective checkpointing with ``tpx.checkpoint_policy``; the same gradients' bits."""
    mesh = tpx.init_mesh("2d")
    torch.manual_seed(0)
    layer = tpx.Linear2D(8, 8, mesh)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(rank))
    params = list(layer.parameters())
    context_fn = functools.partial(create_selective_checkpoint_contexts, tpx.checkpoint_policy)
    for fn in (layer, lambda x: layer(x) * layer(x)):
        plain = _calls_and_grads(fn, [x], params)
        full = _calls_and_grads(fn, [x], params, {})
        saved = _calls_and_grads(fn, [x], params, dict(context_fn=context_fn))
        assert saved[0] == plain[0], (saved[0], plain[0])
        if fn is layer:
            assert full[0] == plain[0], (full[0], plain[0])
        for a, b, c in zip(plain[1], full[1], saved[1]):
            assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.slow
def test_linear_2d_under_checkpointing():
    run_ranks(_linear_2d_saved, 4)


def _same_bits_saved_first(rank, world):
    """Row-parallel linears (the lean call on DTensor parameters, and the op wrappers with
    sequence parallelism) under a saved-tensor hook that changes nothing record two nodes:
    the output and every gradient are the bits of the one node without it; under
    non-reentrant checkpointing their collective does not run again."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = nn.Linear(16, 12)
    x_full = torch.randn(4, 6, 16)
    for output in (Replicate(), Shard(1)):
        layer = tpx.parallelize_module(copy.deepcopy(ref), mesh,
                                       tpx.RowwiseParallel(output_layouts=output))
        x = x_full.chunk(world, -1)[rank]
        runs = []
        for hooked in (False, True):
            xi = x.clone().requires_grad_()
            hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
                     if hooked else contextlib.nullcontext())
            with hooks:
                out = layer(xi)
            names = {type(out.grad_fn).__name__}
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            runs.append((out.detach(), xi.grad, layer.weight.grad.to_local().clone(),
                         layer.bias.grad.to_local().clone(), names))
            layer.zero_grad(set_to_none=True)
        (plain, hooked) = runs
        assert any("run_function" in n for n in hooked[4]), (output, hooked[4])
        for a, b in zip(plain[:4], hooked[:4]):
            assert torch.equal(a, b), output
        with tpx.comm_stats() as once:
            layer(x.clone().requires_grad_()).sum().backward()
        with tpx.comm_stats() as recomputed:
            checkpoint(layer, x.clone().requires_grad_(), use_reentrant=False).sum().backward()
        assert recomputed.calls() == once.calls(), (output, recomputed, once)


def test_saved_first_same_bits():
    run_ranks(_same_bits_saved_first, 2)
