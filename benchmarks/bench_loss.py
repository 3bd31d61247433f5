"""Benchmark of vocab-parallel cross-entropy and of the fused LM head + loss.

What is measured (CPU, gloo, TP = ``--world-size`` ranks, one thread and one core per rank, fp32,
mean reduction, random targets with about 3% ``ignore_index=-100``):

1. Cross-entropy forward + backward of logits sharded over the vocabulary (each rank holds its
   ``[N, V/world]`` columns, ``tpx.shard_range(V)``), N=8192 tokens, V=32000:

   * ``tpx``                 tpx.vocab_parallel_cross_entropy(..., vocab_size=V);
   * ``tpx inplace_backward`` the same, gradient written over the logits (each step gets a fresh
                             copy of the logits, made outside the timed region);
   * ``gather + F.ce``       all_gather of the shards to the full ``[N, V]`` logits (backward keeps
                             this rank's columns), then F.cross_entropy;
   * ``loss_parallel``       PyTorch's loss parallelism: F.cross_entropy on
                             ``DTensor.from_local(shard, mesh, [Shard(1)])`` with forward and
                             backward inside ``loss_parallel()``.

2. LM head + loss, N=8192, d=256, V=32000, weight shard ``[V/world, d]``: ``unfused`` =
   ``hidden @ weight.T`` -> tpx.vocab_parallel_cross_entropy, then an all-reduce of the hidden
   gradient (so that it is the full one, as the fused op returns it), with and without
   ``inplace_backward``; ``fused`` = tpx.linear_cross_entropy with the default chunk_size and
   with chunk_size=512.

The backward is ``torch.autograd.grad(loss, inputs)``: the gradient a preceding layer would
receive (nothing is accumulated into ``.grad``; with ``inplace_backward`` it is the logits' buffer).
Every variant is first checked against F.cross_entropy on the full logits computed locally:
the loss, and this rank's gradient shard(s) multiplied by the number of counted tokens (so
entries are ``softmax - one_hot``, O(1)); rtol = atol = 1e-5 for section 1, 1e-4 for section 2.
A sample is one fwd+bwd after a barrier; its time is the max over ranks; variants are sampled
round robin and the median (and min) over samples is reported. ``extra peak MiB`` is the growth
of the process's peak resident set during one fwd+bwd (``/proc/self/clear_refs`` reset, then
VmHWM after the step minus VmRSS right before it, after gc and malloc_trim; glibc's mmap
threshold is fixed at 1 MiB in the ranks, see ``exact_rss_allocator``), max over ranks; it
includes the returned gradients. Ratios are median / median and peak / peak.

3. ``--device cuda``: one GPU, one shard (world-size-1 NCCL group), N=16384, V_local=32064, bf16:
   tpx.vocab_parallel_cross_entropy vs eager F.cross_entropy on the same shard, CUDA events;
   forward bandwidth = logits bytes / forward time; peak = torch.cuda.max_memory_allocated.

Results go to ``benchmarks/results/bench_loss_<device>_tp<world>.json`` (raw samples, medians,
config, environment).

Run:
    python benchmarks/bench_loss.py                  # CPU: 2 gloo ranks spawned, 1 thread each
    python benchmarks/bench_loss.py --quick          # smoke test: N=512, V=2000, d=64
    torchrun --nproc-per-node 2 benchmarks/bench_loss.py
    python benchmarks/bench_loss.py --device cuda    # one GPU
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import environment, format_table, print_env, spawn_ranks, write_json

FULL = dict(tokens=8192, vocab=32000, d=256, chunk=512, gpu_tokens=16384, gpu_vocab=32064)
QUICK = dict(tokens=512, vocab=2000, d=64, chunk=128, gpu_tokens=1024, gpu_vocab=2000)
REPEATS = dict(ce=10, lce=3, gpu=20)
IGNORE, SEED = -100, 1234
TOL_CE, TOL_LCE = dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-4, atol=1e-4)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --- measurement helpers -------------------------------------------------------------------

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def exact_rss_allocator() -> bool:
    """Fixes glibc's mmap threshold at 1 MiB (mallopt M_MMAP_THRESHOLD; call it before the
    tensors are made). By default the threshold grows up to 32 MiB as such blocks are freed,
    and blocks under it then come from heaps that keep (and fragment) freed memory, so a step's
    RSS growth would depend on what earlier steps left there (tens to hundreds of MiB of
    noise). With it, every block of 1 MiB or more is mmapped and unmapped when freed, so the
    peak RSS follows the live tensors. It applies to every variant alike (timing included:
    a large block is faulted in afresh on each use, as blocks over 32 MiB always are)."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(-3, 1 << 20))  # -3: M_MMAP_THRESHOLD


