"""Benchmark of a tensor-parallel MLP block: column-parallel Linear -> ReLU -> row-parallel Linear.

What is measured: one training step of the block -- ``zero_grad``, forward, and backward of
``loss = (y * g).sum()`` for a fixed random ``g`` -- on a 2-D fp32 input ``[tokens, d]``
(``d -> h -> d``), for these variants, all built from the same seeded ``nn.Linear`` weights:

* ``tpx chunks=1``       tpx.ColumnParallelLinear / RowParallelLinear, collectives not overlapped;
* ``tpx default chunks/2/4`` the same layers, collectives overlapped with the GEMMs (the
                         default depth is 1 for messages under 1 MiB, else 2);
* ``DTensor TP``         ``parallelize_module`` with ColwiseParallel / RowwiseParallel (default
                         input layouts) on a 1-D DeviceMesh, fed a plain replicated tensor;
* ``single process``     the unsharded MLP in one process (one thread on CPU), timed on rank 0
                         while the other ranks wait; ``ideal`` = its time / world size.

Every variant is first checked against the unsharded reference (output, input gradient, and this
rank's shard of the first layer's weight gradient; rtol = atol = 1e-4). A timed sample is a
block of steps run back to back after one barrier (10 steps for the small shape, 1 for the
large); its time per step is the maximum over ranks. Variants are sampled round robin and the
median (and min) over samples is reported. Results go to ``benchmarks/results/bench_linear_<device>_tp<world>.json``.

Run:
    python benchmarks/bench_linear.py                  # CPU: 2 gloo ranks spawned, 1 thread each
    torchrun --nproc-per-node 8 benchmarks/bench_linear.py --device cuda --overlap flux
        # all-gather+GEMM and GEMM+reduce-scatter at Flux's shapes (M=4096, K=12288,
        # N=49152/TP, and the reverse) on >= 2 GPUs: tpx chunks 2/4 vs chunks=1 vs DTensor,
        # the GEMM and the collective alone, and the fraction of communication hidden
    python benchmarks/bench_linear.py --overlap tiny   # the same code on CPU, small shape
    python benchmarks/bench_linear.py --shapes small --quick
    torchrun --nproc-per-node 2 benchmarks/bench_linear.py --device cuda   # NCCL, >= 2 GPUs

``--situations train,frozen,no-xgrad`` times tpx (default chunks) against DTensor TP in three
training situations, one shape at a time, round robin (each round: one sample of tpx and one of
DTensor per situation, the order rotated from round to round, and before each sample
``--sample-warmup`` untimed steps of the same variant; the reported ratio is the median over
rounds of tpx / DTensor):

* ``train``     input, weights and biases all need gradients;
* ``frozen``    weights and biases frozen (``requires_grad_(False)``, as in adapter
                fine-tuning); only the input gradient is computed;
* ``no-xgrad``  the input needs no gradient (the first layer over raw features); weights train.

Each situation is checked first: outputs, the gradients that exist equal the unsharded
reference, and the ones nobody asked for are ``None``. Each round also times ``GEMMs alone``:
the GEMMs of this rank's step and nothing else (the floor of any TP implementation that runs
them through ATen). When tpx's CPU GEMM is not ATen's (``tpx.ops.cpu_gemm_backend()``, oneDNN
by default), each round also times the same tpx model with ATen's GEMMs
(``TPX_CPU_GEMM=aten``) and the GEMMs alone through tpx's GEMM, so that the ratio splits into
what the GEMM backend gives and what the TP engine gives. ``--exchange`` adds tpx timed with
its two-rank send/recv exchange instead of gloo's all-reduce (``TPX_GLOO_ALLREDUCE=exchange``,
on a group of its own), the same weights, in the same rounds. ``--gloo-threads`` adds both
libraries timed with gloo's event-loop threads as gloo starts them (``SCHED_OTHER``); tpx
switches the threads of its own groups to ``SCHED_BATCH``, and the benchmark switches every
gloo thread of the process the same way for the other variants, so that DTensor, timed in
the same processes, runs with them switched too.

    python benchmarks/bench_linear.py --situations train,frozen,no-xgrad
    python benchmarks/bench_linear.py --situations train,frozen,no-xgrad --shapes small --exchange
    python benchmarks/bench_linear.py --situations train,frozen,no-xgrad --gloo-threads

With ``--device cuda`` and a single GPU the TP block is not run; instead one monolithic bf16 GEMM
is compared with the row-chunked decomposition tpx uses (M split into 2/4/8 chunks, each written
into a slice of a preallocated output), timed with CUDA events.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common import (environment, format_table, print_env, set_gloo_loop_policy, spawn_ranks, step,
                    write_json)

SHAPES = {"small": dict(tokens=128, d=512, h=2048), "large": dict(tokens=2048, d=1024, h=4096)}
REPEATS = {"small": 60, "large": 10}
WARMUP = {"small": 5, "large": 2}
BLOCK = {"small": 10, "large": 1}  # steps per timed sample
TOL = dict(rtol=1e-4, atol=1e-4)
SEED = 1234
GEMM_SHAPES = [(8192, 8192, 3584), (8192, 3584, 8192)]  # (M, K, N)
GEMM_CHUNKS = (1, 2, 4, 8)
# Op-level overlap at Flux's shapes (Chang et al., 2024, "FLUX: Fast Software-based
# Communication Overlap on GPUs Through Kernel Fusion"): M=4096, K=12288, N=49152 split over
# TP; "tiny" is a CPU smoke test of the same code.
OVERLAP_SHAPES = {"flux": dict(M=4096, K=12288, N=49152), "tiny": dict(M=256, K=384, N=512)}
RESULTS_DIR = Path(__file__).resolve().parent / "results"


class MLP(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = fc1, nn.ReLU(), fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(model, x, g, warmup: int, repeats: int, device, distributed: bool,
               block: int = 1) -> list:
    """Per-step wall times in ms: each sample runs ``block`` steps back to back (as training
    does, with no barrier between steps) after one barrier, and reports their mean; with
    ``distributed`` a sample's time is the max over ranks."""
    for _ in range(warmup):
        step(model, x, g)
    times = []
    for _ in range(repeats):
        synchronize(device)
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(block):
            step(model, x, g)
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3 / block)
    if distributed:
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times = t.tolist()
    return times


