"""Bytes on the wire per rank for one training step: tpx against PyTorch's tensor parallelism on
the same model and plan.

The model is PyTorch's own test Transformer (``common_dtensor.Transformer``: dim 256, 8 heads,
2 layers, batch 8 x 128 tokens, float32) with its own plan (``Transformer.parallelize``), once
through ``torch.distributed.tensor.parallel`` and once with the plan's names swapped for tpx's.
One step is forward, backward of ``output.sum()`` and Adam. Both are checked against the
unsharded model first (output and every gradient).

Bytes are what each rank sends on a ring: an all-gather sends (P-1) x its input, a
reduce-scatter (P-1)/P x its input (= (P-1) x its output), an all-reduce 2 (P-1)/P x the
buffer, a broadcast or a reduce to one rank its buffer once. tpx's collectives are taken from
``tpx.comm_stats()``; PyTorch's from the collectives it runs (a dispatch mode records every
``_c10d_functional`` / ``c10d`` collective with its buffer), not from a formula.

    python benchmarks/bench_bytes.py                # TP 2 and 4: a table, results/bench_bytes.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import format_table, spawn_ranks, write_json  # noqa: E402

MIB = 1024 * 1024


def ring_bytes(kind: str, message: int, world: int) -> float:
    """Bytes one rank sends for a collective whose message (as tpx counts it: an all-gather's
    input, a reduce-scatter's output, the buffer otherwise) is ``message`` bytes."""
    if kind == "all_gather":
        return (world - 1) * message
    if kind == "reduce_scatter":
        return (world - 1) * message
    if kind == "all_reduce":
        return 2 * (world - 1) / world * message
    return message  # broadcast, reduce


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
            self.calls.append((kind, nbytes))
        return out


def _model(args):
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


def _step(model, opt, inp):
    out = model(inp)
    out.sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run(rank: int, world: int, args, init_method: str) -> None:
    import tpx
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    rows = []
    gen = torch.Generator().manual_seed(1)
    inp = torch.randint(args.vocab, (args.batch, args.seq), generator=gen)
    for sp in (False, True):
        cd, ref = _model(args)
        want = ref(inp)
        want.sum().backward()
        per_lib = {}
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
            # Correctness first: the output and the gradients of the head and the embedding.
            out = _full(model(inp))
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
            out.sum().backward()
            for name in ("norm.weight", "tok_embeddings.weight"):
                got = _full(dict(model.named_parameters())[name].grad)
                exp = dict(ref.named_parameters())[name].grad
                if got.shape != exp.shape:  # a tpx shard: compare this rank's rows
                    lo, hi = tpx.shard_range(exp.shape[0])
                    exp = exp[lo:hi]
                torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4, msg=name)
            model.zero_grad(set_to_none=True)
            if lib == "tpx":
                with tpx.comm_stats() as stats:
                    _step(model, opt, inp)
                calls = []
                for (group, kind), (n, nbytes) in stats.counts.items():
                    calls.append((kind, nbytes, n))
            else:
                rec = _Recorder(world)
                with rec:
                    _step(model, opt, inp)
                calls = [(k, b, 1) for k, b in rec.calls]
                if rec.unknown:
                    raise RuntimeError(f"collectives this benchmark does not count: {rec.unknown}")
            by_kind = {}
            for kind, nbytes, n in calls:
                by_kind[kind] = by_kind.get(kind, 0.0) + ring_bytes(kind, nbytes, world)
            per_lib[lib] = by_kind
        for lib, by_kind in per_lib.items():
            rows.append(dict(model="common_dtensor.Transformer", tp=world,
                             sequence_parallel=sp, library=lib,
                             wire_bytes=dict(sorted(by_kind.items())),
                             wire_mib={k: round(v / MIB, 3) for k, v in sorted(by_kind.items())},
                             total_mib=round(sum(by_kind.values()) / MIB, 3)))
    if rank == 0:
        path = os.path.join(args.out, f"bench_bytes_tp{world}.json")
        write_json(path, dict(benchmark="bench_bytes: wire bytes per rank, one training step",
                              config={k: v for k, v in vars(args).items() if k != "out"},
                              results=rows))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the JSON")
    args = p.parse_args(argv)
    table = []
    for world in args.tp:
        spawn_ranks(run, world, args, "bench_bytes")
        import json

        with open(os.path.join(args.out, f"bench_bytes_tp{world}.json")) as f:
            table.extend(json.load(f)["results"])
    rows = []
    for r in table:
        w = r["wire_mib"]
        rows.append([r["model"], f"TP {r['tp']}", "SP" if r["sequence_parallel"] else "-",
                     r["library"], f"{w.get('all_gather', 0):.2f}",
                     f"{w.get('reduce_scatter', 0):.2f}", f"{w.get('all_reduce', 0):.2f}",
                     f"{r['total_mib']:.2f}"])
    print(format_table(["model", "tp", "sp", "library", "all-gather MiB", "reduce-scatter MiB",
                        "all-reduce MiB", "total MiB"], rows, text_columns=4))
    return table


if __name__ == "__main__":
    main()
