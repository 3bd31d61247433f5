"""Multi-process test harness: runs a function on W ranks of a gloo group (CPU).

- Ranks are started once per world size and reused by the tests that follow (a pool; worlds
  of more than 4 ranks are ended after each test, for memory): each test gets a new default
  group (a new file store), tpx's state reset, the environment of the pytest process, torch
  seeded from the OS and one compute thread, as a freshly started rank would. Starting processes (and importing torch and transformers in each) would
  otherwise be most of the suite's time. ``run_ranks(..., fresh=True)`` (tests that break a
  group or kill a rank on purpose) and ``TPX_TEST_FRESH_RANKS=1`` (every test) start new
  processes instead.
- Ranks, pooled or fresh, are forked from a server process that has imported torch, tpx and
  transformers once (``multiprocessing``'s forkserver: a new interpreter that does nothing but
  import them, so it holds no thread, group or compute pool of a test): a new rank costs a
  fork, not the seconds of imports a new interpreter spends. A new rank takes the environment
  of the pytest process at the time of its start. Only a rank that needs variables set before
  its interpreter starts (``rank_env``: ``PYTHONHASHSEED``) is a new interpreter (``spawn``).
- A rank that raises sends its traceback to the parent, which then kills every rank (the pool
  too: the next test starts new ones) and fails the test with a message that names the rank
  and the function.
- A run that exceeds ``timeout`` seconds kills every rank and fails naming the ranks that
  had not finished; a rank that dies without a word (a crash) is reported with its exit code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("TPX_TEST_TIMEOUT", "240"))

def _init_group(backend, init_file, rank, world_size):
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT))


# What the forkserver imports once, before it forks any rank (a module that is not installed is
# skipped).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "tpx", "transformers",
            "transformers.models.llama.modeling_llama"]


def _context(spawn: bool = False):
    """The multiprocessing context ranks start in (module docstring)."""
    if spawn:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn, rank, world_size, init_file, results, args, backend, env=None):
    import torch
    import torch.distributed as dist

    if env is not None:  # forked from the server: the pytest process's environment now
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    try:
        _init_group(backend, init_file, rank, world_size)
        fn(rank, world_size, *args)
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        # The result reaches the parent before the group is destroyed: torch < 2.8 destroys a
        # gloo group holding the GIL, which can deadlock with a gloo thread that frees the
        # last tensors of an asynchronous op (the parent kills such a rank once all reported).
        results.close()
        results.join_thread()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _fresh_state(env, tpx_random_states):
    """A pool rank's state set back to a freshly started rank's before the next test."""
    import random

    import torch

    import tpx

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    torch.seed()  # from the OS, as a new process seeds itself
    random.seed()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    tpx.random.set_states(tpx_random_states)  # unseeded


def _end_test():
    """What a test leaves of the distributed state, ended as a script ends its run:
    ``tpx.end_run`` (tpx's references to groups dropped, every group destroyed). The rank goes
    on running (it waits for the next test, without the GIL), so on torch 2.8 or later it needs
    no pause before the groups are destroyed; before 2.8 it does (pytorch/pytorch#154976)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        import tpx

        new_torch = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
        tpx.end_run(pause=0 if new_torch else None)


def _pool_worker(rank, world_size, backend, tasks, results):
    import tpx

    tpx_random_states = tpx.random.get_states()
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args, init_file, env = task
        try:
            _fresh_state(env, tpx_random_states)
            if init_file is not None:  # None: a script that makes its own group (run_script)
                _init_group(backend, init_file, rank, world_size)
            fn(rank, world_size, *args)
            _end_test()
            results.put((rank, None))
        except BaseException:  # noqa: BLE001 - reported; the parent ends this pool
            results.put((rank, traceback.format_exc()))
            return


class _Pool:
    """``world_size`` ranks waiting for tests (module docstring)."""

    def __init__(self, world_size: int, backend: str):
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world_size, backend, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        _kill(self.procs)


_POOLS: dict = {}
# At most one pool of more ranks than this is kept alive (the last one used): a rank holds
# about 0.4 GB once torch and transformers are imported, and the suite's world sizes up to 9
# kept alive together would hold 45 of them; this way at most 19.
_KEEP_WORLD_MAX = 4


def _pool(world_size: int, backend: str) -> _Pool:
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        if world_size > _KEEP_WORLD_MAX:
            for other in [k for k in _POOLS if k[0] > _KEEP_WORLD_MAX and k != key]:
                _POOLS.pop(other).kill()
        pool = _POOLS[key] = _Pool(world_size, backend)
    return pool


@contextlib.contextmanager
def private_compile_cache():
    """A ``torch.compile`` cache of the test's own (``TORCHINDUCTOR_CACHE_DIR``), removed at the
    end: a cache left by an older build of the ops would be stale. Usable as a decorator of a
    rank's function. Inductor's in-memory caches are cleared on entry and exit (torch 2.5's
    remember files of the directory of an earlier test, removed since, in a pooled rank)."""
    from torch._inductor import utils as inductor_utils

    clear = (getattr(inductor_utils, "clear_caches", None)  # (clear_inductor_caches in 2.5)
             or getattr(inductor_utils, "clear_inductor_caches", None))
    path = tempfile.mkdtemp(prefix="tpx_inductor_")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    if clear is not None:
        clear()
    try:
        yield path
    finally:
        if clear is not None:
            clear()
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
        shutil.rmtree(path, ignore_errors=True)


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT,
              backend: str = "gloo", crashes: tuple = (), rank_env=None,
              fresh: bool = False) -> None:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks; raises ``AssertionError``
    naming the failing rank (or ``TimeoutError`` naming the stuck ones).

    ``crashes``: ranks that must die with a non-zero exit code (a process abort the test
    expects) instead of finishing; every other rank must still finish without error.
    ``rank_env(rank) -> dict``: environment variables of that rank's process, set before its
    interpreter starts (``PYTHONHASHSEED``, as separate launches give each process its own).
    ``fresh``: new processes for this test rather than the pool's (implied by ``crashes``
    and ``rank_env``)."""
    fd, init_file = tempfile.mkstemp(prefix="tpx_pg_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    try:
        if fresh or crashes or rank_env is not None or \
                os.environ.get("TPX_TEST_FRESH_RANKS", "0") == "1":
            _run_fresh(fn, world_size, args, init_file, timeout, backend, crashes, rank_env)
        else:
            _run_pooled(fn, world_size, args, init_file, timeout, backend)
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def run_script(path: str, nproc: int, *, cwd: str, paths=(), timeout: float = DEFAULT_TIMEOUT):
    """Runs the Python script ``path`` as ``__main__`` on ``nproc`` pooled ranks, as
    ``torchrun --nproc-per-node nproc path`` would (``nproc > 1``: ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so that the
    script's ``dist.init_process_group("gloo")`` makes its group) or ``python path`` would
    (``nproc == 1``: none set): working directory ``cwd``, ``sys.argv == [path]``, the script's
    directory and ``paths`` first on ``sys.path``. The script makes its own group; whatever it
    leaves is ended as after every test. An exception (a ``SystemExit`` other than 0 included)
    fails the test naming the rank. With ``TPX_TEST_FRESH_RANKS=1`` the script runs under
    ``torchrun`` (or ``python``) in new processes instead."""
    if os.environ.get("TPX_TEST_FRESH_RANKS", "0") == "1":
        import subprocess
        import sys

        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            list(paths) + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, path]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                   str(nproc), "--master-port", str(free_port()), path]
        try:
            proc = run_command(cmd, cwd=cwd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{path}: did not finish within {timeout:.0f} s\n"
                                 f"{e.stdout}\n{e.stderr}") from None
        assert proc.returncode == 0, (f"{path} failed (exit {proc.returncode}):\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return
    port = free_port() if nproc > 1 else None
    _run_pooled(_script_rank, nproc, (path, cwd, tuple(paths), port), None, timeout, "gloo")


def _script_rank(rank, world_size, path, cwd, paths, port):
    import runpy
    import sys

    if port is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    saved = os.getcwd(), list(sys.argv), list(sys.path)
    os.chdir(cwd)
    sys.argv = [path]
    sys.path[:0] = [os.path.dirname(os.path.abspath(path))] + list(paths)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        os.chdir(saved[0])
        sys.argv[:] = saved[1]
        sys.path[:] = saved[2]


def free_port() -> int:
    """A TCP port free on this host now (for a launcher's ``MASTER_PORT``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pooled(fn, world_size, args, init_file, timeout, backend):
    pool = _pool(world_size, backend)
    env = dict(os.environ)
    for q in pool.tasks:
        q.put((fn, args, init_file, env))
    ok = False
    try:
        _wait_for_ranks(pool.results, pool.procs, fn, world_size, timeout)
        ok = True
    finally:
        if not ok:
            pool.kill()
            _POOLS.pop((world_size, backend), None)


def _kill(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def _run_fresh(fn, world_size, args, init_file, timeout, backend, crashes, rank_env):
    spawn = rank_env is not None
    ctx = _context(spawn)
    env = None if spawn else dict(os.environ)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, init_file, results, args, backend, env))
             for r in range(world_size)]
    for r, p in enumerate(procs):
        extra = rank_env(r) if rank_env is not None else {}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update({k: str(v) for k, v in extra.items()})
        try:
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    try:
        _wait_for_ranks(results, procs, fn, world_size, timeout, crashes)
    finally:
        _kill(procs)