def extra_peak_mib(step, state, device: torch.device):
    """Peak memory growth (MiB) during one ``step(state)``; None where it cannot be measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = step(state)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak / 2**20
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)  # returns free heap pages, so that reusing them shows as growth
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _status_kib("VmRSS")
    except (OSError, KeyError):
        return None
    out = step(state)
    peak = _status_kib("VmHWM") - before
    del out
    return peak / 1024


def timed(step, state, device: torch.device, distributed: bool) -> float:
    """Wall time (ms) of one ``step(state)``: CUDA events on GPU, else after a barrier."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(state)
        end.record()
        end.synchronize()
        del out
        return start.elapsed_time(end)
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    out = step(state)
    t = (time.perf_counter() - t0) * 1e3
    del out
    return t


def measure(variants: dict, repeats: int, warmup: int, device, distributed: bool) -> list:
    """variants: label -> (prepare, step). ``prepare()`` (untimed) makes the step's inputs.
    Returns one record per variant with its samples (max over ranks) and extra peak memory."""
    peaks = {}
    for label, (prepare, step) in variants.items():
        peaks[label] = extra_peak_mib(step, prepare(), device)
        for _ in range(warmup):
            timed(step, prepare(), device, distributed)
    samples = {label: [] for label in variants}
    for _ in range(repeats):  # round robin: drifts of the machine spread over all variants
        for label, (prepare, step) in variants.items():
            samples[label].append(timed(step, prepare(), device, distributed))
    if distributed:
        t = torch.tensor([samples[k] for k in variants], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        samples = dict(zip(variants, t.tolist()))
        p = torch.tensor([-1.0 if peaks[k] is None else peaks[k] for k in variants])
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        peaks = {k: (None if v < 0 else v) for k, v in zip(variants, p.tolist())}
    return [dict(variant=k, times_ms=samples[k], median_ms=statistics.median(samples[k]),
                 min_ms=min(samples[k]), extra_peak_mib=peaks[k], repeats=repeats,
                 warmup=warmup) for k in variants]


def check(label: str, got: dict, want: dict, tol: dict, distributed: bool) -> None:
    """Every rank raises if any rank's values differ from the reference."""
    error = ""
    for key, value in got.items():
        try:
            torch.testing.assert_close(value.detach().float().cpu(), want[key].float().cpu(), **tol)
        except AssertionError as e:
            rank = dist.get_rank() if distributed else 0
            error = f"{label}: {key} differs from the reference on rank {rank}:\n{e}"
            break
    if distributed:
        flag = torch.tensor([1.0 if error else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not error:
            error = f"{label}: another rank disagrees with the reference; see its message"
    if error:
        raise RuntimeError(error)


def make_target(n: int, vocab: int, device) -> torch.Tensor:
    target = torch.randint(0, vocab, (n,), device=device)
    target[torch.rand(n, device=device) < 0.03] = IGNORE
    return target


def add_ratios(results: list, base: str, key: str) -> None:
    ref = next(r for r in results if r["variant"] == base)
    for r in results:
        r[f"time_vs_{key}"] = r["median_ms"] / ref["median_ms"]
        a, b = r["extra_peak_mib"], ref["extra_peak_mib"]
        r[f"peak_vs_{key}"] = a / b if a is not None and b else None


# --- section 1: cross-entropy of vocab-sharded logits --------------------------------------

class _GatherColumns(torch.autograd.Function):
    """S(1) -> R: all_gather + cat forward; backward keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x, start, world):
        ctx.start, ctx.width = start, x.shape[1]
        pieces = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(pieces, x.contiguous())
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.start:ctx.start + ctx.width].contiguous(), None, None


def bench_ce(cfg: dict, args, world: int) -> list:
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    n, vocab = cfg["tokens"], cfg["vocab"]
    torch.manual_seed(SEED)  # identical on every rank
    full = torch.randn(n, vocab, requires_grad=True)
    target = make_target(n, vocab, "cpu")
    count = int((target != IGNORE).sum())
    want_loss = F.cross_entropy(full, target, ignore_index=IGNORE)
    (want_grad,) = torch.autograd.grad(want_loss, full)
    start, end = tpx.shard_range(vocab)
    base = full.detach()[:, start:end].clone()
    want = {"loss": want_loss.detach(), "grad shard x tokens": want_grad[:, start:end] * count}
    del full, want_grad
    shared = base.clone().requires_grad_()
    mesh = init_device_mesh("cpu", (world,))

    def backward(loss, x):
        (g,) = torch.autograd.grad(loss, x)
        return loss, g

    def tpx_step(x, inplace=False):
        return backward(tpx.vocab_parallel_cross_entropy(
            x, target, ignore_index=IGNORE, inplace_backward=inplace, vocab_size=vocab), x)

    def gather_step(x):
        return backward(F.cross_entropy(_GatherColumns.apply(x, start, world), target,
                                        ignore_index=IGNORE), x)

    def loss_parallel_step(x):
        with loss_parallel():  # the backward must run inside the context too
            loss = F.cross_entropy(DTensor.from_local(x, mesh, [Shard(1)]), target,
                                   ignore_index=IGNORE)
            return backward(loss, x)

    def fresh():
        return base.clone().requires_grad_()

    variants = {"tpx": (lambda: shared, tpx_step),
                "tpx inplace_backward": (fresh, lambda x: tpx_step(x, inplace=True)),
                "gather + F.cross_entropy": (lambda: shared, gather_step),
                "loss_parallel (DTensor)": (lambda: shared, loss_parallel_step)}
    for label, (prepare, step) in variants.items():
        loss, grad = step(prepare())
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        check(label, {"loss": loss, "grad shard x tokens": grad * count}, want, TOL_CE, True)
    del want
    results = measure(variants, args.repeats or REPEATS["ce"], args.warmup, torch.device("cpu"),
                      distributed=True)
    add_ratios(results, "loss_parallel (DTensor)", "loss_parallel")
    return results


# --- section 2: LM head + loss, fused vs unfused -------------------------------------------

def bench_lce(cfg: dict, args, world: int) -> list:
    import tpx
    from tpx.nn.functional import default_chunk_size

    n, d, vocab = cfg["tokens"], cfg["d"], cfg["vocab"]
    torch.manual_seed(SEED + 1)
    hidden = torch.randn(n, d, requires_grad=True)
    full_w = (torch.randn(vocab, d) / d ** 0.5).requires_grad_()
    target = make_target(n, vocab, "cpu")
    count = int((target != IGNORE).sum())
    ref_loss = F.cross_entropy(hidden @ full_w.T, target, ignore_index=IGNORE)
    g_hidden, g_w = torch.autograd.grad(ref_loss, (hidden, full_w))
    start, end = tpx.shard_range(vocab)
    weight = full_w.detach()[start:end].clone().requires_grad_()
    want = {"loss": ref_loss.detach(), "hidden grad x tokens": g_hidden * count,
            "weight grad shard x tokens": g_w[start:end] * count}
    del full_w, g_hidden, g_w

    def unfused(state, inplace=False):
        h, w = state
        loss = tpx.vocab_parallel_cross_entropy(h @ w.T, target, ignore_index=IGNORE,
                                                inplace_backward=inplace, vocab_size=vocab)
        gh, gw = torch.autograd.grad(loss, (h, w))
        dist.all_reduce(gh)  # the LM head's input gradient is the sum over vocabulary shards
        return loss, gh, gw

    def fused(state, chunk=None):
        h, w = state
        loss = tpx.linear_cross_entropy(h, w, target, chunk_size=chunk, ignore_index=IGNORE,
                                        vocab_size=vocab)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    default_chunk = default_chunk_size(vocab, world)
    variants = {"unfused": (lambda: (hidden, weight), unfused),
                "unfused inplace_backward":
                    (lambda: (hidden, weight), lambda s: unfused(s, inplace=True)),
                f"fused chunk_size=default ({default_chunk})": (lambda: (hidden, weight), fused),
                f"fused chunk_size={cfg['chunk']}":
                    (lambda: (hidden, weight), lambda s: fused(s, cfg["chunk"]))}
    for label, (prepare, step) in variants.items():
        loss, gh, gw = step(prepare())
        check(label, {"loss": loss, "hidden grad x tokens": gh * count,
                      "weight grad shard x tokens": gw * count}, want, TOL_LCE, True)
    del want
    results = measure(variants, args.repeats or REPEATS["lce"], args.warmup, torch.device("cpu"),
                      distributed=True)
    add_ratios(results, "unfused", "unfused")
    return results


# --- section 3: one GPU ---------------------------------------------------------------------

def bench_gpu(cfg: dict, args) -> list:
    import tpx

    device = torch.device("cuda", torch.cuda.current_device())
    n, v = cfg["gpu_tokens"], cfg["gpu_vocab"]
    torch.manual_seed(SEED)
    base = torch.randn(n, v, device=device, dtype=torch.bfloat16)
    target = make_target(n, v, device)
    count = int((target != IGNORE).sum())
    ref = base.float().requires_grad_()
    want_loss = F.cross_entropy(ref, target, ignore_index=IGNORE)
    want = {"loss": want_loss.detach(), "grad x tokens": torch.autograd.grad(want_loss, ref)[0]
            * count}
    del ref, want_loss
    shared = base.clone().requires_grad_()

    def loss_of(label, x):
        if label == "torch F.cross_entropy":
            return F.cross_entropy(x, target, ignore_index=IGNORE)
        return tpx.vocab_parallel_cross_entropy(x, target, ignore_index=IGNORE, vocab_size=v,
                                                inplace_backward="inplace" in label)

    def fwd_bwd(label):
        return lambda x: torch.autograd.grad(loss_of(label, x), x)

    labels = ["tpx", "tpx inplace_backward", "torch F.cross_entropy"]
    prepare = {k: (lambda: base.clone().requires_grad_()) if "inplace" in k else (lambda: shared)
               for k in labels}
    for k in labels:  # bf16 logits: bf16 tolerances
        x = prepare[k]()
        loss = loss_of(k, x)
        got = {"loss": loss, "grad x tokens": torch.autograd.grad(loss, x)[0].float() * count}
        check(k, got, want, dict(rtol=2e-2, atol=2e-2), False)
    del want, x, loss, got
    repeats = args.repeats or REPEATS["gpu"]
    results = measure({k: (prepare[k], fwd_bwd(k)) for k in labels}, repeats, args.warmup,
                      device, distributed=False)
    fwd = measure({k: (lambda: shared, lambda x, k=k: loss_of(k, x)) for k in labels[::2]},
                  repeats, args.warmup, device, distributed=False)
    for r in results:
        f = next((x for x in fwd if x["variant"] == r["variant"]), None)
        if f is not None:
            r.update(fwd_times_ms=f["times_ms"], fwd_median_ms=f["median_ms"],
                     fwd_gbps=n * v * base.element_size() / (f["median_ms"] * 1e6))
    add_ratios(results, "torch F.cross_entropy", "torch")
    return results


# --- reporting --------------------------------------------------------------------------------



def print_section(title: str, results: list, key: str, name: str, extra=()) -> None:
    fmt = lambda v, p=2: "n/a" if v is None else f"{v:.{p}f}"  # noqa: E731
    rows = [[r["variant"], fmt(r["median_ms"]), fmt(r["min_ms"]), fmt(r["extra_peak_mib"], 1),
             fmt(r[f"time_vs_{key}"]), fmt(r[f"peak_vs_{key}"], 3)]
            + [fmt(r.get(k), p) for k, _, p in extra] for r in results]
    print(f"\n{title}")
    print(format_table(["variant", "median ms", "min ms", "extra peak MiB", f"time vs {name}",
                        f"peak vs {name}"] + [h for _, h, _ in extra], rows))




def write_results(args, world: int, cfg: dict, env: dict, sections: dict) -> None:
    path = Path(args.out or RESULTS_DIR / f"bench_loss_{args.device}_tp{world}.json")
    payload = dict(benchmark="bench_loss: vocab-parallel cross-entropy and fused LM head + loss",
                   config=dict(vars(args), sizes=cfg, seed=SEED, ignore_index=IGNORE,
                               tolerance=dict(ce=TOL_CE, lce=TOL_LCE)),
                   environment=env, results=sections)
    print(f"\nwrote {write_json(path, payload)}")


# --- entry points -----------------------------------------------------------------------------

def run_cpu(rank: int, world: int, args, init_method: str, local_rank: int) -> None:
    exact = exact_rss_allocator()
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cpus) >= world:  # one core per rank, gloo threads included
        os.sched_setaffinity(0, {cpus[local_rank]})
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        cfg = QUICK if args.quick else FULL
        env = environment(torch.device("cpu"), world, "gloo") if rank == 0 else None
        if rank == 0:
            print_env(env)
            env["malloc_mmap_threshold_fixed_1MiB"] = exact
        say = print if rank == 0 else (lambda *a, **k: None)
        say(f"running cross-entropy N={cfg['tokens']} V={cfg['vocab']} ...", flush=True)
        ce = bench_ce(cfg, args, world)
        say(f"running LM head + loss N={cfg['tokens']} d={cfg['d']} V={cfg['vocab']} ...",
            flush=True)
        lce = bench_lce(cfg, args, world)
        if rank == 0:
            print_section(f"cross-entropy fwd+bwd, N={cfg['tokens']} V={cfg['vocab']} fp32, "
                          f"TP={world} (gloo); each rank holds [N, V/{world}]; inplace: a fresh "
                          "copy of the logits per step, made untimed",
                          ce, "loss_parallel", "loss_parallel")
            tpx_ratio = ce[0]["time_vs_loss_parallel"]
            print(f"target tpx time <= 0.5x loss_parallel: {tpx_ratio:.2f}x -> "
                  f"{'met' if tpx_ratio <= 0.5 else 'NOT met'}")
            print_section(f"LM head + loss fwd+bwd, N={cfg['tokens']} d={cfg['d']} "
                          f"V={cfg['vocab']} fp32, TP={world}; weight shard [V/{world}, d]",
                          lce, "unfused", "unfused")
            worst = max(r["peak_vs_unfused"] or 0.0 for r in lce if r["variant"].startswith("f"))
            print(f"target fused/unfused extra peak <= 1/8 = 0.125: worst fused {worst:.3f} -> "
                  f"{'met' if worst <= 0.125 else 'NOT met'}")
            write_results(args, world, cfg, env, dict(cross_entropy=ce, lm_head_loss=lce))
    finally:
        dist.destroy_process_group()


def run_gpu(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    tmpdir = tempfile.mkdtemp(prefix="bench_loss_")
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmpdir, 'store')}",
                            rank=0, world_size=1)
    try:
        cfg = QUICK if args.quick else FULL
        env = environment(torch.device("cuda", torch.cuda.current_device()), 1, "nccl")
        print_env(env)
        results = bench_gpu(cfg, args)
        print_section(f"cross-entropy fwd+bwd, one GPU, one shard N={cfg['gpu_tokens']} "
                      f"V_local={cfg['gpu_vocab']} bf16; CUDA events", results, "torch",
                      "torch", extra=[("fwd_median_ms", "fwd ms", 3), ("fwd_gbps", "fwd GB/s", 0)])
        write_results(args, 1, cfg, env, dict(cross_entropy_gpu=results))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _spawned(rank: int, world: int, args, init_method: str) -> None:
    run_cpu(rank, world, args, init_method, local_rank=rank)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, default=2,
                   help="CPU ranks to spawn (ignored under torchrun; default 2)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed samples per variant (default: CE 10, LM head 3, GPU 20)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: N=512, V=2000, d=64, 2 repeats")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin each CPU rank to its own core (pinned by default)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = args.repeats or 2
    args.warmup = 1 if args.warmup is None else args.warmup
    if args.world_size < 1 or (args.repeats is not None and args.repeats < 1):
        p.error("--world-size and --repeats must be >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda":
        return run_gpu(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        return run_cpu(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://",
                       local_rank=int(os.environ.get("LOCAL_RANK", 0)))
    spawn_ranks(_spawned, args.world_size, args, "bench_loss")


if __name__ == "__main__":
    main()