def assert_matches(got: torch.Tensor, want: torch.Tensor, through_relu: bool = False) -> None:
    """``got`` equals the reference within TOL, element by element.

    ``through_relu``: a gradient that flowed back through the ReLU. Two correct fp32 GEMMs that
    round differently (tpx's oneDNN GEMM and the reference's ATen one) can put a hidden
    activation that is within rounding of 0 on different sides of it, which flips that one
    element of the ReLU mask: its gradient then differs by a whole term, in the row and
    column it feeds. For such a gradient a few mismatched elements are accepted when the
    tensor as a whole agrees (relative Frobenius error <= 1e-3, at most 0.1% of the elements
    outside TOL); a wrong chunk, rank order or missing reduction is far outside both."""
    try:
        torch.testing.assert_close(got, want, **TOL)
    except AssertionError:
        if not through_relu:
            raise
        diff = (got.double() - want.double())
        rel = (diff.norm() / want.double().norm().clamp_min(1e-30)).item()
        outside = (diff.abs() > TOL["atol"] + TOL["rtol"] * want.double().abs()).double().mean()
        if rel > 1e-3 or outside.item() > 1e-3:
            raise AssertionError(f"relative Frobenius error {rel:.3g}, {outside.item():.3%} of "
                                 "the elements outside the tolerance")