def _wait_for_ranks(results, procs, fn, world_size, timeout, crashes=()):
    """Waits for every rank's report on ``results``; raises naming the failed, dead or stuck
    ranks (those in ``crashes`` must die instead of reporting)."""
    name = getattr(fn, "__qualname__", repr(fn))
    done: set = set()
    deadline = _now() + timeout
    crashed: set = set()
    while len(done) + len(crashed) < world_size:
        try:
            rank, err = results.get(timeout=0.2)
        except queue.Empty:
            if _now() > deadline:
                missing = sorted(set(range(world_size)) - done - crashed)
                raise TimeoutError(f"{name} (world size {world_size}): ranks {missing} did "
                                   f"not finish within {timeout:.0f} s; all ranks killed")
            for r, p in enumerate(procs):
                if r not in done and not p.is_alive() and p.exitcode not in (0, None):
                    if r in crashes:
                        crashed.add(r)
                        continue
                    _drain(results, done)
                    if r not in done:
                        raise AssertionError(f"{name} (world size {world_size}): rank {r} "
                                             f"died with exit code {p.exitcode}")
            continue
        if err is not None:
            raise AssertionError(f"{name} (world size {world_size}) failed on rank {rank}:"
                                 f"\n{err}")
        if rank in crashes:
            raise AssertionError(f"{name} (world size {world_size}): rank {rank} finished; "
                                 "the test expected it to die")
        done.add(rank)


