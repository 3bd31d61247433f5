"""Memory per rank of one training step of a Llama-style decoder under tensor parallelism,
measured, next to the bytes derived from the layout.

The point of TP is the memory one device has to hold. This benchmark trains the decoder of
examples/tiny_llama.py (and a wider one of the same class) with Adam on one device, with 1-D TP
over 2 and 4 ranks (with and without sequence parallelism), and with the 2-D (4 ranks), 2.5-D
(8 ranks, depth 2) and 3-D (8 ranks) layouts, and reports for every rank:

* **params**: the bytes of this rank's parameters;
* **grads**: the bytes of this rank's gradients;
* **Adam**: the bytes of this rank's optimizer state (``exp_avg``, ``exp_avg_sq`` and the
  ``step`` counter of every parameter);
* **act**: what the forward keeps alive for the backward (saved tensors, incl. the loss);
* **peak**: the largest amount allocated at once during one steady-state training step
  (``zero_grad``, forward, backward, ``optimizer.step()``, with the Adam state already there).

How it is measured
==================

On the CPU every tensor allocation goes through ``tpx.memory`` (``track_cpu()`` installs a
counting wrapper around torch's CPU allocator that counts the bytes each allocation asks
for; ``cpu_memory_allocated()`` is what is allocated now). Per rank, with the process group's
own temporaries included (the counter sees its threads too):

1. ``params`` = growth of ``cpu_memory_allocated()`` from building and sharding the model;
2. one warm-up forward + backward (its loss checked against the unsharded model's), gradients
   dropped (``zero_grad(set_to_none=True)``), so caches a first call makes are not counted;
3. step 1: growth after the forward (``act``), after the backward with the forward's outputs
   dropped (``grads``), after ``optimizer.step()`` (``Adam``);
4. step 2 inside ``track_cpu()``: ``peak`` = what was allocated at the start (params + Adam)
   + the block's ``peak_extra``.

Between phases the counter is read only once it has stopped falling (a process group's
worker threads free their temporaries shortly after a collective returns).

On a GPU (``--device cuda``, NCCL) the same phases read ``torch.cuda.memory_allocated()`` and
``torch.cuda.max_memory_allocated()``. The caching allocator rounds every block up (to 512
bytes), so there measured exceeds derived by that rounding; Adam's ``step`` counters stay on
the CPU there (not fused, not capturable) and are not in the CUDA numbers. This path has not
been run on a GPU (none was available when the numbers in docs/benchmarks-memory.md were made).

How it is derived
=================

f = 4 bytes (fp32). The model: ``L`` layers, width ``D``, ``h`` heads and ``h_kv`` key/value
heads of ``hd = D/h``, FFN width ``F``, vocabulary ``V``; a batch of ``B`` sequences of ``S``
tokens, ``N = B S``. ``split(n, P, r)`` is rank ``r``'s share of ``n`` split over ``P`` ranks in
ceil-sized blocks (the last ranks get the remainder), as tpx splits a dimension.

Parameters (from the layout, held against the sharded model's local parameters and against the
allocator):

* 1-D (P ranks, Megatron): wq, wk, wv, w1, w3 column-split (``split(out, P) x in``), wo and w2
  row-split (``out x split(in, P)``), the embedding and the LM head split over the vocabulary
  (``split(V, P) x D``), the RMSNorm weights (2 per layer + 1) whole on every rank.
* 2-D / 2.5-D (q x q, depth d): every Linear weight ``[out, in]`` as a ``[out/q, in/q]`` block
  (replicated over depth), norms ``D/q``, the embedding ``[V, D/q]``, the LM head
  ``[V/q, D/q]``.
* 3-D (q x q x q): every Linear weight ``[out/q^2, in/q]``, norms ``D/q``, the embedding
  ``[V, D/q]``, the LM head ``[V/q^2, D/q]``.

Gradients = parameters (all parameters train). Adam = 2 x parameters + 4 bytes of ``step`` per
parameter tensor (CPU). On the CPU these three equal the measurement exactly, on every rank
(tests/test_bench_memory.py asserts it; the table shows any difference in bytes).

Activations: what each layer saves for the backward on this rank, read from the layers (tpx's
autograd functions and ATen's derivatives), in elements (x f bytes); ``n`` = rows a norm sees,
``w`` = the local width:

* 1-D, P ranks (P = 1: one device, plain PyTorch), ``n = N/P`` with sequence parallelism else
  ``N``; per layer:
  ``2 (2 n D + n)``  (each RMSNorm keeps its input, ``x * rsqrt``, and ``rsqrt [n, 1]``)
  ``+ 2 N D``  (the input of wq/wk/wv and of w1/w3, gathered under SP; the three and the two
  share one tensor) ``+ 2 S hd``  (rotary cos and sin, for q and k)
  ``+ 4 N D/P + N h/P``  (attention: q, k and v repeated to the local heads, the output (wo's
  input is a view of it), the log-sum-exp) ``+ 4 N F/P``  (w1's output, silu's output, w3's
  output, their product = w2's input);
  then the final norm ``2 n D + n``, the LM head's input ``N D``, and the loss: one device
  ``N V`` (log-softmax) ``+ 1``; P > 1 (vocab-parallel cross-entropy) ``N split(V, P) + N``
  ``+ 2`` (the softmax, a per-row statistic, a count).
* 2-D / 2.5-D: ``m = N/q`` (2.5-D: ``N/(d q)``) rows, ``w = D/q``; per layer
  ``2 (m w + m)`` (the norms: input and ``rsqrt``) ``+ 2 m w`` (inputs of the projections)
  ``+ 2 S hd + 4 m w + m h/q + 4 m F/q``; final norm ``m w + m``, head input ``m w``, loss
  ``m V/q + m + 1``.
* 3-D: ``m = N/q^2`` rows, ``w = D/q``; each Linear keeps its input gathered over the batch
  (``q m`` rows) and its weight gathered over "input" (``[out/q, in/q]``), each one its own:
  per layer ``2 (m w + m) + 3 q m w + (D/q + 2 h_kv hd/q) w + 2 S hd + 4 m w + m h/q``
  ``+ q m w + (D/q) w`` (wo) ``+ 2 q m w + 2 (F/q) w + 3 m F/q`` (w1, w3, silu)
  ``+ q m F/q + (D/q)(F/q)`` (w2); final norm ``m w + m``, head ``q m w + (V/q) w``, loss
  ``m V/q + m + 1``.

Plus the loss itself (1 element). The measured ``act`` is held against this (on the CPU it is
exact too, for the torch and tpx versions the results were made with: a change in what an op
saves shows as a difference).

The peak is not an exact sum: during the backward gradients appear while saved activations go,
and the backward and ``optimizer.step()`` allocate temporaries. The table gives the derived
floor ``params + Adam + act`` (the end of the forward is a moment of the step, so the measured
peak is at least that) and by how much the measured peak exceeds it.

Correctness first: every configuration's loss at the warm-up step and at step 1 equals the
unsharded model's loss on the same batch, and at step 2 (after one Adam step) equals the
unsharded model's after its own Adam step; every rank checks, and a mismatch aborts the run.

Run:
    python benchmarks/bench_memory.py              # both models, 1, 2, 4 and 8 ranks
    python benchmarks/bench_memory.py --quick      # the tiny Decoder of examples/, 1 and 2 ranks
    python benchmarks/bench_memory.py --models tiny --worlds 1,2,4
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import environment, format_table, print_env, spawn_ranks, write_json

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
sys.path.insert(0, str(HERE.parent / "examples"))

# The Decoder of examples/tiny_llama.py. "tiny": its default shape with a vocabulary that the
# 2-D / 3-D meshes split (1000 = 4 x 250); "wide": the same class, 8x wider, 2x deeper. "quick"
# (the test's) is the example's Decoder() unchanged: its vocabulary of 1003 splits unevenly
# over 2 ranks (502 + 501 rows).
MODELS = {
    "tiny": dict(model=dict(vocab=1000, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, hidden=88),
                 batch=4, seq=16),
    "wide": dict(model=dict(vocab=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                            hidden=704),
                 batch=8, seq=64),
    "quick": dict(model=dict(vocab=1003, dim=32, n_layers=2, n_heads=8, n_kv_heads=4,
                             hidden=88),
                  batch=4, seq=16),
}
# (layout, sequence_parallel, depth) per world size; 1-D at P = 8 would split 4 KV heads 8 ways.
CONFIGS = {1: [("1d", False, None)],
           2: [("1d", False, None), ("1d", True, None)],
           4: [("1d", False, None), ("1d", True, None), ("2d", False, None)],
           8: [("2.5d", False, 2), ("3d", False, None)]}
SEED = 1234
LR = 1e-3
F32 = 4
STEP_BYTES = 4  # Adam's per-parameter `step` counter: a float32 scalar tensor on the CPU
TOL = dict(rtol=1e-5, atol=1e-5)
TOL_AFTER_ADAM = dict(rtol=1e-4, atol=1e-4)  # one Adam step amplifies rounding of tiny grads
MIB = 1 << 20


# ------------------------------------------------------------------------------------------
# The derivation
# ------------------------------------------------------------------------------------------


def split(n: int, parts: int, index: int) -> int:
    """Rank ``index``'s share of ``n`` split over ``parts`` ranks in ceil-sized blocks."""
    per = -(-n // parts)
    start = min(index * per, n)
    return min(start + per, n) - start


def _exact(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}: {n} does not divide by {d}; choose sizes the layout splits")
    return n // d


def mesh_q(layout: str, world: int, depth) -> int:
    if layout == "1d":
        return world
    blocks = world // (depth or 1)
    q = round(blocks ** (1 / 3 if layout == "3d" else 1 / 2))
    if (q ** 3 if layout == "3d" else q * q) * (depth or 1) != world:
        raise ValueError(f"--worlds: {world} ranks do not form a {layout} mesh")
    return q


def derive(cfg: dict, batch: int, seq: int, layout: str, world: int, rank: int,
           sequence_parallel: bool = False, depth=None) -> dict:
    """Bytes of this rank's parameters, gradients, Adam state and saved activations, from the
    layout alone (module docstring)."""
    V, D, L = cfg["vocab"], cfg["dim"], cfg["n_layers"]
    h, hkv, Fh = cfg["n_heads"], cfg["n_kv_heads"], cfg["hidden"]
    hd = D // h
    kv = hkv * hd
    N, S = batch * seq, seq
    mats = [(D, D), (kv, D), (kv, D), (D, D), (Fh, D), (Fh, D), (D, Fh)]  # wq wk wv wo w1 w3 w2
    n_tensors = 2 + L * 9 + 1
    if layout == "1d":
        P = world
        sp = sequence_parallel and P > 1
        cols = [(split(o, P, rank), i) for o, i in mats[:3]] \
            + [(D, split(D, P, rank))] \
            + [(split(o, P, rank), i) for o, i in mats[4:6]] + [(D, split(Fh, P, rank))]
        vr = split(V, P, rank)
        params = 2 * vr * D + L * (sum(o * i for o, i in cols) + 2 * D) + D
        n = _exact(N, P, "tokens / P (sequence parallelism)") if sp else N
        heads = _exact(h, P, "heads / P")
        per_layer = (2 * (2 * n * D + n) + 2 * N * D + 2 * S * hd
                     + 4 * N * (D // P) + N * heads + 4 * N * split(Fh, P, rank))
        final = 2 * n * D + n + N * D
        loss = N * V + 1 if P == 1 else N * vr + N + 2
    else:
        q = mesh_q(layout, world, depth)
        w = _exact(D, q, "dim / q")
        fq = _exact(Fh, q, "hidden / q")
        heads = _exact(h, q, "heads / q")
        vq = _exact(V, q, "vocab / q")
        if layout in ("2d", "2.5d"):
            params = V * w + L * (sum(_exact(o, q, "out / q") * _exact(i, q, "in / q")
                                      for o, i in mats) + 2 * w) + w + vq * w
            m = _exact(N, q * (depth or 1), "tokens / (depth q)")
            _exact(batch, q * (depth or 1), "batch / (depth q)")
            per_layer = (2 * (m * w + m) + 2 * m * w + 2 * S * hd + 4 * m * w + m * heads
                         + 4 * m * fq)
            final = m * w + m + m * w
        else:
            params = V * w + L * (sum(_exact(o, q * q, "out / q^2") * _exact(i, q, "in / q")
                                      for o, i in mats) + 2 * w) + w \
                + _exact(V, q * q, "vocab / q^2") * w
            _exact(batch, q * q, "batch / q^2")
            m = N // (q * q)
            kvq = _exact(kv, q, "kv width / q")
            per_layer = (2 * (m * w + m) + 3 * q * m * w + (D // q + 2 * kvq) * w + 2 * S * hd
                         + 4 * m * w + m * heads
                         + q * m * w + (D // q) * w
                         + 2 * q * m * w + 2 * fq * w + 3 * m * fq
                         + q * m * fq + (D // q) * fq)
            final = m * w + m + q * m * w + vq * w
        loss = m * vq + m + 1
    activations = L * per_layer + final + loss + 1  # + the loss value itself
    pb = params * F32
    return dict(params=pb, grads=pb, adam=2 * pb + STEP_BYTES * n_tensors,
                activations=activations * F32, n_tensors=n_tensors)


# ------------------------------------------------------------------------------------------
# Measurement on the ranks
# ------------------------------------------------------------------------------------------


class Meter:
    """Bytes allocated now and the peak of a block, on the CPU (tpx.memory) or a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":
            import tpx.memory
            self.mem = tpx.memory
            with tpx.memory.track_cpu():  # installs the counter before anything is built
                pass

    def now(self) -> int:
        """Allocated bytes once the count has stopped falling (worker threads' temporaries)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        last, same, deadline = self.mem.cpu_memory_allocated(), 0, time.monotonic() + 2.0
        while same < 5 and time.monotonic() < deadline:
            time.sleep(0.002)
            cur = self.mem.cpu_memory_allocated()
            same = same + 1 if cur == last else 0
            last = cur
        return last

    def peak_of(self, fn) -> int:
        """Runs ``fn()``; returns the peak bytes allocated during it beyond those at its start."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - start
        with self.mem.track_cpu() as m:
            fn()
        return m.peak_extra


def build_model(cfg: dict, layout: str, sp: bool, mesh, world: int, device):
    """The Decoder from SEED, sharded as ``layout`` says (P = 1: left as it is)."""
    import tpx
    from tiny_llama import Decoder, tp_plan

    torch.manual_seed(SEED)
    model = Decoder(**cfg).to(device)
    if layout == "1d":
        if world > 1:
            tpx.parallelize_module(model, mesh, tp_plan(sp, loss_parallel=True))
    else:
        tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout,
                                                           loss_parallel=True))
    return model


def make_loss_fn(layout: str, world: int, vocab: int, mesh):
    """loss(model, ids, labels) as one trains that layout (vocab-parallel loss when sharded)."""
    import tpx

    def loss_fn(model, ids, labels):
        logits = model(ids)
        if layout == "1d" and world == 1:
            return F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
        if layout == "1d":
            return tpx.vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab)
        with tpx.loss_parallel(mesh):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return loss_fn


def reference_losses(cfg: dict, ids, labels, device) -> tuple:
    """The unsharded model's loss on the batch, and after one Adam step its loss again."""
    from tiny_llama import Decoder

    torch.manual_seed(SEED)
    ref = Decoder(**cfg).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    loss = F.cross_entropy(ref(ids).reshape(-1, cfg["vocab"]), labels.reshape(-1))
    loss.backward()
    opt.step()
    with torch.no_grad():
        loss2 = F.cross_entropy(ref(ids).reshape(-1, cfg["vocab"]), labels.reshape(-1))
    return loss.item(), loss2.item()


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def measure(meter: Meter, cfg: dict, spec: dict, layout: str, sp: bool, depth, mesh,
            world: int, rank: int, ref: tuple, ids, labels) -> dict:
    """The phases of the module docstring for one configuration on this rank; the losses are
    checked against ``ref`` on every rank before the numbers are kept."""
    if layout == "1d" and world > 1:
        # The TP mesh of the group (a DeviceMesh holds a small tensor of its ranks) exists
        # before the model is built, as in a PyTorch TP script: it is not the parameters.
        from tpx.nn.dtensor_io import mesh_for_group

        mesh_for_group(dist.group.WORLD, meter.device.type if hasattr(meter.device, "type")
                       else str(meter.device))
    base = meter.now()
    model = build_model(cfg, layout, sp, mesh, world, meter.device)
    params_meas = meter.now() - base
    params_local = sum(_local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = make_loss_fn(layout, world, cfg["vocab"], mesh)

    # Warm-up: first-call caches are built here, not counted below.
    loss = loss_fn(model, ids, labels)
    warm = loss.item()
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)

    # Step 1: activations, gradients, Adam state.
    a0 = meter.now()
    loss = loss_fn(model, ids, labels)
    act_meas = meter.now() - a0
    first = loss.item()
    loss.backward()
    del loss
    grads_meas = meter.now() - a0
    opt.step()
    adam_meas = meter.now() - a0 - grads_meas

    # Step 2: the steady-state step whose peak is reported.
    out = {}

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, labels)
        out["loss"] = loss.detach()
        loss.backward()
        opt.step()

    model.zero_grad(set_to_none=True)
    a1 = meter.now()
    peak_extra = meter.peak_of(train_step)
    second = out.pop("loss").item()
    peak_meas = (a1 - base) + peak_extra

    der = derive(cfg, spec["batch"], spec["seq"], layout, world, rank, sp, depth)
    errors = []
    for what, got, want, tol in (("warm-up loss", warm, ref[0], TOL),
                                 ("step-1 loss", first, ref[0], TOL),
                                 ("step-2 loss (after one Adam step)", second, ref[1],
                                  TOL_AFTER_ADAM)):
        if abs(got - want) > tol["atol"] + tol["rtol"] * abs(want):
            errors.append(f"{what} {got!r} differs from the unsharded model's {want!r}")
    del model, opt
    return dict(rank=rank, params=params_meas, params_local=params_local, grads=grads_meas,
                adam=adam_meas, activations=act_meas, peak=peak_meas,
                derived=der, losses=[warm, first, second], reference_losses=list(ref),
                errors=errors)


def run_world(rank: int, world: int, args, init_method: str) -> None:
    """Every configuration of one world size on this rank; rank 0 writes the rows."""
    import tpx

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    # A collective that waits longer than --timeout raises on its rank, and spawn_ranks then
    # ends every rank: a stuck run fails instead of hanging.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        meter = Meter(device)
        env = environment(device, world, backend)
        meshes = {}
        for layout, sp, depth in CONFIGS[world]:
            if (layout, depth) not in meshes:
                meshes[(layout, depth)] = (None if layout == "1d" else tpx.init_mesh(
                    layout, **({"depth": depth} if depth else {}),
                    device_type=device.type))
        rows = []
        for name in args.models:
            spec = MODELS[name]
            cfg = spec["model"]
            gen = torch.Generator().manual_seed(SEED + 1)
            ids = torch.randint(0, cfg["vocab"], (spec["batch"], spec["seq"]),
                                generator=gen).to(device)
            labels = torch.randint(0, cfg["vocab"], (spec["batch"], spec["seq"]),
                                   generator=gen).to(device)
            ref = reference_losses(cfg, ids, labels, device)
            for layout, sp, depth in CONFIGS[world]:
                if rank == 0:
                    print(f"  {name}: P={world} {label(layout, sp, depth)} ...", flush=True)
                r = measure(meter, cfg, spec, layout, sp, depth, meshes[(layout, depth)],
                            world, rank, ref, ids, labels)
                everyone = [None] * world
                dist.all_gather_object(everyone, r)
                errors = [f"rank {x['rank']}: {e}" for x in everyone for e in x["errors"]]
                if errors:
                    raise RuntimeError(f"{name} {label(layout, sp, depth)} at P={world}: the "
                                       "sharded model does not match the unsharded one, so no "
                                       "memory is reported:\n" + "\n".join(errors))
                rows.append(dict(model=name, world=world, layout=layout,
                                 sequence_parallel=sp, depth=depth,
                                 config=dict(cfg, batch=spec["batch"], seq=spec["seq"]),
                                 ranks=[{k: v for k, v in x.items() if k != "errors"}
                                        for x in everyone]))
        if rank == 0:
            Path(args.partial).write_text(json.dumps(dict(environment=env, rows=rows)))
        # Every rank's last collective is complete before any process begins to exit, and
        # gloo's worker thread gets the GIL to free that collective's tensors (a rank exiting
        # while it still waits for the GIL aborts: docs/training.md, "Ending a run").
        tpx.end_run()  # barrier, a pause for gloo's threads, the groups destroyed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def label(layout: str, sp: bool, depth) -> str:
    if layout == "1d":
        return "1d+sp" if sp else "1d"
    return f"{layout} d={depth}" if depth else layout


STATE = ("params", "grads", "adam")


def summarize(row: dict) -> dict:
    """Max over ranks of every measured and derived number; whether each rank is exact."""
    ranks = row["ranks"]
    s = {}
    for k in STATE + ("activations",):
        s[k] = max(r[k] for r in ranks)
        s[f"{k}_derived"] = max(r["derived"][k] for r in ranks)
        s[f"{k}_diff"] = max((r[k] - r["derived"][k] for r in ranks), key=abs)
    s["params_local"] = max(r["params_local"] for r in ranks)
    s["state"] = max(sum(r[k] for k in STATE) for r in ranks)
    s["state_derived"] = max(sum(r["derived"][k] for k in STATE) for r in ranks)
    s["state_exact"] = all(r[k] == r["derived"][k] and r["params_local"] == r["derived"]["params"]
                           for r in ranks for k in STATE)
    s["activations_exact"] = all(r["activations"] == r["derived"]["activations"] for r in ranks)
    s["peak"] = max(r["peak"] for r in ranks)
    floors = [r["derived"]["params"] + r["derived"]["adam"] + r["derived"]["activations"]
              for r in ranks]
    s["peak_floor_derived"] = max(floors)
    s["peak_over_floor"] = max(r["peak"] - f for r, f in zip(ranks, floors))
    s["peak_sum_derived"] = max(f + r["derived"]["grads"] for r, f in zip(ranks, floors))
    return s


def _kib(b) -> str:
    return f"{b / 1024:.1f}"


def _signed(b) -> str:
    return "0" if b == 0 else f"{b:+d}"


def print_tables(rows: list) -> None:
    one = {r["model"]: r["summary"]["peak"] for r in rows
           if r["world"] == 1 and r["layout"] == "1d"}
    table = []
    for r in rows:
        s = r["summary"]
        rel = (s["state"] - s["state_derived"]) / s["state_derived"]
        act_rel = s["activations_diff"] / s["activations_derived"]
        base = one.get(r["model"])
        table.append([r["model"], label(r["layout"], r["sequence_parallel"], r["depth"]),
                      r["world"],
                      _kib(s["params"]), _kib(s["params_derived"]),
                      _kib(s["grads"]), _kib(s["adam"]), _kib(s["adam_derived"]),
                      f"{_signed(s['state'] - s['state_derived'])} ({rel:.1%})",
                      _kib(s["activations"]), _kib(s["activations_derived"]),
                      f"{_signed(s['activations_diff'])} ({act_rel:.1%})",
                      _kib(s["peak"]), _kib(s["peak_floor_derived"]),
                      f"{s['peak_over_floor'] / 1024:+.1f} "
                      f"({s['peak_over_floor'] / s['peak_floor_derived']:+.0%})",
                      "" if base is None else f"{s['peak'] / base:.2f}"])
    print("\nper rank (max over ranks), fp32, KiB = 1024 B. meas = tpx.memory (CPU allocator "
          "counter), der = derived from the layout. state = params + grads + Adam: diff in "
          "bytes (relative); act = saved for backward after the forward; peak = one training "
          "step with Adam state present; floor = der params + Adam + act (a moment of the "
          "step); vs 1 = peak / one device's peak")
    print(format_table(["model", "layout", "P", "params meas", "der", "grads meas", "Adam meas",
                        "der", "state diff B", "act meas", "der", "act diff B", "peak meas",
                        "floor der", "peak - floor KiB", "peak vs 1"], table, text_columns=2))
    state = all(r["summary"]["state_exact"] for r in rows)
    act = all(r["summary"]["activations_exact"] for r in rows)
    print(f"params, grads and Adam state equal the derivation on every rank: "
          f"{'yes' if state else 'NO'}; saved activations equal it: {'yes' if act else 'NO'}")


def plot(rows: list, path: Path) -> Path:
    """Per-rank peak (measured, solid) and params + grads + Adam (derived = measured, dotted)
    against the number of ranks, one line per layout, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.0 * len(models), 4.4), squeeze=False)
    styles = {"1d": ("tab:blue", "o"), "1d+sp": ("tab:green", "s"), "2d": ("tab:orange", "D"),
              "2.5d d=2": ("tab:purple", "^"), "3d": ("tab:red", "v")}
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        one = [r for r in mine if r["world"] == 1]
        handles = []
        for key, (color, marker) in styles.items():
            pts = [r for r in mine
                   if label(r["layout"], r["sequence_parallel"], r["depth"]) == key]
            if not pts:
                continue
            if key != "1d":  # every layout starts from the one-device model
                pts = one + pts
            pts.sort(key=lambda r: r["world"])
            xs = [r["world"] for r in pts]
            ax.plot(xs, [r["summary"]["peak"] / MIB for r in pts], "-", marker=marker,
                    color=color)
            ax.plot(xs, [r["summary"]["state_derived"] / MIB for r in pts], ":",
                    marker=marker, mfc="none", color=color, alpha=0.7)
            handles.append(Line2D([], [], color=color, marker=marker, label=key))
        handles += [Line2D([], [], color="k", ls="-", label="peak of a step (measured)"),
                    Line2D([], [], color="k", ls=":", label="params + grads + Adam "
                                                            "(derived = measured)")]
        c = mine[0]["config"]
        ax.set_title(f"{name}: Decoder(V={c['vocab']}, D={c['dim']}, L={c['n_layers']}, "
                     f"F={c['hidden']}), batch {c['batch']}x{c['seq']}, fp32, Adam", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.set_xlabel("ranks P")
        ax.set_ylabel("MiB per rank (CPU allocator count)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(handles=handles, fontsize=7.5, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,wide",
                   help=f"comma-separated, from {list(MODELS)} (default: tiny,wide)")
    p.add_argument("--worlds", default=",".join(str(w) for w in CONFIGS),
                   help=f"comma-separated world sizes, from {list(CONFIGS)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="the example's Decoder() (model 'quick') at 1 and 2 ranks; results to "
                        "*_quick.*")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/bench_memory_<device>.json)")
    p.add_argument("--plot", default=None,
                   help="plot path (default benchmarks/results/bench_memory.png)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a collective may wait before the run fails (default 600)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: print the tables and redraw the plot from --out")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.worlds = "quick", "1,2"
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"--models: choose from {list(MODELS)}; got {bad or 'nothing'}")
    try:
        args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        p.error(f"--worlds: comma-separated integers from {list(CONFIGS)}")
    bad = [w for w in args.worlds if w not in CONFIGS]
    if bad or not args.worlds:
        p.error(f"--worlds: choose from {list(CONFIGS)}; got {bad or 'nothing'}")
    if args.timeout <= 0:
        p.error("--timeout must be > 0 seconds")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no GPU")
        if max(args.worlds) > torch.cuda.device_count():
            p.error(f"--worlds: {max(args.worlds)} ranks need as many GPUs; "
                    f"{torch.cuda.device_count()} visible")
    # Every derivation must apply before anything runs (sizes that do not divide: ValueError).
    for name in args.models:
        spec = MODELS[name]
        for world in args.worlds:
            for layout, sp, depth in CONFIGS[world]:
                try:
                    derive(spec["model"], spec["batch"], spec["seq"], layout, world, 0, sp,
                           depth)
                except ValueError as e:
                    p.error(f"--models {name} at --worlds {world} ({label(layout, sp, depth)}): "
                            f"{e}")
    suffix = "_quick" if args.quick else ""
    args.out = Path(args.out or RESULTS_DIR / f"bench_memory_{args.device}{suffix}.json")
    args.plot = Path(args.plot or RESULTS_DIR / f"bench_memory{suffix}.png")
    return args


def run(args) -> dict:
    """Runs every world size, prints the tables, writes the JSON and the plot; returns the
    payload."""
    rows, env = [], None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for world in args.worlds:
        print(f"running P={world} ({world} ranks on {cpus} cores) ...", flush=True)
        fd, partial = tempfile.mkstemp(prefix=f"bench_memory_p{world}_", suffix=".json")
        os.close(fd)
        args.partial = partial
        try:
            spawn_ranks(run_world, world, args, f"bench_memory_p{world}")
            data = json.loads(Path(partial).read_text())
        finally:
            os.unlink(partial)
        env = env or dict(data["environment"], world_size=args.worlds)
        rows += data["rows"]
    order = {m: i for i, m in enumerate(args.models)}
    rows.sort(key=lambda r: (order[r["model"]], r["world"]))
    for r in rows:
        r["summary"] = summarize(r)
    print_env(env)
    print_tables(rows)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "partial"}
    payload = dict(
        benchmark="bench_memory: per-rank memory of one Adam training step of the tiny Llama "
                  "decoder, one device vs 1-D (+SP) / 2-D / 2.5-D / 3-D TP, measured vs derived",
        definitions=dict(
            params="bytes of this rank's parameters (allocator growth from building the "
                   "sharded model)",
            grads="allocator growth from the backward, the forward's outputs dropped",
            adam="allocator growth from the first optimizer.step(): exp_avg, exp_avg_sq, step",
            activations="allocator growth from the forward (saved for backward, incl. loss)",
            peak="largest allocation total during a training step with Adam state present",
            peak_floor_derived="derived params + Adam + activations",
            diff="measured - derived, bytes"),
        config=dict(config, seed=SEED, lr=LR, optimizer="Adam", dtype="float32",
                    models={m: MODELS[m] for m in args.models}, loss_tolerance=TOL,
                    loss_tolerance_after_adam=TOL_AFTER_ADAM),
        environment=env, results=rows)
    print(f"\nwrote {write_json(args.out, payload)}")
    print(f"wrote {plot(rows, args.plot)}")
    return payload


def replot(args) -> None:
    data = json.loads(Path(args.out).read_text())
    print_env(data["environment"])
    print_tables(data["results"])
    print(f"wrote {plot(data['results'], args.plot)}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.replot:
        replot(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
