"""What the other ranks see when one rank of a tpx training run fails, and after how long.

Two ranks train a tensor-parallel MLP (ColumnParallelLinear -> GELU -> RowParallelLinear,
gloo, CPU) step after step; at step 3 rank 1 misbehaves in one of these ways:

  kill            SIGKILL in the middle of the step's forward (a node lost, the OOM killer)
  raise-exit      a tpx op raises on rank 1 only (bad input), and the script ends with it
  fault-exit      a tpx op fails on rank 1 after posting a collective (as an allocation
                  failing mid-op would; tpx._C.testing.arm_fault), and the script ends with it
  raise-continue  as raise-exit, but rank 1 catches the error and goes on with the next batch
                  (a "skip the batch" loop that only one rank runs)
  late            rank 1 arrives 30 s late at the step (a slow disk, a straggler)
  raise-all       every rank raises the same error in the tpx op (the same bad input on every
                  rank), catches it and goes on with the next batch
  save-rank0      after step 3, rank 0 alone saves a checkpoint (`if rank == 0:
                  tpx.checkpoint.save(...)`), a call every rank must make, while rank 1 goes
                  on to step 4; rank 0 catches the error and goes on too

For each, rank 0's outcome: the error it raises (or that it finished), the seconds from the
fault to that error, and whether anything spun meanwhile: the CPU time of rank 0's gloo
event-loop threads and of the process per second of waiting; and how rank 1 itself ended.
The process groups keep their default timeout (30 minutes for gloo) except for
raise-continue, which runs with a 20 s timeout so that a wait for the timeout would still end.

    python benchmarks/faults.py            # all scenarios: a table, and results/faults.json

Correctness first: the first two steps' losses are compared with the unsharded model, and
every step's where the ranks go on after the fault (late, raise-all, save-rank0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("kill", "raise-exit", "fault-exit", "raise-continue", "late", "raise-all",
             "save-rank0")
FAULT_STEP = 3
LATE_SECONDS = 30.0


def _ticks(only_loop: bool) -> int:
    """User + system clock ticks of this process (or of its gloo event-loop threads)."""
    if not only_loop:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total


def _rank(rank: int, scenario: str, init_file: str, out_dir: str) -> None:
    import tpx

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=20) if scenario == "raise-continue" else None
    kwargs = {"timeout": timeout} if timeout else {}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            **kwargs)
    torch.manual_seed(0)
    dim, hidden = 256, 1024
    ref = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(),
                              torch.nn.Linear(hidden, dim))
    model = torch.nn.Sequential(tpx.ColumnParallelLinear.from_linear(ref[0]), torch.nn.GELU(),
                                tpx.RowParallelLinear.from_linear(ref[2]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    fault_file = os.path.join(out_dir, "fault_time")
    result = {"rank": rank, "scenario": scenario}

    def fault_now():
        with open(fault_file, "w") as f:
            f.write(repr(time.time()))

    def misbehave(module, inputs):
        if step != FAULT_STEP or module is not model[2]:
            return None
        if scenario == "raise-all":
            if rank == 1:
                fault_now()
            return (inputs[0][..., :-1],)  # the same bad input on every rank
        if rank != 1:
            return None
        if scenario == "kill":
            fault_now()
            os.kill(os.getpid(), signal.SIGKILL)
        if scenario == "late":
            fault_now()
            time.sleep(LATE_SECONDS)
        if scenario in ("raise-exit", "raise-continue"):
            fault_now()
            return (inputs[0][..., :-1],)  # a bad input: the op raises before its collective
        if scenario == "fault-exit":
            fault_now()
            tpx._C.testing.arm_fault(1)
        return None

    model[2].register_forward_pre_hook(misbehave)
    gen = torch.Generator().manual_seed(1)
    loop0 = cpu0 = t0 = None
    saved = None  # save-rank0: (rank 0's error, seconds to it)
    step = 0
    try:
        for step in range(1, 7):
            x = torch.randn(64, dim, generator=gen)
            if step == FAULT_STEP and rank == 0:
                loop0, cpu0, t0 = _ticks(True), _ticks(False), time.time()
            try:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            except Exception:
                if rank == 1 and scenario == "raise-continue" and step == FAULT_STEP:
                    continue  # skip the batch, on this rank only
                if scenario == "raise-all" and step == FAULT_STEP:
                    continue  # skip the batch, on every rank
                raise
            if scenario == "save-rank0" and step == FAULT_STEP and rank == 0:
                fault_now()
                start = time.time()
                try:
                    tpx.checkpoint.save(model, os.path.join(out_dir, "ckpt"))
                except RuntimeError as e:  # tpx.comm.entry.RanksMissingError
                    saved = (f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}",
                             round(time.time() - start, 2))
            # Before the fault, and after it where the ranks go on: equal to one device.
            if step <= 2 or scenario in ("raise-all", "late", "save-rank0"):
                want = ref(x).pow(2).mean()
                ref_opt.zero_grad()
                want.backward()
                ref_opt.step()
                assert abs(loss.item() - want.item()) < 1e-4 * max(1.0, abs(want.item())), \
                    (step, loss.item(), want.item())
        result["outcome"] = "finished all steps"
        if saved is not None:
            result["outcome"] = f"{saved[0]} (then finished all steps)"
    except Exception as e:  # noqa: BLE001 - the error is what we measure
        result["outcome"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    finally:
        if rank == 0 and loop0 is not None:
            now = time.time()
            fault = float(open(fault_file).read()) if os.path.exists(fault_file) else t0
            waited = max(now - t0, 1e-3)
            result["seconds_after_fault"] = round(now - fault, 2)
            result["loop_thread_cpu_per_s"] = round((_ticks(True) - loop0) / 100 / waited, 3)
            result["process_cpu_per_s"] = round((_ticks(False) - cpu0) / 100 / waited, 3)
            if saved is not None:
                result["seconds_after_fault"] = saved[1]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    os._exit(0 if result["outcome"].endswith("finished all steps") else 1)


def run(scenario: str) -> dict:
    out_dir = tempfile.mkdtemp(prefix="tpx_faults_")
    init_file = os.path.join(out_dir, "store")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, scenario, init_file, out_dir)) for r in (0, 1)]
    start = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
            p.join()
    path = os.path.join(out_dir, "rank0.json")
    row = json.load(open(path)) if os.path.exists(path) else {"outcome": "no report (hung?)"}
    path1 = os.path.join(out_dir, "rank1.json")
    row["rank1_outcome"] = (json.load(open(path1))["outcome"] if os.path.exists(path1)
                            else "no report (killed, or hung)")
    row["scenario"] = scenario
    row["exit_codes"] = [p.exitcode for p in procs]
    row["wall_seconds"] = round(time.time() - start, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--json", default=os.path.join(HERE, "results", "faults.json"))
    args = p.parse_args()
    rows = [run(s) for s in args.scenarios]
    print(f"{'scenario':16} {'rank 0 sees':70} {'after s':>8} {'loop cpu/s':>10} "
          f"{'proc cpu/s':>10}")
    for r in rows:
        print(f"{r['scenario']:16} {r['outcome'][:70]:70} {r.get('seconds_after_fault', '-'):>8} "
              f"{r.get('loop_thread_cpu_per_s', '-'):>10} {r.get('process_cpu_per_s', '-'):>10}")
    print(f"\n{'scenario':16} rank 1 (the rank that misbehaved) ends with")
    for r in rows:
        print(f"{r['scenario']:16} {r['rank1_outcome'][:110]}")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
