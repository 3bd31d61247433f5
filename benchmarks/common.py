"""Helpers shared by the benchmark scripts: the environment record, plain-text tables,
spawning one process per rank, the timed training step and the JSON results."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def environment(device: torch.device, world: int, backend: str) -> dict:
    """What the numbers were measured on (stored in every JSON result)."""
    env = dict(torch=torch.__version__, python=platform.python_version(),
               platform=platform.platform(), cpu_count=os.cpu_count(),
               # The cores this (rank) process may run on: 1 when each rank is pinned.
               cpus_per_rank=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count(),
               cpu_capability=torch.backends.cpu.get_cpu_capability(),
               threads_per_rank=torch.get_num_threads(),
               interop_threads=torch.get_num_interop_threads(),
               world_size=world, backend=backend, device=device.type)
    env.update(gloo_loop_policy=os.environ.get("TPX_GLOO_LOOP_POLICY") or "batch")
    try:
        import tpx
        env.update(tpx=tpx.__version__, tpx_build=tpx.build_info())
    except ImportError:
        pass
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return env


def gloo_loop_threads() -> dict:
    """{thread id: scheduling policy} of this process's gloo event-loop threads (Linux)."""
    policies = {}
    task = "/proc/self/task"
    for tid in (os.listdir(task) if os.path.isdir(task) else []):
        try:
            with open(f"{task}/{tid}/comm") as f:
                if f.read().strip() != "gloo_tcp_loop":
                    continue
            policies[int(tid)] = os.sched_getscheduler(int(tid))
        except (FileNotFoundError, ProcessLookupError):  # the thread has exited
            continue
    return policies


def set_gloo_loop_policy(policy: int) -> None:
    """Puts every gloo event-loop thread of this process on ``policy`` (``os.SCHED_OTHER``:
    as gloo starts them; ``os.SCHED_BATCH``: as tpx sets them), to time both in one run."""
    for tid, current in gloo_loop_threads().items():
        if current != policy:
            os.sched_setscheduler(tid, policy, os.sched_param(0))


def print_env(env: dict) -> None:
    print("environment: " + ", ".join(f"{k}={env[k]}" for k in (
        "torch", "tpx", "device", "backend", "world_size", "threads_per_rank", "cpu_count",
        "cpus_per_rank", "cpu_capability", "gpu") if k in env))


def format_table(headers: list, rows: list, text_columns: int = 1) -> str:
    """An aligned table: the first ``text_columns`` columns left-aligned, numbers right."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: list) -> str:
        return "  ".join(str(c).ljust(w) if i < text_columns else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def spawn_ranks(fn, world: int, args, name: str) -> None:
    """Runs ``fn(rank, world, args, init_method)`` in ``world`` spawned processes that meet
    through a file store; a rank's exception ends the benchmark with its message."""
    tmpdir = tempfile.mkdtemp(prefix=f"{name}_")
    try:
        init_method = f"file://{os.path.join(tmpdir, 'store')}"
        mp.spawn(fn, args=(world, args, init_method), nprocs=world)
    except mp.ProcessRaisedException as e:
        raise SystemExit(f"{name} aborted: {e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def step(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """One timed unit of work: zero_grad, forward, backward of ``(y * g).sum()``."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    y = model(x)
    (y * g).sum().backward()
    return y


# Options that say where results go, not what was measured: not recorded in the JSON (they
# would carry the path of the machine that ran the benchmark).
OUTPUT_OPTIONS = ("out", "plot", "partial")


def write_json(path, payload: dict) -> Path:
    """Writes ``payload`` as indented JSON to ``path`` (parents created), without the output
    options in ``payload["config"]``; returns the path."""
    path = Path(path)
    config = payload.get("config")
    if isinstance(config, dict):
        payload = dict(payload, config={k: v for k, v in config.items() if k not in OUTPUT_OPTIONS})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_jsonl(path) -> list:
    """The complete records of a JSON-lines file (``[]`` while it does not exist). Another
    process may be appending: a last line without its newline is still being written and is
    left for the next read."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        text = f.read()
    return [json.loads(x) for x in text[:text.rfind("\n") + 1].splitlines() if x.strip()]


def append_jsonl(path, record: dict) -> None:
    """Appends ``record`` as one line, in one ``write`` of an ``O_APPEND`` descriptor (a
    buffered file may split a long line into several writes)."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def status_of_error(e: BaseException) -> str:
    """``refused``: tpx declined with an error that says so (a ``ValueError`` / ``TypeError`` /
    ``NotImplementedError`` whose message starts with ``tpx``); ``crash``: anything else."""
    text = str(e).strip()
    if isinstance(e, (ValueError, TypeError, NotImplementedError)) and text.startswith("tpx"):
        return "refused"
    return "crash"


def run_case_group(target, world: int, args, timeout: float, prefix: str):
    """Starts ``world`` spawned processes ``target(rank, world, *args, init, out_dir)`` that
    write one JSON line per finished case to ``out_dir/rank{r}.jsonl``; waits while they run,
    and kills them when no rank has finished a case for ``timeout`` seconds (a hang or a dead
    rank). Returns ``(the records of each rank, the processes' exit codes)``."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix=prefix)
    init = f"file://{tmp}/store"
    procs = [ctx.Process(target=target, args=(r, world, *args, init, tmp))
             for r in range(world)]
    for p in procs:
        p.start()
    paths = [os.path.join(tmp, f"rank{r}.jsonl") for r in range(world)]
    seen, last = 0, time.monotonic()
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        n = sum(len(read_jsonl(p)) for p in paths)
        if n > seen:
            seen, last = n, time.monotonic()
        elif time.monotonic() - last > timeout:
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    records = [read_jsonl(p) for p in paths]
    shutil.rmtree(tmp, ignore_errors=True)
    return records, [p.exitcode for p in procs]
