"""Bytes on the wire per rank for one training step: tpx, PyTorch's tensor parallelism on the
same model and plan, and the minimum derived from the plan's layout.

Models (float32, one step = forward, backward, Adam; every sharded model is checked against
the unsharded one first):

* ``transformer``: PyTorch's own test Transformer (``common_dtensor.Transformer``: LayerNorm,
  GELU MLP, learned positions, tied head) with its own plan (``Transformer.parallelize``),
  with and without sequence parallelism (SP), once through ``torch.distributed.tensor.parallel``
  and once with the plan's names swapped for tpx's. The loss is ``output.sum()`` on the
  gathered logits.
* ``decoder``: the Llama-style decoder of ``examples/tiny_llama.py`` in torchtitan's names
  (RMSNorm, rotary, GQA, SwiGLU), with SP and loss parallelism: tpx with
  ``tpx.plans.decoder(model, sequence_parallel=True, loss_parallel=True)`` and
  ``tpx.loss_parallel(vocab_size=V)`` (without ``vocab_size`` the ranks would exchange their
  logits' widths, one all-gather of 8 bytes a rank per loss), PyTorch with torchtitan's plan
  in PyTorch's styles and ``loss_parallel()``. Loss: cross-entropy.
* ``llama``: a Hugging Face ``LlamaForCausalLM`` (tiny random config, nothing downloaded) with
  ``tpx.plans.auto(model, sequence_parallel=True, loss_parallel=True)`` and its own loss
  (``labels=``) under ``tpx.loss_parallel()``. tpx only (no PyTorch plan for it here).
* ``multidim``: one MLP and one attention block in the 2-D (4 ranks), 2.5-D (8 ranks, depth
  2) and 3-D (8 ranks) layouts, measured and derived by ``bench_multidim`` (its
  ``measure_case`` asserts the counts equal its derivation, per group and kind). tpx only.

Bytes are what each rank sends on a ring: an all-gather sends (P-1) x its input, a
reduce-scatter (P-1)/P x its input (= (P-1) x its output), an all-reduce 2 (P-1)/P x the
buffer, a broadcast or a reduce to one rank (P-1)/P x its buffer (the multi-dimensional
layouts; bench_multidim's ring model). tpx's collectives are taken from ``tpx.comm_stats()``;
PyTorch's from the collectives it runs (a dispatch mode records every ``_c10d_functional`` /
``c10d`` collective with its buffer), not from a formula.

The minimum (:func:`derived_minimum`) is Megatron's derivation for the plan: per block without
SP one all-reduce of the activation ``[B, S, D]`` after attention and one after the MLP
forward, and the same two for the input gradients backward; with SP each all-reduce becomes an
all-gather plus a reduce-scatter of the same activation; plus the embedding, LM head and loss
collectives the plan implies, and under SP the reductions of the norms' weight gradients.
Where a library sends more, :func:`known_excess` names each extra collective and its cause,
and the benchmark fails unless measured = minimum + named excess, kind by kind, to the byte.

    python benchmarks/bench_bytes.py     # TP 2 and 4, 2-D/2.5-D/3-D: a table, results/*.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from common import format_table, spawn_ranks, write_json  # noqa: E402

MIB = 1024 * 1024
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MODELS = ("transformer", "decoder", "llama", "multidim")
# The multi-dimensional layouts: (layout, depth, world).
MULTIDIM = (("2d", None, 4), ("2.5d", 2, 8), ("3d", None, 8))


def ring_bytes(kind: str, message: float, world: int) -> float:
    """Bytes one rank sends for a collective whose message (as tpx counts it: an all-gather's
    input, a reduce-scatter's output, the buffer otherwise) is ``message`` bytes."""
    if kind == "all_gather":
        return (world - 1) * message
    if kind == "reduce_scatter":
        return (world - 1) * message
    if kind == "all_reduce":
        return 2 * (world - 1) / world * message
    return (world - 1) / world * message  # broadcast, reduce (pipelined), as bench_multidim


# ------------------------------------------------------------------------------------------
# The derived minimum
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """Collectives of one kind with one cause: ``calls`` messages of ``message`` bytes each
    (tpx's convention: an all-gather's input, a reduce-scatter's output, an all-reduce's
    buffer). A negative ``calls`` takes collectives away (an excess that replaces one
    collective of the minimum by a larger one)."""

    what: str
    kind: str
    message: int
    calls: int = 1

    def bytes(self) -> int:
        return self.message * self.calls

    def ring(self, world: int) -> float:
        return ring_bytes(self.kind, self.bytes(), world)


@dataclass(frozen=True)
class PlanShape:
    """What of a 1-D plan decides its communication.

    sequence_parallel: activations between the blocks split along the sequence (Shard(1)).
    loss_parallel: logits stay split over the vocabulary and the loss is vocab-parallel;
        otherwise the LM head gathers the logits (``output_layouts=Replicate()``).
    norm_params: parameters per norm (RMSNorm D, LayerNorm 2D); 2 per block and a final one.
    pos_embeddings: a learned position table [S, D] sharded like the token embedding
        (PyTorch's test Transformer).
    """

    sequence_parallel: bool
    loss_parallel: bool
    norm_params: int
    pos_embeddings: bool = False


def derived_minimum(*, batch: int, seq: int, dim: int, vocab: int, layers: int, world: int,
                    itemsize: int, plan: PlanShape, stat_itemsize: int = 4) -> List[Term]:
    """The collectives one rank cannot avoid in one training step (forward, backward, Adam)
    of a decoder of ``layers`` blocks sharded by ``plan`` over ``world`` ranks, activations
    ``[batch, seq, dim]`` of ``itemsize`` bytes, vocabulary ``vocab`` (Megatron's derivation).
    Norm weight gradients and loss statistics are ``stat_itemsize`` bytes (fp32)."""
    p, n = world, batch * seq
    act = n * dim * itemsize               # the activation [B, S, D]
    shard = act // p                       # its sequence shard [B, S/P, D]
    pos = seq * dim * itemsize             # the position embeddings [S, D]
    L = layers
    t: List[Term] = []
    if not plan.sequence_parallel:
        # Embedding split over the vocabulary: each rank looks up its rows, zeros elsewhere;
        # the partial outputs are summed. Backward: the gradient is replicated, nothing.
        t.append(Term("embedding output, partial sums (fwd)", "all_reduce", act))
        if plan.pos_embeddings:
            t.append(Term("position embedding output, partial sums (fwd)", "all_reduce", pos))
        # Per block, forward: the row-parallel projections out of attention and out of the
        # MLP leave partial sums of the activation.
        t.append(Term("attention output, row-parallel (fwd)", "all_reduce", act, L))
        t.append(Term("MLP output, row-parallel (fwd)", "all_reduce", act, L))
        # Per block, backward: the column-parallel projections into attention (q, k, v: their
        # partial input gradients summed first) and into the MLP leave partial sums of the
        # input gradient.
        t.append(Term("attention input gradient, q/k/v summed (bwd)", "all_reduce", act, L))
        t.append(Term("MLP input gradient (bwd)", "all_reduce", act, L))
        # LM head, column-parallel on the replicated final activation: its input gradient.
        t.append(Term("LM head input gradient (bwd)", "all_reduce", act))
        # Norms see the whole replicated activation: full weight gradients, nothing to send.
    else:
        # Embedding: the partial outputs reduce-scattered to sequence shards (fwd); its weight
        # gradient reads the output gradient of every token: all-gathered (bwd).
        t.append(Term("embedding output to sequence shards (fwd)", "reduce_scatter", shard))
        t.append(Term("embedding output gradient, all tokens (bwd)", "all_gather", shard))
        if plan.pos_embeddings:
            t.append(Term("position embedding output to sequence shards (fwd)",
                          "reduce_scatter", pos // p))
            t.append(Term("position embedding output gradient (bwd)", "all_gather", pos // p))
        # Per block: the sequence gathered before attention and before the MLP (fwd; bwd the
        # summed partial input gradients reduce-scattered), the row-parallel outputs
        # reduce-scattered (fwd; bwd their gradients all-gathered).
        t.append(Term("attention input gathered (fwd)", "all_gather", shard, L))
        t.append(Term("attention input gradient, q/k/v summed (bwd)", "reduce_scatter",
                      shard, L))
        t.append(Term("attention output to sequence shards (fwd)", "reduce_scatter", shard, L))
        t.append(Term("attention output gradient gathered (bwd)", "all_gather", shard, L))
        t.append(Term("MLP input gathered (fwd)", "all_gather", shard, L))
        t.append(Term("MLP input gradient (bwd)", "reduce_scatter", shard, L))
        t.append(Term("MLP output to sequence shards (fwd)", "reduce_scatter", shard, L))
        t.append(Term("MLP output gradient gathered (bwd)", "all_gather", shard, L))
        # LM head: the final activation gathered (fwd), its input gradient reduce-scattered.
        t.append(Term("LM head input gathered (fwd)", "all_gather", shard))
        t.append(Term("LM head input gradient (bwd)", "reduce_scatter", shard))
        # Norms (2 per block + the final one) see only this rank's tokens: their replicated
        # weights' gradients are partial sums.
        t.append(Term("norm weight gradients, partial over tokens (bwd)", "all_reduce",
                      plan.norm_params * stat_itemsize, 2 * L + 1))
    if not plan.loss_parallel:
        # The LM head's output gathered over the vocabulary (the plan returns full logits);
        # backward each rank keeps its columns of the replicated gradient.
        if vocab % p:
            raise ValueError(f"the vocabulary {vocab} must divide by {p}")
        t.append(Term("logits gathered over the vocabulary (fwd)", "all_gather",
                      n * (vocab // p) * itemsize))
    else:
        t.extend(loss_minimum(n, p, stat_itemsize))
    return t


def loss_minimum(rows: int, world: int, stat_itemsize: int = 4) -> List[Term]:
    """Vocab-parallel cross-entropy (no label smoothing): every rank needs, per row, the global
    log-sum-exp and the target logit (held by one rank); backward needs nothing more. The
    maxima are all-reduced first (the sums of exp are taken against the global maximum), then
    the sums of exp and the target logits together. (One all-gather of the three statistics
    would send (P-1) x 3 values per row, never less than the 2 (P-1)/P x 3 of the two
    all-reduces.)"""
    f = stat_itemsize
    return [Term("loss: max per row (fwd)", "all_reduce", rows * f),
            Term("loss: sum of exp, target logit per row (fwd)", "all_reduce", 2 * rows * f)]


def known_excess(model: str, library: str, *, batch: int, seq: int, dim: int, vocab: int,
                 layers: int, world: int, itemsize: int, plan: PlanShape,
                 stat_itemsize: int = 4) -> List[Term]:
    """What ``library`` sends beyond :func:`derived_minimum` on ``model``, each with its cause.
    The benchmark (and its test) requires measured = minimum + this, kind by kind."""
    p, n = world, batch * seq
    act = n * dim * itemsize
    L = layers
    f = stat_itemsize
    out: List[Term] = []
    if model == "transformer" and not plan.sequence_parallel:
        # Both libraries, the model's own plan: wq, wk and wv are three ColwiseParallel layers
        # on the same replicated input, and each all-reduces its own input gradient; the
        # minimum sums the three partial gradients and reduces once (Megatron's fused QKV).
        out.append(Term("wk and wv input gradients all-reduced on their own (bwd)",
                        "all_reduce", act, 2 * L))
    if plan.sequence_parallel and library == "PyTorch TP":
        # The norms' weight gradients stay Partial DTensors after backward, and Adam's step
        # reduces each of them three times (its ops read the Partial gradient), not once.
        out.append(Term("norm weight gradients reduced again inside Adam's step",
                        "all_reduce", plan.norm_params * f, 2 * (2 * L + 1)))
    if model == "llama" and library == "tpx":
        # Hugging Face's model builds positions and the causal mask from the embedding
        # output's length, so the plan keeps that output whole (all-reduce) and the first
        # block splits it, instead of reduce-scattering it.
        out.append(Term("embedding output all-reduced, not reduce-scattered (fwd)",
                        "all_reduce", act))
        out.append(Term("embedding output to sequence shards (replaced)", "reduce_scatter",
                        act // p, -1))
    return out


def by_kind(terms: List[Term]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for t in terms:
        out[t.kind] = out.get(t.kind, 0) + t.bytes()
    return {k: v for k, v in sorted(out.items()) if v}


def ring_total(messages: Dict[str, int], world: int) -> float:
    return sum(ring_bytes(k, b, world) for k, b in messages.items())


# ------------------------------------------------------------------------------------------
# PyTorch's collectives, recorded as they run
# ------------------------------------------------------------------------------------------


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records PyTorch's collectives as they run: (kind, message bytes) with tpx's message
    convention."""

    KINDS = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
             "allgather_into_tensor_coalesced": "all_gather", "_allgather_base_": "all_gather",
             "allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
             "broadcast_": "broadcast", "reduce_": "reduce", "allgather_": "all_gather",
             "reduce_scatter_": "reduce_scatter"}

    def __init__(self, world: int):
        super().__init__()
        self.supports_higher_order_operators = True
        self.world, self.calls, self.unknown = world, [], set()
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first and turn the op into local ops and collectives, which then
            # come through here (as torch's CommDebugMode does).
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in ("_c10d_functional", "c10d") and name not in self.KINDS and \
                name not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.unknown.add(name)
        if ns in ("_c10d_functional", "c10d") and name in self.KINDS:
            kind = self.KINDS[name]
            first = args[0]
            t = first[0] if isinstance(first, (list, tuple)) else first
            if isinstance(t, list):
                t = t[0]
            nbytes = t.numel() * t.element_size()
            if kind == "reduce_scatter":
                nbytes //= self.world  # the message is the output: input / P
            self.calls.append((self.phase, kind, nbytes))
        return out


# ------------------------------------------------------------------------------------------
# The models and their plans
# ------------------------------------------------------------------------------------------


def _transformer(args):
    from torch.testing._internal.distributed._tensor import common_dtensor as cd

    torch.manual_seed(0)
    model_args = cd.ModelArgs(dim=args.dim, n_heads=args.heads, n_layers=args.layers,
                              vocab_size=args.vocab, max_seq_len=args.seq, dropout_p=0.0)
    return cd, cd.Transformer(model_args)


@contextmanager
def _tpx_names(cd):
    import tpx

    with mock.patch.multiple(cd, parallelize_module=tpx.parallelize_module,
                             ColwiseParallel=tpx.ColwiseParallel,
                             RowwiseParallel=tpx.RowwiseParallel,
                             SequenceParallel=tpx.SequenceParallel,
                             PrepareModuleInput=tpx.PrepareModuleInput):
        yield


def _decoder(args):
    from tiny_llama import Decoder

    torch.manual_seed(0)
    return Decoder(vocab=args.lm_vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                   n_kv_heads=args.kv_heads, hidden=args.ffn)


def _torchtitan_plan():
    """torchtitan's Llama plan (SP, loss parallel) in PyTorch's styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def _llama(args):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.lm_vocab, hidden_size=args.dim, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(got, want, what):
    torch.testing.assert_close(_full(got).detach(), want.detach(), rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{what}: {m}")


def _shape(model: str, args, world: int, sp: bool) -> dict:
    """The arguments of derived_minimum / known_excess for one row."""
    if model == "transformer":
        plan = PlanShape(sequence_parallel=sp, loss_parallel=False, norm_params=2 * args.dim,
                         pos_embeddings=True)
        vocab = args.vocab
    else:
        plan = PlanShape(sequence_parallel=True, loss_parallel=True, norm_params=args.dim)
        vocab = args.lm_vocab
    return dict(batch=args.batch, seq=args.seq, dim=args.dim, vocab=vocab, layers=args.layers,
                world=world, itemsize=4, plan=plan)


def _measure(lib, world, step):
    """Runs ``step(phase)`` (phase: a function naming the part of the step under way) and
    returns the messages per kind this rank issued, and per phase."""
    import tpx

    if lib == "tpx":
        phases = {}
        state = {"name": None, "stats": None}

        def phase(name):
            if state["stats"] is not None:
                state["stats"].__exit__()
                phases[state["name"]] = state["stats"].counts
            state["name"] = name
            state["stats"] = tpx.comm_stats().__enter__() if name else None

        step(phase)
        phase(None)
        kinds, detail = {}, {}
        for name, counts in phases.items():
            for (_, kind), (calls, nbytes) in counts.items():
                kinds[kind] = kinds.get(kind, 0) + nbytes
                detail[f"{name}/{kind}"] = [calls, nbytes]
        return kinds, detail
    rec = _Recorder(world)

    def phase(name):
        rec.phase = name or ""

    with rec:
        step(phase)
    if rec.unknown:
        raise RuntimeError(f"collectives this benchmark does not count: {rec.unknown}")
    kinds, detail = {}, {}
    for name, kind, nbytes in rec.calls:
        kinds[kind] = kinds.get(kind, 0) + nbytes
        c, b = detail.get(f"{name}/{kind}", [0, 0])
        detail[f"{name}/{kind}"] = [c + 1, b + nbytes]
    return kinds, detail


def _row(model, label, world, sp, lib, kinds, detail, shape):
    minimum = derived_minimum(**shape)
    excess = known_excess(model, lib, **shape)
    want = by_kind(minimum + excess)
    got = {k: v for k, v in sorted(kinds.items()) if v}
    if got != want:
        raise AssertionError(
            f"{label} TP {world} {lib}: measured messages per kind {got} != derived minimum "
            f"{by_kind(minimum)} + named excess {by_kind(excess)} = {want}; by phase "
            f"(calls, bytes): {detail}")
    ring = {k: ring_bytes(k, b, world) for k, b in got.items()}
    min_ring = ring_total(by_kind(minimum), world)
    return dict(model=label, tp=world, sequence_parallel=sp, library=lib,
                messages=got, detail=detail, wire_bytes=ring,
                wire_mib={k: round(v / MIB, 3) for k, v in ring.items()},
                total_bytes=sum(ring.values()), total_mib=round(sum(ring.values()) / MIB, 3),
                minimum_bytes=min_ring, minimum_mib=round(min_ring / MIB, 3),
                ratio_to_minimum=round(sum(ring.values()) / min_ring, 4),
                excess=[dict(what=t.what, kind=t.kind, message=t.message, calls=t.calls,
                             wire_bytes=t.ring(world)) for t in excess])


def _run_transformer(args, world, inp, rows):
    import tpx
    from torch.distributed.device_mesh import DeviceMesh

    for sp in (False, True):
        cd, ref = _transformer(args)
        want = ref(inp)
        want.sum().backward()
        for lib in ("PyTorch TP", "tpx"):
            model = copy.deepcopy(ref)
            model.zero_grad(set_to_none=True)
            mesh = DeviceMesh("cpu", torch.arange(world))
            if lib == "tpx":
                with _tpx_names(cd):
                    cd.Transformer.parallelize(model, mesh, sp, local_output_for_attn=True)
            else:
                cd.Transformer.parallelize(model, mesh, sp, local_output_for_attn=True)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            # Correctness first: the output and the gradients of the norm and the embedding.
            out = _full(model(inp))
            _close(out, want, "output")
            out.sum().backward()
            for name in ("norm.weight", "tok_embeddings.weight"):
                got = _full(dict(model.named_parameters())[name].grad)
                exp = dict(ref.named_parameters())[name].grad
                if got.shape != exp.shape:  # a tpx shard: compare this rank's rows
                    lo, hi = tpx.shard_range(exp.shape[0])
                    exp = exp[lo:hi]
                _close(got, exp, name)
            model.zero_grad(set_to_none=True)

            def step(phase):
                phase("forward")
                out = model(inp)
                phase("backward")
                out.sum().backward()
                phase("optimizer")
                opt.step()
                opt.zero_grad(set_to_none=True)
                phase(None)

            kinds, detail = _measure(lib, world, step)
            rows.append(_row("transformer", "common_dtensor.Transformer", world, sp, lib,
                             kinds, detail, _shape("transformer", args, world, sp)))


def _run_decoder(args, world, inp, labels, rows):
    import tpx
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    ref = _decoder(args)
    want = F.cross_entropy(ref(inp).flatten(0, 1), labels.flatten(0, 1))
    want.backward()
    for lib in ("PyTorch TP", "tpx"):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        if lib == "tpx":
            tpx.parallelize_module(model, None, tpx.plans.decoder(
                model, sequence_parallel=True, loss_parallel=True))
            def ctx():
                return tpx.loss_parallel(vocab_size=args.lm_vocab)
        else:
            parallelize_module(model, DeviceMesh("cpu", torch.arange(world)),
                               _torchtitan_plan())
            ctx = loss_parallel
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(phase):
            with ctx():
                phase("forward")
                loss = F.cross_entropy(model(inp).flatten(0, 1), labels.flatten(0, 1))
                phase("backward")
                loss.backward()
            phase(None)
            return loss

        loss = step(lambda name: None)
        _close(loss, want, "loss")
        _close(model.norm.weight.grad, ref.norm.weight.grad, "norm.weight gradient")
        model.zero_grad(set_to_none=True)

        def train(phase):
            step(phase)
            phase("optimizer")
            opt.step()
            opt.zero_grad(set_to_none=True)
            phase(None)

        kinds, detail = _measure(lib, world, train)
        rows.append(_row("decoder", "tiny_llama.Decoder (torchtitan plan)", world, True, lib,
                         kinds, detail, _shape("decoder", args, world, True)))


def _run_llama(args, world, inp, rows):
    import tpx

    ref = _llama(args)
    want = ref(input_ids=inp, labels=inp).loss
    want.backward()
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=True,
                                                       loss_parallel=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(phase):
        with tpx.loss_parallel():
            phase("forward")
            loss = model(input_ids=inp, labels=inp).loss
            phase("backward")
            loss.backward()
        phase(None)
        return loss

    _close(step(lambda name: None), want, "loss")
    _close(model.model.norm.weight.grad, ref.model.norm.weight.grad, "norm.weight gradient")
    model.zero_grad(set_to_none=True)

    def train(phase):
        step(phase)
        phase("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase(None)

    kinds, detail = _measure("tpx", world, train)
    rows.append(_row("llama", "HF LlamaForCausalLM (plans.auto)", world, True, "tpx", kinds,
                     detail, _shape("llama", args, world, True)))


def run(rank: int, world: int, args, init_method: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    rows: list = []
    gen = torch.Generator().manual_seed(1)
    inp = torch.randint(args.vocab, (args.batch, args.seq), generator=gen)
    ids = torch.randint(args.lm_vocab, (args.batch, args.seq), generator=gen)
    labels = torch.randint(args.lm_vocab, (args.batch, args.seq), generator=gen)
    if "transformer" in args.models:
        _run_transformer(args, world, inp, rows)
    if "decoder" in args.models:
        _run_decoder(args, world, ids, labels, rows)
    if "llama" in args.models:
        _run_llama(args, world, ids, rows)
    # Every rank's rows must agree (the plans are symmetric); rank 0 writes them.
    mine = json.dumps([(r["library"], r["messages"]) for r in rows], sort_keys=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if any(e != mine for e in everyone):
        raise AssertionError(f"the ranks' byte counts differ: {everyone}")
    if rank == 0:
        path = os.path.join(args.out, f"bench_bytes_tp{world}.json")
        write_json(path, dict(benchmark="bench_bytes: wire bytes per rank, one training step, "
                                        "against PyTorch's TP and the derived minimum",
                              config={k: v for k, v in vars(args).items() if k != "out"},
                              results=rows))
    dist.barrier()
    dist.destroy_process_group()


def run_multidim(rank: int, world: int, args, init_method: str) -> None:
    """The multi-dimensional layouts of this world size: bench_multidim's measure_case
    (measured = derived, asserted there on every rank), as rows of this table."""
    import tpx
    import bench_multidim as md

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    rows = []
    shape = dict(md.SHAPE)
    for layout, depth, w in MULTIDIM:
        if w != world:
            continue
        mesh = tpx.init_mesh(layout, **({"depth": depth} if layout == "2.5d" else {}))
        for block in md.BLOCKS:
            r = md.measure_case(layout, depth, block, mesh, shape)
            der = md.derive(layout, block, world, depth,
                            default_chunks=tpx.build_info()["default_chunks"], **shape)
            measured = {tuple(k.split("/")): tuple(v) for k, v in r["measured_comm"].items()}
            got = md.ring_bytes(measured, der["sizes"])
            want = md.ring_bytes(der["comm"], der["sizes"])
            name = f"{layout}{'' if depth is None else f' d={depth}'}"
            rows.append(dict(model=f"{block} block ({name})", layout=layout, depth=depth,
                             tp=world, mesh=r["mesh"], shape=shape, sequence_parallel=False,
                             library="tpx", measured_comm=r["measured_comm"],
                             derived_comm=r["derived_comm"], total_bytes=got,
                             total_mib=round(got / MIB, 4), minimum_bytes=want,
                             minimum_mib=round(want / MIB, 4),
                             ratio_to_minimum=round(got / want, 4), excess=[]))
    if rank == 0:
        write_json(os.path.join(args.out, f"bench_bytes_multidim_p{world}.json"),
                   dict(benchmark="bench_bytes: the multi-dimensional layouts, wire bytes per "
                                  "rank of one block's forward + backward against their "
                                  "derivation (bench_multidim)",
                        config=dict(shape=shape), results=rows))
    dist.barrier()
    dist.destroy_process_group()


def table(rows: list) -> str:
    """tpx, PyTorch and the minimum side by side, one line per configuration."""
    out, seen = [], {}
    for r in rows:
        key = (r["model"], r["tp"], r["sequence_parallel"])
        seen.setdefault(key, {})[r["library"]] = r
    for (model, tp, sp), libs in seen.items():
        t, pt = libs.get("tpx"), libs.get("PyTorch TP")
        minimum = (t or pt)["minimum_bytes"]
        notes = []
        for lib, r in (("tpx", t), ("PyTorch", pt)):
            if r and r["excess"]:
                notes.append(f"{lib} +{sum(e['wire_bytes'] for e in r['excess']) / MIB:.3f}")
        out.append([model, f"{tp}", "SP" if sp else "-",
                    f"{t['total_bytes'] / MIB:.3f}" if t else "-",
                    f"{pt['total_bytes'] / MIB:.3f}" if pt else "-",
                    f"{minimum / MIB:.3f}",
                    f"{t['total_bytes'] / minimum:.3f}" if t else "-",
                    f"{pt['total_bytes'] / minimum:.3f}" if pt else "-",
                    f"{t['total_bytes'] / pt['total_bytes']:.3f}" if t and pt else "-",
                    ", ".join(notes) or "="])
    return format_table(["model", "P", "sp", "tpx MiB", "PyTorch MiB", "minimum MiB",
                         "tpx/min", "PyTorch/min", "tpx/PyTorch", "named excess MiB"], out,
                        text_columns=3)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    p.add_argument("--multidim-worlds", type=int, nargs="*", default=[4, 8],
                   help="world sizes of the multi-dimensional layouts (4: 2-D; 8: 2.5-D, 3-D)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="decoder and llama")
    p.add_argument("--ffn", type=int, default=512, help="MLP width of decoder and llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8, help="common_dtensor.Transformer")
    p.add_argument("--lm-vocab", type=int, default=512, help="decoder and llama")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
    args = p.parse_args(argv)
    rows = []
    one_d = [m for m in args.models if m != "multidim"]
    if one_d:
        for world in args.tp:
            spawn_ranks(run, world, args, "bench_bytes")
            with open(os.path.join(args.out, f"bench_bytes_tp{world}.json")) as f:
                rows.extend(json.load(f)["results"])
    if "multidim" in args.models:
        for world in args.multidim_worlds:
            spawn_ranks(run_multidim, world, args, "bench_bytes_multidim")
            with open(os.path.join(args.out, f"bench_bytes_multidim_p{world}.json")) as f:
                rows.extend(json.load(f)["results"])
    print(table(rows))
    for r in rows:
        for e in r["excess"]:
            print(f"  {r['model']} P={r['tp']} {'SP' if r['sequence_parallel'] else '-'} "
                  f"{r['library']}: {e['what']}: {e['calls']} x {e['kind']} of {e['message']} "
                  f"B = {e['wire_bytes'] / MIB:+.4f} MiB")
    return rows


if __name__ == "__main__":
    main()
