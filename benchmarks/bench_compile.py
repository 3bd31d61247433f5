"""A compiled training step against an eager one: tpx and PyTorch's DTensor TP, at TP 2 over
gloo on the CPU, ``torch.compile`` in its default mode and with ``fullgraph=True``.

The model is a small Hugging Face Llama (bench_host.py's: vocabulary 1003, hidden 64, MLP 88,
2 layers, 8 query / 2 key-value heads; ``--hidden`` / ``--layers`` / ``--seq`` make it
larger); one training step is the forward with labels, ``loss.backward()``, an SGD step and
``zero_grad`` on 2 x ``--seq`` tokens. Variants:

* ``tpx eager``, ``tpx compiled``, ``tpx fullgraph``: ``tpx.parallelize_module(model, None,
  tpx.plans.auto(model))``, then ``torch.compile(model)`` (default mode) or
  ``torch.compile(model, fullgraph=True)``;
* ``PyTorch TP eager``, ``PyTorch TP compiled``, ``PyTorch TP fullgraph``:
  ``torch.distributed.tensor.parallel.parallelize_module`` with transformers'
  ``base_model_tp_plan`` in torch's styles (bench_host.py's ``torch_tp_llama_plan``).

Correctness first: every variant trains ``--check`` steps from the same seed beside the
unsharded model, and each step's loss must equal the unsharded one's (rtol 1e-4); a variant
that fails to compile is reported with its error, not timed. Compilation happens in the
untimed warm-up; what dynamo did is recorded per variant (graphs compiled, graph breaks and
their reasons, recompilations). Timing: ``--rounds`` rounds, in each every variant makes
``--iters`` steps back to back (the order rotated from round to round, the ranks starting each
block together); the wall time of each step is taken on its own. The table shows the median
per step on rank 0 (and the maximum of the ranks' medians), its ratio to the same library's
eager step and, for tpx, to PyTorch TP's step in the same mode.

    python benchmarks/bench_compile.py [--rounds 20] [--iters 5]

prints the table and writes ``benchmarks/results/bench_compile_cpu_tp2.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host import LLAMA_CONFIG, torch_tp_llama_plan  # noqa: E402
from common import environment, format_table, print_env, spawn_ranks, write_json  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEED = 1234
MODES = ("eager", "compiled", "fullgraph")
LIBS = ("tpx", "PyTorch TP")


def _model(args):
    import transformers

    torch.manual_seed(SEED)
    cfg = dict(LLAMA_CONFIG, hidden_size=args.hidden, num_hidden_layers=args.layers,
               intermediate_size=int(args.hidden * 88 / 64))
    return transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**cfg)).float()


def _sharded(ref, lib: str, world: int):
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp

    model = copy.deepcopy(ref)
    if lib == "tpx":
        return tpx.parallelize_module(model, None, tpx.plans.auto(model))
    return torch_tp.parallelize_module(model, init_device_mesh("cpu", (world,)),
                                       torch_tp_llama_plan(model))


def _compiled(model, mode: str):
    if mode == "eager":
        return model
    return torch.compile(model, fullgraph=mode == "fullgraph")


class _Variant:
    """One library in one mode: its model (compiled or not), its optimizer, its steps."""

    def __init__(self, ref, lib: str, mode: str, world: int, ids, lr: float) -> None:
        self.lib, self.mode, self.ids = lib, mode, ids
        self.module = _sharded(ref, lib, world)
        self.model = _compiled(self.module, mode)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=lr)
        self.error = None
        self.dynamo = {}

    @property
    def label(self) -> str:
        return f"{self.lib} {self.mode}"

    def step(self) -> float:
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed(self, k: int) -> list:
        out = []
        for _ in range(k):
            start = time.perf_counter()
            self.step()
            out.append((time.perf_counter() - start) * 1e3)
        return out


def _dynamo_record() -> dict:
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"graph_breaks": int(sum(breaks.values())),
            "break_reasons": {k[:200]: v for k, v in list(breaks.items())[:8]},
            "stats": {k: int(v) for k, v in counters["stats"].items()}}


def _check(variants, ref, args) -> None:
    """Each variant's first ``--check`` losses against the unsharded model's (every rank)."""
    import torch._dynamo

    # every compiled variant is the same forward on another module: room for all of them
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ref = copy.deepcopy(ref)
    ids = variants[0].ids
    opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    want = []
    for _ in range(args.check):
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want.append(loss.item())
    for v in variants:
        torch._dynamo.utils.counters.clear()
        try:
            got = [v.step() for _ in range(args.check)]
            for i, (g, w) in enumerate(zip(got, want)):
                if abs(g - w) > 1e-4 * max(1.0, abs(w)):
                    raise AssertionError(f"step {i}: loss {g} vs one device's {w}")
            for _ in range(args.warmup):
                v.step()
        except Exception as e:  # noqa: BLE001 - reported, not timed
            v.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        v.dynamo = _dynamo_record() if v.mode != "eager" else {}
        failed = torch.tensor([v.error is not None], dtype=torch.int32)
        dist.all_reduce(failed)  # a variant that failed on any rank is timed on none
        if failed.item() and v.error is None:
            v.error = "failed on another rank"


def rank_main(rank: int, world: int, args, init_method) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    ref = _model(args)
    ids = torch.randint(0, LLAMA_CONFIG["vocab_size"], (2, args.seq),
                        generator=torch.Generator().manual_seed(SEED))
    variants = [_Variant(ref, lib, mode, world, ids, args.lr) for lib in LIBS for mode in MODES]
    _check(variants, ref, args)
    live = [v for v in variants if v.error is None]
    samples = {v.label: [] for v in live}
    for r in range(args.rounds):
        order = live[r % len(live):] + live[:r % len(live)]
        for v in order:
            dist.barrier()
            samples[v.label] += v.timed(args.iters)
    medians = torch.tensor([statistics.median(samples[v.label]) for v in live],
                           dtype=torch.float64)
    gathered = [torch.empty_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    per_rank = torch.stack(gathered)
    if rank == 0:
        _report(args, world, variants, live, per_rank, samples)
    dist.barrier()
    dist.destroy_process_group()


def _report(args, world, variants, live, per_rank, samples) -> None:
    med = {v.label: per_rank[0, i].item() for i, v in enumerate(live)}
    rows = []
    for v in variants:
        row = dict(variant=v.label, library=v.lib, mode=v.mode, error=v.error, dynamo=v.dynamo)
        if v.error is None:
            i = live.index(v)
            eager = med.get(f"{v.lib} eager")
            other = med.get(f"{'PyTorch TP' if v.lib == 'tpx' else 'tpx'} {v.mode}")
            row.update(steps=len(samples[v.label]), ms_median=med[v.label],
                       ms_median_max_over_ranks=per_rank[:, i].max().item(),
                       ms_median_per_rank=per_rank[:, i].tolist(),
                       ratio_to_eager=med[v.label] / eager if eager else None,
                       ratio_tpx_to_torch_tp=(med[v.label] / other
                                              if v.lib == "tpx" and other else None))
        rows.append(row)
    env = environment(torch.device("cpu"), world, "gloo")
    print_env(env)

    def cell(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    table = [[r["variant"], cell(r.get("ms_median")), cell(r.get("ms_median_max_over_ranks")),
              cell(r.get("ratio_to_eager")), cell(r.get("ratio_tpx_to_torch_tp")),
              str(r["dynamo"].get("stats", {}).get("unique_graphs", "-")),
              str(r["dynamo"].get("graph_breaks", "-")),
              (r["error"] or "")[:60]] for r in rows]
    print("\ntraining step, wall time per step, median (ms)")
    print(format_table(["variant", "ms r0", "ms max", "x eager", "tpx x torch", "graphs",
                        "breaks", "error"], table, text_columns=1))
    config = dict(vars(args), world=world, llama=dict(LLAMA_CONFIG, hidden_size=args.hidden,
                                                      num_hidden_layers=args.layers))
    path = write_json(args.out, dict(benchmark="bench_compile", env=env, config=config,
                                     results=rows))
    print(f"\nwrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--iters", type=int, default=5, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the check")
    p.add_argument("--check", type=int, default=3, help="steps compared with one device")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR / "bench_compile_cpu_tp2.json"))
    args = p.parse_args()
    spawn_ranks(rank_main, args.world, args, "bench_compile")


if __name__ == "__main__":
    main()