def _drain(results, done):
    while True:
        try:
            rank, err = results.get_nowait()
        except queue.Empty:
            return
        if err is not None:
            raise AssertionError(f"rank {rank} failed:\n{err}")
        done.add(rank)


def _now() -> float:
    import time

    return time.monotonic()


def from_rank(module, src=0):
    """The test's own copy of rank ``src``'s module on every rank of the default group, by plain
    broadcasts of its parameters and buffers (what tpx's ``src_rank`` initialisation must
    reproduce)."""
    import copy

    import torch
    import torch.distributed as dist

    module = copy.deepcopy(module)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t, src)
    return module


# ------------------------------------------------------------------ checks used in the ranks

def assert_like_unsharded(model, ref, what, *, grad=False, rtol=1e-5, atol=1e-6, local=None):
    """Every parameter of the sharded ``model`` (its gradient with ``grad=True``) equals this
    rank's part of the same-named parameter of the unsharded ``ref``: the block the parameter's
    layout gives it (``tpx.checkpoint``'s description of a sharded parameter) or the whole
    tensor (a replicated one, or the full tensor that ``local`` gathered). ``local`` maps the
    compared tensor of ``model`` first (``DTensor.full_tensor`` under FSDP2); without it a
    ``DTensor`` tpx does not describe (PyTorch's own style sharded it) is compared whole, and
    any other by its local part. Both models have the same parameter names; a gradient missing on one side
    must be missing on the other; at least one tensor is compared."""
    import torch
    import tpx.checkpoint

    sharded = {sh.key: sh for sh in tpx.checkpoint.sharded_params(model)}
    ref_params = dict(ref.named_parameters())
    names = [k for k, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), (what, names, sorted(ref_params))
    compared = 0
    for key, p in model.named_parameters():
        expected, got = ref_params[key], p
        if grad:
            expected, got = expected.grad, p.grad
            if expected is None or got is None:
                assert expected is None and got is None, (
                    f"{what}: gradient of {key}: unsharded "
                    f"{'has one' if expected is not None else 'none'}, sharded "
                    f"{'has one' if got is not None else 'none'}")
                continue
        if local is not None:
            got = local(got)
        elif key not in sharded and type(got).__name__ == "DTensor" and \
                tuple(got.to_local().shape) != tuple(expected.shape):
            got = got.full_tensor()  # a parameter PyTorch's own style sharded
        got = local_vs(got, expected)
        if key in sharded and tuple(got.shape) != tuple(expected.shape):
            expected = sharded[key].slice_of(expected)  # this rank's part
        torch.testing.assert_close(
            got.detach(), expected.detach(), rtol=rtol, atol=atol,
            msg=lambda m, key=key: f"{what}: {'gradient of ' if grad else ''}{key}: {m}")
        compared += 1
    assert compared, f"{what}: nothing compared"


def local_part(t):
    """A tpx parameter (a ``DTensor``) as this rank stores it: its local part."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_vs(actual, expected):
    """``actual`` as compared with ``expected``: a ``DTensor`` (a tpx parameter, its gradient)
    set against a plain tensor (this rank's slice of the unsharded one) is its local part."""
    from torch.distributed.tensor import DTensor

    if isinstance(actual, DTensor) and not isinstance(expected, DTensor):
        return actual.to_local()
    return actual


def comm_counts(stats) -> dict:
    """``{kind: calls}`` of the collectives a ``tpx.comm_stats()`` recorded (kinds with none
    left out)."""
    return {k: stats.calls(kind=k) for k in ("all_reduce", "all_gather", "reduce_scatter")
            if stats.calls(kind=k)}


def run_cases(cases, *args):
    """Runs every ``(name, fn)`` of ``cases`` as ``fn(*args)`` and raises one AssertionError
    with the traceback of each that failed, so one run reports all of them."""
    failures = []
    for name, fn in cases:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - reported together below
            failures.append(f"--- {name}\n{traceback.format_exc()}")
    if failures:
        raise AssertionError("\n".join(failures))


def run_command(cmd, *, timeout: float, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` in a session of its
    own: on a timeout every process of that session is killed (torchrun's ranks too, which
    a plain ``subprocess.run`` would leave running), then ``subprocess.TimeoutExpired`` is
    raised with the output so far."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
