"""``python -m tpx.selfcheck``: does tpx work on this machine?

Prints the versions (tpx, torch, CUDA, NCCL), the GPUs and how tpx was built, then checks:

- on a GPU: every CUDA kernel of tpx (``tpx.build_info()["cuda_kernels"]``) against the ATen
  computation (``torch.nn.functional``) on odd shapes in fp32, bf16 and fp16 (max error,
  pass/fail), and its achieved memory bandwidth (GB/s) at one large shape;
- every op of ``tpx.ops`` and every layer of ``tpx.nn`` against the unsharded PyTorch
  computation, forward and all gradients, on fresh random inputs, over the process group:
  world size 1 as a single process, N ranks under ``torchrun --nproc-per-node N`` (NCCL on
  N GPUs; gloo on the CPU when there is no GPU per rank);
- on 2 or more GPUs: the fraction of the communication hidden by the overlapped all-gather +
  GEMM and GEMM + reduce-scatter at one mid-size shape (bf16).

A table goes to stdout (rank 0); ``--json PATH`` also writes the results as JSON. The exit
status is 1 if any check fails on any rank, 0 otherwise.

    python -m tpx.selfcheck                                # one process: world size 1
    torchrun --nproc-per-node 8 -m tpx.selfcheck --json selfcheck.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from typing import List

import torch
import torch.distributed as dist

import tpx

from .cases import NO_GPU, Inputs, Report, layer_checks, op_checks, overlap_checks
from .kernels import kernel_checks


# ---------------------------------------------------------------------------------------------
# The environment, the process group, the table.

def environment(backend: str, device: str, world: int) -> dict:
    info = tpx.build_info()
    env = dict(tpx=tpx.__version__, tpx_path=os.path.dirname(os.path.abspath(tpx.__file__)),
               tpx_build=info, torch=torch.__version__, torch_cuda=torch.version.cuda,
               nccl=None, python=platform.python_version(), platform=platform.platform(),
               backend=backend, device=device, world_size=world, gpus=[])
    if torch.version.cuda is not None and dist.is_nccl_available():
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append(dict(index=i, name=p.name, capability=f"{p.major}.{p.minor}",
                                    memory_gib=round(p.total_memory / 2 ** 30, 1)))
    return env


def _init_group(timeout_s: float):
    """Joins torchrun's group, or creates a world-1 group of this process. Returns
    ``(backend, device, created, note)``."""
    cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=timeout_s)
    note = ""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if cuda and torch.cuda.device_count() >= local_world:
            torch.cuda.set_device(local_rank)
            backend, device = "nccl", f"cuda:{local_rank}"
        else:
            if cuda:
                note = (f"{local_world} ranks on this node but {torch.cuda.device_count()} GPUs: "
                        "running on the CPU over gloo")
            backend, device = "gloo", "cpu"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout)
            return backend, device, True, note
        return dist.get_backend(), device, False, note
    if dist.is_initialized():
        return dist.get_backend(), "cuda" if cuda else "cpu", False, note
    backend, device = ("nccl", "cuda:0") if cuda else ("gloo", "cpu")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)
    return backend, device, True, note


def _merge(all_rows: List[List[dict]]) -> List[dict]:
    """One row per check: the worst status and largest error over the ranks."""
    merged: dict = {}
    for rank, rows in enumerate(all_rows):
        for r in rows:
            key = (r["section"], r["check"], r["device"], r["dtype"])
            m = merged.get(key)
            if m is None:
                m = merged[key] = dict(r, failed_ranks=[])
            else:
                if r["max_err"] is not None:
                    m["max_err"] = max(m["max_err"] or 0.0, r["max_err"])
                if r["status"] == "FAIL" and m["status"] != "FAIL":
                    m["status"], m["note"] = "FAIL", r["note"]
            if r["status"] == "FAIL":
                m["failed_ranks"].append(rank)
    return list(merged.values())


def format_table(rows: List[dict]) -> str:
    headers = ["section", "check", "device", "dtype", "max err", "tolerance", "measured",
               "result"]
    cells = [[r["section"], r["check"], r["device"], r["dtype"],
              "" if r["max_err"] is None else f"{r['max_err']:.2e}", r["tol"], r["measure"],
              r["status"] + (f" on ranks {r['failed_ranks']}" if r.get("failed_ranks") and
                             len(r["failed_ranks"]) < 64 and r["status"] == "FAIL" else "")]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *cells)]

    def line(cs):
        return "  ".join(str(x).ljust(w) for x, w in zip(cs, widths)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])] + [line(cs) for cs in cells]
    for r in rows:
        if r["status"] == "FAIL" and r["note"]:
            out.append(f"FAIL {r['section']} / {r['check']} ({r['dtype']}): {r['note']}")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tpx.selfcheck", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random inputs (default: a fresh one, printed)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for the other ranks (default 300)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    backend, device, created, note = _init_group(args.timeout)
    try:
        code = _run(args, backend, device, note, t0)
        if created:
            tpx.end_run()  # barrier, a pause for gloo's threads, then the groups destroyed
        return code
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run(args, backend: str, device: str, note: str, t0: float) -> int:
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    seed = [args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")]
    dist.broadcast_object_list(seed, src=0)
    seed = seed[0]
    env = environment(backend, device, world)
    notes = [note] if note else []
    rep = Report()
    info = env["tpx_build"]
    dev_kind = "cuda" if device.startswith("cuda") else "cpu"
    inp = Inputs(seed, torch.device(device))

    # The kernels: on every GPU, each rank in a world-1 group of its own.
    kernels_checked = False
    if dev_kind == "cuda":
        mine, _ = dist.new_subgroups(1) if world > 1 else (pg, None)
        if not info["cuda"]:
            notes.append("this tpx was built without its CUDA kernels (CPU-only build): the "
                         "ops run ATen kernels on the GPU; rebuild with TPX_CUDA=1")
            rep.add("CUDA kernel", "(not built)", device, status="skip",
                    note="tpx built without CUDA")
        else:
            kernel_checks(rep, Inputs(seed + 1, torch.device(device)), mine, device,
                          list(info["cuda_kernels"]))
            kernels_checked = True
    else:
        notes.append(NO_GPU)

    op_checks(rep, inp, pg, dev_kind)
    layer_checks(rep, inp, pg, dev_kind)
    if dev_kind == "cuda" and world > 1 and backend == "nccl":
        overlap_checks(rep, pg, dev_kind)
    else:
        why = "needs 2 or more GPUs under torchrun (NCCL)"
        notes.append(f"communication overlap not measured: {why}")

    gathered: List = [None] * world
    dist.all_gather_object(gathered, rep.rows)
    rows = _merge(gathered)
    ok = all(r["status"] != "FAIL" for r in rows)
    elapsed = time.perf_counter() - t0
    if rank == 0:
        _print_report(env, rows, notes, seed, ok, elapsed, kernels_checked)
        if args.json:
            payload = dict(ok=ok, seed=seed, elapsed_s=round(elapsed, 2), environment=env,
                           cuda_kernels_checked=kernels_checked, notes=notes, checks=rows)
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
                f.write("\n")
            print(f"results written to {args.json}")
    return 0 if ok else 1


def _print_report(env, rows, notes, seed, ok, elapsed, kernels_checked) -> None:
    info = env["tpx_build"]
    gpus = ", ".join(f"{g['index']}: {g['name']} (sm_{g['capability'].replace('.', '')}, "
                     f"{g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
    print(f"tpx {env['tpx']} ({env['tpx_path']})")
    print(f"  built: {'with CUDA kernels' if info['cuda'] else 'CPU-only (no CUDA kernels)'}"
          f" against torch {info['torch_version']}; CUDA kernels: "
          f"{', '.join(info['cuda_kernels']) or 'none'}")
    print(f"torch {env['torch']}  CUDA {env['torch_cuda'] or 'none (CPU build of torch)'}  "
          f"NCCL {env['nccl'] or 'none'}  Python {env['python']}  {env['platform']}")
    print(f"GPUs: {gpus}")
    print(f"process group: {env['backend']}, world size {env['world_size']}, "
          f"device {env['device']}; inputs seed {seed} (rerun with --seed {seed})")
    print()
    print(format_table(rows))
    print()
    for n in notes:
        print(n)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "skip")}
    checked = ("CUDA kernels, ops and layers" if kernels_checked else "ops and layers")
    print(f"{'OK' if ok else 'MISMATCH'}: {counts['pass']} passed, {counts['FAIL']} failed, "
          f"{counts['skip']} skipped ({checked} checked at world size {env['world_size']}) "
          f"in {elapsed:.1f} s")