def check_variant(name: str, model, x, g, expect: dict, rows: tuple, device) -> None:
    """Compares one step of ``model`` with the unsharded reference; every rank raises if any
    rank disagrees (so no rank is left waiting in a collective)."""
    from torch.distributed.tensor import DTensor

    y = step(model, x, g)
    w_grad = model.fc1.weight.grad
    got = {"output": y.full_tensor() if isinstance(y, DTensor) else y,
           "input gradient": x.grad,
           "fc1 weight-gradient shard":
               w_grad.to_local() if isinstance(w_grad, DTensor) else w_grad}
    want = {"output": expect["y"], "input gradient": expect["x_grad"],
            "fc1 weight-gradient shard": expect["w1_grad"][rows[0]:rows[1]]}
    error = ""
    for key, value in got.items():
        try:
            if value is None:
                raise AssertionError("it is None")
            assert_matches(value.detach(), want[key], through_relu=key != "output")
        except AssertionError as e:
            error = (f"{name}: the {key} differs from the unsharded reference on rank "
                     f"{dist.get_rank()}:\n{e}")
            break
    flag = torch.tensor([1.0 if error else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise RuntimeError(error or f"{name}: another rank disagrees with the reference; "
                                    "see its error message")


def build_variants(ref: MLP, device: torch.device, world: int) -> dict:
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    variants = {}
    for label, chunks in [("tpx chunks=1", 1), ("tpx default chunks", None),
                          ("tpx chunks=2", 2), ("tpx chunks=4", 4)]:
        variants[label] = MLP(tpx.ColumnParallelLinear.from_linear(ref.fc1, chunks=chunks),
                              tpx.RowParallelLinear.from_linear(ref.fc2, chunks=chunks))
    mesh = init_device_mesh(device.type, (world,))
    variants["DTensor TP"] = parallelize_module(
        copy.deepcopy(ref), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return variants


def bench_shape(name: str, args, device, world: int) -> list:
    import tpx

    shape = SHAPES[name]
    if shape["h"] % world:  # DTensor's RowwiseParallel rebuilds the global shape as local * world
        raise ValueError(f"{name}: h={shape['h']} must divide by the world size {world} for the "
                         "DTensor variant")
    repeats = args.repeats or REPEATS[name]
    warmup = WARMUP[name] if args.warmup is None else args.warmup
    torch.manual_seed(SEED)  # identical on every rank: same weights, input and g
    ref = MLP(nn.Linear(shape["d"], shape["h"]), nn.Linear(shape["h"], shape["d"])).to(device)
    x = torch.randn(shape["tokens"], shape["d"], device=device, requires_grad=True)
    g = torch.randn(shape["tokens"], shape["d"], device=device)
    y = step(ref, x, g)
    expect = {"y": y.detach().clone(), "x_grad": x.grad.clone(),
              "w1_grad": ref.fc1.weight.grad.clone()}
    rows = tpx.shard_range(shape["h"])

    variants = build_variants(ref, device, world)
    for label, model in variants.items():
        check_variant(label, model, x, g, expect, rows, device)

    block = BLOCK[name]
    results = []
    if dist.get_rank() == 0:  # the unsharded model, one process; the other ranks wait
        times = time_steps(ref, x, g, warmup, repeats, device, distributed=False, block=block)
        results.append(dict(variant="single process", times_ms=times))
    dist.barrier()
    # Round robin: every round takes one sample of each variant, so slow drifts of the
    # machine's speed spread over all variants instead of landing on one.
    for model in variants.values():
        time_steps(model, x, g, warmup, 0, device, distributed=True)
    samples = {label: [] for label in variants}
    for _ in range(repeats):
        for label, model in variants.items():
            samples[label] += time_steps(model, x, g, 0, 1, device, distributed=True, block=block)
    results += [dict(variant=label, times_ms=t) for label, t in samples.items()]
    for r in results:
        r.update(shape=name, median_ms=statistics.median(r["times_ms"]),
                 min_ms=min(r["times_ms"]), repeats=repeats, warmup=warmup,
                 steps_per_sample=block)
    return results


SITUATIONS = ("train", "frozen", "no-xgrad")
EXCHANGE = "tpx (two-rank exchange)"  # --exchange: tpx with TPX_GLOO_ALLREDUCE=exchange
ATEN_GEMM = "tpx (ATen GEMMs)"     # the same tpx model with TPX_CPU_GEMM=aten
FLOOR = "GEMMs alone"              # the step's GEMMs through ATen (torch.mm), no communication
FLOOR_TPX = "GEMMs alone (tpx GEMM)"  # the same GEMMs through tpx's GEMM (tpx.ops.local_matmul)
# --gloo-threads: both libraries timed with gloo's event-loop threads as gloo starts them
# (SCHED_OTHER) instead of as tpx sets its own (SCHED_BATCH, see docs/benchmarks.md "Gloo's
# event-loop threads"; the benchmark sets DTensor's the same way, for a like-for-like timing).
TPX_OTHER, DTENSOR_OTHER = "tpx (gloo threads SCHED_OTHER)", "DTensor (gloo threads SCHED_OTHER)"
# The environment each variant is timed under; variants not listed run with these unset.
VARIANT_ENV = {EXCHANGE: {"TPX_GLOO_ALLREDUCE": "exchange"}, ATEN_GEMM: {"TPX_CPU_GEMM": "aten"}}


def _set_variant_env(label: str, device: torch.device) -> None:
    for key in {k for env in VARIANT_ENV.values() for k in env}:
        value = VARIANT_ENV.get(label, {}).get(key)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if device.type == "cpu" and (os.environ.get("TPX_GLOO_LOOP_POLICY") or "batch") == "batch":
        set_gloo_loop_policy(os.SCHED_OTHER if label in (TPX_OTHER, DTENSOR_OTHER)
                             else os.SCHED_BATCH)


def _configure(model: nn.Module, situation: str) -> None:
    for p in model.parameters():
        p.requires_grad_(situation != "frozen")


def _check_situation(label: str, situation: str, model, x, g, expect: dict, rows: tuple,
                     device) -> None:
    """Output and gradients against the unsharded reference; gradients nobody asked for
    must be None. Every rank raises when any rank disagrees."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    y = step(model, x, g)
    error = ""
    try:
        y_full = y.full_tensor() if isinstance(y, DTensor) else y
        assert_matches(y_full.detach(), expect["y"])
        if situation == "no-xgrad":
            assert x.grad is None, "the input got a gradient although it needs none"
        else:
            assert_matches(x.grad, expect["x_grad"], through_relu=True)
        w_grad = model.fc1.weight.grad
        if situation == "frozen":
            assert w_grad is None, "a frozen weight got a gradient"
        else:
            assert_matches(local(w_grad), expect["w1_grad"][rows[0]:rows[1]], through_relu=True)
    except AssertionError as e:
        error = f"{label} ({situation}) on rank {dist.get_rank()}: {e}"
    flag = torch.tensor([1.0 if error else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise RuntimeError(error or f"{label} ({situation}): another rank disagrees")


def gemm_floor_step(ref: MLP, situation: str, world: int, device, tpx_gemm: bool = False):
    """The GEMMs of one rank's step in ``situation`` and nothing else, at this rank's shard
    shapes, in the layouts ``nn.Linear`` uses: 2 forward GEMMs, then the backward's input
    gradient GEMMs (the first layer's only when the input needs a gradient) and weight
    gradient GEMMs (only when the weights train). No collective, no elementwise op.

    Through ATen (``torch.mm``, what DTensor and ``nn.Linear`` run) this is the floor of any
    TP implementation that uses ATen's GEMM; with ``tpx_gemm`` the same products go through
    the GEMM tpx's ops use (``tpx.ops.local_matmul``; oneDNN on the CPU, see
    ``tpx.ops.cpu_gemm_backend``), the floor of tpx's own step."""
    import tpx

    h, d = ref.fc1.weight.shape
    width = -(-h // world)  # the widest shard
    w1, w2 = torch.randn(width, d, device=device), torch.randn(d, width, device=device)
    b1 = torch.randn(width, device=device)
    if tpx_gemm:
        mm, addmm = tpx.ops.local_matmul, lambda bias, a, b: tpx.ops.local_matmul(a, b, bias)
    else:
        mm, addmm = torch.mm, torch.addmm

    @torch.no_grad()
    def run(x: torch.Tensor) -> None:
        hid = addmm(b1, x, w1.t())
        out = mm(hid, w2.t())
        grad_hid = mm(out, w2)                     # row layer: input gradient
        if situation != "frozen":
            mm(out.t(), hid)                       # row layer: weight gradient
            mm(grad_hid.t(), x)                    # column layer: weight gradient
        if situation != "no-xgrad":
            mm(grad_hid, w1)                       # column layer: input gradient
    return run


def bench_situations(name: str, args, device, world: int) -> list:
    """tpx (default chunks) / DTensor per situation, round robin, per-round ratios."""
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    shape = SHAPES[name]
    repeats = args.repeats or REPEATS[name]
    warmup = WARMUP[name] if args.warmup is None else args.warmup
    block = BLOCK[name]
    torch.manual_seed(SEED)
    ref = MLP(nn.Linear(shape["d"], shape["h"]), nn.Linear(shape["h"], shape["d"])).to(device)
    x_data = torch.randn(shape["tokens"], shape["d"], device=device)
    g = torch.randn(shape["tokens"], shape["d"], device=device)
    x_ref = x_data.clone().requires_grad_(True)
    y = step(ref, x_ref, g)
    expect = {"y": y.detach().clone(), "x_grad": x_ref.grad.clone(),
              "w1_grad": ref.fc1.weight.grad.clone()}
    rows = tpx.shard_range(shape["h"])
    mesh = init_device_mesh(device.type, (world,))
    gemm_split = device.type == "cpu" and tpx.ops.cpu_gemm_backend() != "aten"
    runs = {}
    exchange_group = None
    for situation in args.situations:
        x = x_data.clone().requires_grad_(situation != "no-xgrad")
        models = {
            "tpx": MLP(tpx.ColumnParallelLinear.from_linear(ref.fc1),
                       tpx.RowParallelLinear.from_linear(ref.fc2)),
            "DTensor": parallelize_module(copy.deepcopy(ref), mesh,
                                          {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}),
        }
        for label, model in models.items():
            _configure(model, situation)
            _check_situation(label, situation, model, x, g, expect, rows, device)
            for _ in range(warmup):
                step(model, x, g)
        models[FLOOR] = gemm_floor_step(ref, situation, world, device)
        if gemm_split:
            # tpx's GEMM differs from ATen's: time the same tpx model with ATen's GEMMs, and
            # the GEMMs alone through tpx's, so the gain splits into its two sources.
            models[FLOOR_TPX] = gemm_floor_step(ref, situation, world, device, tpx_gemm=True)
            models[ATEN_GEMM] = models["tpx"]
        if args.exchange:
            # The same tpx model on a group of its own: tpx decides how a group sums when it
            # first meets it (agreed by the ranks), so this group meets it under
            # TPX_GLOO_ALLREDUCE=exchange.
            if exchange_group is None:
                exchange_group = dist.new_group(list(range(world)))
            models[EXCHANGE] = MLP(
                tpx.ColumnParallelLinear.from_linear(ref.fc1, group=exchange_group),
                tpx.RowParallelLinear.from_linear(ref.fc2, group=exchange_group))
            _configure(models[EXCHANGE], situation)
            _set_variant_env(EXCHANGE, device)
            _check_situation(EXCHANGE, situation, models[EXCHANGE], x, g, expect, rows, device)
            _set_variant_env("tpx", device)
        if args.gloo_threads:  # both models, timed with gloo's threads as gloo starts them
            models[TPX_OTHER], models[DTENSOR_OTHER] = models["tpx"], models["DTensor"]
        runs[situation] = (models, x)

    def run_once(model, x) -> None:
        if isinstance(model, nn.Module):
            step(model, x, g)
        else:  # the GEMM floor
            model(x)

    def sample(model, x) -> float:
        # Untimed steps first, so that the timed ones start from this variant's own previous
        # step (its buffers freed and reusable), as consecutive training steps do, and not
        # from whatever the variant timed before it left behind.
        for _ in range(args.sample_warmup):
            run_once(model, x)
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(block):
            run_once(model, x)
        synchronize(device)
        t = torch.tensor([(time.perf_counter() - t0) * 1e3 / block], dtype=torch.float64,
                         device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    cpu_gemm = tpx.ops.cpu_gemm_backend() if device.type == "cpu" else "aten (cuBLAS)"
    samples = {s: {label: [] for label in runs[s][0]} for s in args.situations}
    for r in range(repeats):
        for situation, (models, x) in runs.items():
            # Round robin, and each round starts with the next variant: none always runs
            # first, or always after the same one.
            labels = list(models)
            labels = labels[r % len(labels):] + labels[:r % len(labels)]
            for label in labels:
                model = models[label]
                _set_variant_env(label, device)
                samples[situation][label].append(sample(model, x))
    _set_variant_env("tpx", device)
    results = []
    for situation, by in samples.items():
        ratios = [a / b for a, b in zip(by["tpx"], by["DTensor"])]
        results.append(dict(shape=name, situation=situation, repeats=repeats,
                            steps_per_sample=block,
                            tpx_median_ms=statistics.median(by["tpx"]),
                            dtensor_median_ms=statistics.median(by["DTensor"]),
                            gemm_floor_median_ms=statistics.median(by[FLOOR]),
                            floor_over_dtensor=statistics.median(
                                [a / b for a, b in zip(by[FLOOR], by["DTensor"])]),
                            ratio_median=statistics.median(ratios),
                            ratio_q1=statistics.quantiles(ratios, n=4)[0] if len(ratios) > 1
                            else ratios[0],
                            ratio_q3=statistics.quantiles(ratios, n=4)[2] if len(ratios) > 1
                            else ratios[0],
                            tpx_times_ms=by["tpx"], dtensor_times_ms=by["DTensor"],
                            gemm_floor_times_ms=by[FLOOR],
                            cpu_gemm=cpu_gemm,
                            **({} if ATEN_GEMM not in by else dict(
                                tpx_aten_gemm_median_ms=statistics.median(by[ATEN_GEMM]),
                                tpx_aten_gemm_over_dtensor=statistics.median(
                                    [a / b for a, b in zip(by[ATEN_GEMM], by["DTensor"])]),
                                tpx_gemm_floor_median_ms=statistics.median(by[FLOOR_TPX]),
                                tpx_gemm_floor_over_dtensor=statistics.median(
                                    [a / b for a, b in zip(by[FLOOR_TPX], by["DTensor"])]),
                                tpx_over_tpx_gemm_floor=statistics.median(
                                    [a / b for a, b in zip(by["tpx"], by[FLOOR_TPX])]),
                                tpx_aten_gemm_times_ms=by[ATEN_GEMM],
                                tpx_gemm_floor_times_ms=by[FLOOR_TPX])),
                            **({} if TPX_OTHER not in by else dict(
                                tpx_other_threads_median_ms=statistics.median(by[TPX_OTHER]),
                                dtensor_other_threads_median_ms=statistics.median(
                                    by[DTENSOR_OTHER]),
                                # both as gloo starts its threads
                                ratio_other_threads=statistics.median(
                                    [a / b for a, b in zip(by[TPX_OTHER], by[DTENSOR_OTHER])]),
                                # tpx as it runs / DTensor in a process without tpx
                                tpx_over_dtensor_other_threads=statistics.median(
                                    [a / b for a, b in zip(by["tpx"], by[DTENSOR_OTHER])]),
                                tpx_other_threads_times_ms=by[TPX_OTHER],
                                dtensor_other_threads_times_ms=by[DTENSOR_OTHER])),
                            **({} if EXCHANGE not in by else dict(
                                tpx_exchange_median_ms=statistics.median(by[EXCHANGE]),
                                exchange_over_gloo_allreduce=statistics.median(
                                    [a / b for a, b in zip(by[EXCHANGE], by["tpx"])]),
                                tpx_exchange_times_ms=by[EXCHANGE])),
                            ratios=ratios))
    return results


def report_situations(results: list, env: dict, args, world: int) -> None:
    rows = [[r["shape"], r["situation"], f"{r['tpx_median_ms']:.2f}",
             f"{r['dtensor_median_ms']:.2f}", f"{r['gemm_floor_median_ms']:.2f}",
             f"{r['ratio_median']:.2f}", f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}",
             f"{r['floor_over_dtensor']:.2f}"] for r in results]
    print(f"\nMLP fwd+bwd, fp32, TP={world} ({env['backend']}), tpx default chunks vs DTensor TP; "
          "ratio = median over rounds of tpx / DTensor (lower is better); GEMMs alone = the "
          "step's GEMMs on each rank with no communication (the floor)")
    print(format_table(["shape", "situation", "tpx ms", "DTensor ms", "GEMMs alone ms",
                        "tpx/DTensor", "ratio IQR", "floor/DTensor"], rows, text_columns=2))
    if any("tpx_aten_gemm_median_ms" in r for r in results):
        print(f"\nWhere the gain comes from: tpx runs its CPU GEMMs on {results[0]['cpu_gemm']} "
              "(tpx.ops.cpu_gemm_backend()), DTensor on ATen's. 'tpx, ATen GEMMs' is the same "
              "tpx model with TPX_CPU_GEMM=aten; the floors are the step's GEMMs alone through "
              "each GEMM (medians over rounds of per-round ratios)")
        print(format_table(
            ["shape", "situation", "tpx, ATen GEMMs ms", "GEMMs alone, tpx GEMM ms",
             "tpx ATen-GEMMs/DTensor", "ATen floor/DTensor", "tpx-GEMM floor/DTensor",
             "tpx/tpx-GEMM floor"],
            [[r["shape"], r["situation"], f"{r['tpx_aten_gemm_median_ms']:.2f}",
              f"{r['tpx_gemm_floor_median_ms']:.2f}", f"{r['tpx_aten_gemm_over_dtensor']:.2f}",
              f"{r['floor_over_dtensor']:.2f}", f"{r['tpx_gemm_floor_over_dtensor']:.2f}",
              f"{r['tpx_over_tpx_gemm_floor']:.2f}"] for r in results if
             "tpx_aten_gemm_median_ms" in r], text_columns=2))
    if any("exchange_over_gloo_allreduce" in r for r in results):
        print("\ntpx with its two-rank exchange / tpx with gloo's all-reduce (the default; median "
              "over rounds)")
        print(format_table(["shape", "situation", "tpx ms", "tpx exchange ms", "ratio"],
                           [[r["shape"], r["situation"], f"{r['tpx_median_ms']:.2f}",
                             f"{r['tpx_exchange_median_ms']:.2f}",
                             f"{r['exchange_over_gloo_allreduce']:.2f}"] for r in results],
                           text_columns=2))
    if any("ratio_other_threads" in r for r in results):
        print("\nWith gloo's event-loop threads as gloo starts them (SCHED_OTHER): both libraries, "
              "and tpx as it runs against DTensor in a process without tpx (medians over rounds)")
        print(format_table(["shape", "situation", "tpx ms", "DTensor ms", "tpx/DTensor",
                            "tpx (SCHED_BATCH) / DTensor (SCHED_OTHER)"],
                           [[r["shape"], r["situation"], f"{r['tpx_other_threads_median_ms']:.2f}",
                             f"{r['dtensor_other_threads_median_ms']:.2f}",
                             f"{r['ratio_other_threads']:.2f}",
                             f"{r['tpx_over_dtensor_other_threads']:.2f}"] for r in results],
                           text_columns=2))
    path = Path(args.out or RESULTS_DIR / f"bench_linear_situations_{args.device}_tp{world}.json")
    payload = dict(benchmark="bench_linear --situations: MLP column->ReLU->row, fwd+bwd",
                   shapes={n: SHAPES[n] for n in args.shapes},
                   config=dict(vars(args), seed=SEED, tolerance=TOL, dtype="float32"),
                   environment=env, results=results)
    print(f"\nwrote {write_json(path, payload)}")


def add_ratios(results: list, world: int) -> None:
    by = {r["variant"]: r for r in results}
    single = by["single process"]["median_ms"]
    dtensor = by["DTensor TP"]["median_ms"]
    serial = by["tpx chunks=1"]["median_ms"]
    ideal = single / world
    for r in results:
        r["ideal_ms"] = ideal
        r["vs_dtensor"] = r["median_ms"] / dtensor
        r["vs_ideal"] = r["median_ms"] / ideal
        if r["variant"].startswith("tpx") and r["variant"] != "tpx chunks=1":
            r["vs_tpx_chunks1"] = r["median_ms"] / serial









def _timed(fn, device, repeats: int, warmup: int) -> list:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        t = torch.tensor([(time.perf_counter() - t0) * 1e3])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        times.append(float(t))
    return times


def overlap_bench(name: str, args, device, world: int) -> list:
    """All-gather + GEMM and GEMM + reduce-scatter at one shape: tpx overlapped (chunks 2, 4)
    vs chunks=1 vs DTensor, plus the GEMM alone and the collective alone, and the fraction of
    the communication hidden: (t_serial - t_overlap) / min(t_gemm, t_comm)."""
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dims = OVERLAP_SHAPES[name]
    M, K, N = dims["M"], dims["K"], dims["N"]
    if M % world or N % world:
        raise ValueError(f"{name}: M={M} and N={N} must divide by the world size {world}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    warmup = 3 if args.warmup is None else args.warmup
    mesh = init_device_mesh(device.type, (world,))
    pg = mesh.get_group()
    torch.manual_seed(SEED + dist.get_rank())
    results = []

    # AG + GEMM (column layer, sequence-parallel input): a S(0) [M/W, K], b [K, N/W].
    a = torch.randn(M // world, K, device=device, dtype=dtype)
    b = torch.randn(K, N // world, device=device, dtype=dtype) / K ** 0.5
    a_full = torch.empty(M, K, device=device, dtype=dtype)
    ag = {
        "tpx chunks=1": lambda: tpx.ops.all_gather_matmul(a, b, 0, pg, 1),
        "tpx chunks=2": lambda: tpx.ops.all_gather_matmul(a, b, 0, pg, 2),
        "tpx chunks=4": lambda: tpx.ops.all_gather_matmul(a, b, 0, pg, 4),
        "DTensor": lambda: torch.matmul(
            DTensor.from_local(a, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]),
            DTensor.from_local(b, mesh, [Shard(1)])).to_local(),
        "GEMM alone": lambda: torch.matmul(a_full, b),
        "collective alone": lambda: dist.all_gather_into_tensor(a_full, a, group=pg),
    }
    ref = ag["tpx chunks=1"]()[1]
    for label in ("tpx chunks=2", "tpx chunks=4", "DTensor"):
        out = ag[label]()
        out = out[1] if isinstance(out, tuple) else out
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)

    # GEMM + RS (row layer, sequence-parallel output): a S(-1) [M, N/W], b [N/W, K].
    c = torch.randn(M, N // world, device=device, dtype=dtype)
    d = torch.randn(N // world, K, device=device, dtype=dtype) / N ** 0.5
    partial = torch.empty(M, K, device=device, dtype=dtype)
    out_rs = torch.empty(M // world, K, device=device, dtype=dtype)
    rs = {
        "tpx chunks=1": lambda: tpx.ops.matmul_reduce_scatter(c, d, 0, pg, 1),
        "tpx chunks=2": lambda: tpx.ops.matmul_reduce_scatter(c, d, 0, pg, 2),
        "tpx chunks=4": lambda: tpx.ops.matmul_reduce_scatter(c, d, 0, pg, 4),
        "DTensor": lambda: torch.matmul(
            DTensor.from_local(c, mesh, [Shard(1)]),
            DTensor.from_local(d, mesh, [Shard(0)])).redistribute(mesh, [Shard(0)]).to_local(),
        "GEMM alone": lambda: torch.matmul(c, d, out=partial),
        "collective alone": lambda: dist.reduce_scatter_tensor(out_rs, partial, group=pg),
    }
    ref = rs["tpx chunks=1"]()
    for label in ("tpx chunks=2", "tpx chunks=4", "DTensor"):
        torch.testing.assert_close(rs[label](), ref, rtol=2e-2, atol=2e-2)

    for op, variants in (("AG+GEMM", ag), ("GEMM+RS", rs)):
        samples = {label: [] for label in variants}
        for label, fn in variants.items():
            _timed(fn, device, 0, warmup)
        for _ in range(repeats):  # round robin over the variants
            for label, fn in variants.items():
                samples[label] += _timed(fn, device, 1, 0)
        med = {label: statistics.median(t) for label, t in samples.items()}
        hidden_base = min(med["GEMM alone"], med["collective alone"])
        for label, t in samples.items():
            r = dict(shape=name, op=op, variant=label, M=M, K=K, N=N, times_ms=t,
                     median_ms=med[label], min_ms=min(t), repeats=repeats, dtype=str(dtype),
                     vs_chunks1=med[label] / med["tpx chunks=1"])
            if label.startswith("tpx chunks=") and label != "tpx chunks=1":
                r["comm_hidden"] = (med["tpx chunks=1"] - med[label]) / hidden_base
            results.append(r)
    return results


def report_overlap(results: list, env: dict, args, world: int) -> None:
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [[r["shape"], r["op"], r["variant"], f"{r['median_ms']:.3f}", f"{r['min_ms']:.3f}",
             fmt(r["vs_chunks1"]), fmt(r.get("comm_hidden"))] for r in results]
    print(f"\nCollective matmuls at TP={world} ({env['backend']}); comm hidden = (t_chunks1 - "
          "t) / min(t_GEMM alone, t_collective alone)")
    print(format_table(["shape", "op", "variant", "median ms", "min ms", "vs chunks=1",
                        "comm hidden"], rows, text_columns=3))
    path = Path(args.out or RESULTS_DIR / f"bench_overlap_{args.device}_tp{world}.json")
    payload = dict(benchmark="bench_linear --overlap: all_gather_matmul / matmul_reduce_scatter",
                   shapes={n: OVERLAP_SHAPES[n] for n in args.overlap},
                   config=dict(vars(args), seed=SEED), environment=env, results=results)
    print(f"\nwrote {write_json(path, payload)}")


def run_tp(rank: int, world: int, args, init_method: str, local_rank: int) -> None:
    """The TP benchmark on one rank (spawned, or started by torchrun)."""
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if args.pin and len(cpus) >= world:
            # One core per rank, for every variant alike: the rank's compute thread and its
            # gloo threads stay together instead of migrating between cores.
            os.sched_setaffinity(0, {cpus[local_rank]})
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        env = environment(device, world, backend)
        if rank == 0:
            print_env(env)
        if args.overlap:
            results = []
            for name in args.overlap:
                if rank == 0:
                    print(f"running overlap {name} {OVERLAP_SHAPES[name]} ...", flush=True)
                results += overlap_bench(name, args, device, world)
            if rank == 0:
                report_overlap(results, env, args, world)
            return
        if args.situations:
            results = []
            for name in args.shapes:
                if rank == 0:
                    print(f"running {name} {SHAPES[name]}: {', '.join(args.situations)} ...",
                          flush=True)
                results += bench_situations(name, args, device, world)
            if rank == 0:
                report_situations(results, env, args, world)
            return
        results = []
        for name in args.shapes:
            if rank == 0:
                print(f"running {name} {SHAPES[name]} ...", flush=True)
            shape_results = bench_shape(name, args, device, world)
            if rank == 0:
                add_ratios(shape_results, world)
                results += shape_results
        if rank == 0:
            report_tp(results, env, args, world)
    finally:
        dist.destroy_process_group()


def report_tp(results: list, env: dict, args, world: int) -> None:
    fmt = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    rows = [[r["shape"], r["variant"], f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}",
             fmt(r["vs_dtensor"]), fmt(r["vs_ideal"]), fmt(r.get("vs_tpx_chunks1"))]
            for r in results]
    print(f"\nMLP fwd+bwd, fp32, TP={world} ({env['backend']}), ratios are median / median "
          "(lower is better); ideal = single process / world size")
    print(format_table(["shape", "variant", "median ms", "min ms", "vs DTensor", "vs ideal",
                        "vs tpx chunks=1"], rows, text_columns=2))
    path = Path(args.out or RESULTS_DIR / f"bench_linear_{args.device}_tp{world}.json")
    payload = dict(benchmark="bench_linear: MLP column->ReLU->row, fwd+bwd",
                   shapes={n: SHAPES[n] for n in args.shapes},
                   config=dict(vars(args), seed=SEED, tolerance=TOL, dtype="float32"),
                   environment=env, results=results)
    print(f"\nwrote {write_json(path, payload)}")


def _spawned(rank: int, world: int, args, init_method: str) -> None:
    run_tp(rank, world, args, init_method, local_rank=rank)


def gemm_bench(args, device: str = "cuda", shapes=GEMM_SHAPES, dtype=torch.bfloat16) -> None:
    """One GPU: a monolithic GEMM vs tpx's row-chunked decomposition of it."""
    dev = torch.device(device)
    repeats, warmup = args.repeats or 20, 5 if args.warmup is None else args.warmup
    records = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype) / k ** 0.5
        b = torch.randn(k, n, device=dev, dtype=dtype)
        out = torch.empty(m, n, device=dev, dtype=dtype)
        expect = torch.mm(a, b)

        def run(chunks: int) -> None:
            base, extra, lo = m // chunks, m % chunks, 0
            for i in range(chunks):
                hi = lo + base + (i < extra)
                torch.mm(a[lo:hi], b, out=out[lo:hi])
                lo = hi

        for chunks in GEMM_CHUNKS:
            out.zero_()
            run(chunks)
            torch.testing.assert_close(out, expect, rtol=1.6e-2, atol=1e-2)
            for _ in range(warmup):
                run(chunks)
            times = []
            for _ in range(repeats):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                run(chunks)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            med = statistics.median(times)
            records.append(dict(m=m, k=k, n=n, chunks=chunks, times_ms=times, median_ms=med,
                                min_ms=min(times), tflops=2 * m * k * n / med / 1e9))
    for r in records:
        mono = next(x for x in records if x["chunks"] == 1 and (x["m"], x["k"], x["n"])
                    == (r["m"], r["k"], r["n"]))
        r["vs_monolithic"] = r["median_ms"] / mono["median_ms"]
    env = environment(dev, 1, "none")
    print_env(env)
    print(f"\nGEMM {dtype}, monolithic (chunks=1) vs M split into chunks; CUDA events")
    print(format_table(
        ["M x K x N", "chunks", "median ms", "min ms", "TFLOP/s", "vs monolithic"],
        [[f"{r['m']}x{r['k']}x{r['n']}", r["chunks"], f"{r['median_ms']:.3f}",
          f"{r['min_ms']:.3f}", f"{r['tflops']:.1f}", f"{r['vs_monolithic']:.3f}"]
         for r in records], text_columns=2))
    path = Path(args.out or RESULTS_DIR / f"bench_linear_{device}_tp1.json")
    payload = dict(benchmark="bench_linear: single-GPU GEMM decomposition",
                   shapes=[dict(m=m, k=k, n=n) for m, k, n in shapes],
                   config=dict(vars(args), dtype=str(dtype)), environment=env, results=records)
    print(f"\nwrote {write_json(path, payload)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn (ignored under torchrun; default 2)")
    p.add_argument("--shapes", default="small,large",
                   help=f"comma-separated subset of {','.join(SHAPES)} (default: all)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed iterations (default: small 20, large 5; GEMM 20)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up iterations (default: small 5, large 2; GEMM 5)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 repeats, 1 warm-up")
    p.add_argument("--overlap", default="",
                   help="comma-separated op-level overlap shapes instead of the MLP block: "
                        f"{','.join(OVERLAP_SHAPES)} (flux: GPUs; tiny: a CPU smoke test)")
    p.add_argument("--exchange", action="store_true",
                   help="with --situations: also time tpx with its two-rank send/recv exchange "
                        "instead of gloo's all-reduce (TPX_GLOO_ALLREDUCE=exchange), round robin")
    p.add_argument("--gloo-threads", action="store_true",
                   help="with --situations on the CPU: also time tpx and DTensor with gloo's "
                        "event-loop threads as gloo starts them (SCHED_OTHER), round robin")
    p.add_argument("--situations", default="",
                   help="comma-separated subset of train,frozen,no-xgrad: tpx vs DTensor with "
                        "everything trained, frozen weights, or an input without gradient")
    p.add_argument("--sample-warmup", type=int, default=1,
                   help="--situations: untimed steps of a variant right before each of its "
                        "timed samples (default 1)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin each CPU rank to its own core (pinned by default)")
    args = p.parse_args(argv)
    args.overlap = [s.strip() for s in args.overlap.split(",") if s.strip()]
    if [s for s in args.overlap if s not in OVERLAP_SHAPES]:
        p.error(f"--overlap: choose from {list(OVERLAP_SHAPES)}; got {args.overlap}")
    args.situations = [s.strip() for s in args.situations.split(",") if s.strip()]
    if args.gloo_threads and (args.device != "cpu" or not args.situations):
        p.error("--gloo-threads times gloo's threads: it needs --situations and --device cpu")
    if [s for s in args.situations if s not in SITUATIONS]:
        p.error(f"--situations: choose from {list(SITUATIONS)}; got {args.situations}")
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        p.error(f"--shapes: unknown {unknown}; choose from {list(SHAPES)}")
    if args.quick:
        args.repeats = args.repeats or 2
        args.warmup = 1 if args.warmup is None else args.warmup
    if args.world_size < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--world-size and --repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if args.device == "cuda" and world == 1:
            return gemm_bench(args)
        run_tp(int(os.environ["RANK"]), world, args, "env://",
               local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        if torch.cuda.device_count() < 2:
            if args.overlap:
                raise SystemExit("--overlap needs 2+ GPUs (NCCL refuses two ranks on one GPU)")
            return gemm_bench(args)
        args.world_size = min(args.world_size, torch.cuda.device_count())
    spawn_ranks(_spawned, args.world_size, args, "bench_linear")


if __name__ == "__main__":
    main()
