"""Benchmark of tpx's all-reduce on the CPU against gloo's own.

On a two-rank gloo group tpx sums a buffer over the group with one exchange (each rank sends
its buffer to the other with ``send``/``recv`` and adds the one it receives) instead of gloo's
all-reduce, which runs a reduce-scatter step and an all-gather step on gloo's worker thread.
``TPX_GLOO_ALLREDUCE=gloo`` switches tpx back to gloo's all-reduce for the groups tpx meets
while it is set; this benchmark gives each variant a group of its own, so both are timed in
one run, round robin, through the same op (``tpx.ops.mesh_all_reduce``, an out-of-place sum
over a group), beside a plain ``torch.distributed.all_reduce`` of a copy of the buffer.

tpx switches the event-loop threads of its own gloo groups to ``SCHED_BATCH`` (docs/benchmarks.md,
"Gloo's event-loop threads"); the benchmark sets every gloo thread of the process the same way
for the variants timed with ``SCHED_BATCH``, and puts them all back as gloo starts them for the
variants marked ``SCHED_OTHER``, in the same rounds.

Each variant is first checked: the result equals the sum of every rank's input (computed
locally from the ranks' seeds) and is the same on every rank. A timed sample is ``--block``
calls after one barrier, each preceded by ``--busy-us`` of busy work on the calling thread (as
a GEMM precedes a collective in a training step; 0 runs the calls back to back); only the
calls are timed, and a sample's time per call is the maximum over ranks. The table gives the
median over samples; the JSON keeps every sample.

Run:
    python benchmarks/bench_collectives.py              # 2 gloo ranks, 1 pinned core each
    python benchmarks/bench_collectives.py --world 3    # any other size: both tpx rows use gloo
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common import environment, format_table, print_env, set_gloo_loop_policy, spawn_ranks, write_json

SIZES_KIB = (4, 256, 8192)
RESULTS_DIR = Path(__file__).resolve().parent / "results"
VARIANTS = {  # label -> (TPX_GLOO_ALLREDUCE, use tpx, policy of gloo's event-loop threads)
    "tpx (exchange)": ("exchange", True, os.SCHED_BATCH),
    "tpx (gloo all-reduce)": ("gloo", True, os.SCHED_BATCH),
    "torch.distributed.all_reduce": ("exchange", False, os.SCHED_BATCH),
    "tpx (exchange), gloo threads SCHED_OTHER": ("exchange", True, os.SCHED_OTHER),
    "torch.distributed.all_reduce, gloo threads SCHED_OTHER": ("exchange", False, os.SCHED_OTHER),
}


def busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def rank_input(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def run(rank: int, world: int, args, init_method: str) -> None:
    import tpx

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) >= world:
        os.sched_setaffinity(0, {cpus[rank]})
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    env = environment(torch.device("cpu"), world, "gloo")
    if rank == 0:
        print_env(env)

    batch_threads = (os.environ.get("TPX_GLOO_LOOP_POLICY") or "batch") == "batch"
    # tpx decides how a group sums when it first meets it (the ranks agree on it), so each
    # tpx variant gets a group of its own, met under its TPX_GLOO_ALLREDUCE.
    groups = {}
    for label, (algorithm, uses_tpx, _) in VARIANTS.items():
        if uses_tpx:
            os.environ["TPX_GLOO_ALLREDUCE"] = algorithm
            groups[label] = dist.new_group(list(range(world))).group_name
            tpx.ops.mesh_all_reduce(torch.zeros(1), groups[label])
    os.environ.pop("TPX_GLOO_ALLREDUCE", None)

    def call(label: str, x: torch.Tensor) -> torch.Tensor:
        if VARIANTS[label][1]:
            return tpx.ops.mesh_all_reduce(x, groups[label])
        y = x.clone()
        dist.all_reduce(y)
        return y

    results = []
    try:
        for kib in args.sizes:
            numel = kib * 1024 // 4
            x = rank_input(rank, numel)
            want = sum(rank_input(r, numel) for r in range(world))
            for label in VARIANTS:  # checked before timing
                got = call(label, x)
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
                everyone = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(everyone, got)
                if not all(torch.equal(e, got) for e in everyone):
                    raise RuntimeError(f"{label}: ranks hold different sums")
            samples = {label: [] for label in VARIANTS}
            for i in range(args.warmup + args.repeats):
                for label in VARIANTS:
                    if batch_threads:
                        set_gloo_loop_policy(VARIANTS[label][2])
                    dist.barrier()
                    elapsed = 0.0
                    for _ in range(args.block):
                        busy(args.busy_us)
                        t0 = time.perf_counter()
                        call(label, x)
                        elapsed += time.perf_counter() - t0
                    t = torch.tensor([elapsed * 1e6 / args.block], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if i >= args.warmup:
                        samples[label].append(t.item())
            base = samples["tpx (gloo all-reduce)"]
            for label, s in samples.items():
                ratios = [a / b for a, b in zip(s, base)]
                results.append(dict(size_kib=kib, variant=label, median_us=statistics.median(s),
                                    min_us=min(s), ratio_vs_gloo=statistics.median(ratios),
                                    samples_us=s))
    finally:
        if batch_threads:
            set_gloo_loop_policy(os.SCHED_BATCH)
    if rank == 0:
        rows = [[f"{r['size_kib']} KiB", r["variant"], f"{r['median_us']:.0f}",
                 f"{r['min_us']:.0f}", f"{r['ratio_vs_gloo']:.2f}"] for r in results]
        print(format_table(["size", "variant", "median us", "min us", "vs gloo all-reduce"],
                           rows, text_columns=2))
        if world != 2:
            print("(the exchange applies to two-rank groups only: both tpx rows use gloo here)")
        path = Path(args.out or RESULTS_DIR / f"bench_collectives_cpu_tp{world}.json")
        write_json(path, dict(benchmark="bench_collectives: sum over a gloo group, CPU",
                              config=vars(args), environment=env, results=results))
        print(f"wrote {path}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_KIB),
                   help="message sizes in KiB (fp32)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=20, help="calls per timed sample")
    p.add_argument("--busy-us", type=float, default=1000.0,
                   help="busy work on the calling thread before each call, in microseconds "
                        "(default 1000; 0: calls back to back)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    args = p.parse_args(argv)
    if args.world < 2:
        p.error("--world must be >= 2")
    spawn_ranks(run, args.world, args, "bench_collectives")


if __name__ == "__main__":
    main()
