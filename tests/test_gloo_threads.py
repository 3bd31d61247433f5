"""tpx runs its collectives on gloo groups of its own (tpx.comm_groups) and switches only
their event-loop threads to SCHED_BATCH (see tpx/comm_groups.py for why): the threads of the
user's groups, DDP's and every other keep gloo's default, and TPX_GLOO_LOOP_POLICY=keep
leaves tpx's own as gloo starts them too. The results of the ops are unchanged: checked
against the unsharded product at world sizes 2 and 3."""

import functools
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import tpx
from harness import run_ranks
from torch_compat import TORCH_VERSION

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread scheduling policies are set on Linux only")

_PROBE = """
import os, tempfile, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
names = {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}
print("gloo_tcp_loop" in names)
"""


@functools.lru_cache(maxsize=None)
def _skip_if_gloo_threads_unnamed() -> Optional[str]:
    """The reason to skip on a torch (< 2.13) whose gloo leaves its event-loop threads
    unnamed (torch 2.5 does): tpx finds them by name, so there is nothing to switch there. On
    newer torch a missing name stays a failure."""
    if TORCH_VERSION >= (2, 13):
        return None
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120).stdout.strip()
    if out.endswith("False"):
        return (f"torch {torch.__version__}: its gloo does not name its event-loop threads "
                "'gloo_tcp_loop', so tpx cannot find them and leaves their policy as it is")
    return None


def gloo_loop_threads() -> dict:
    """{thread id: scheduling policy} of this process's gloo event-loop threads."""
    policies = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread has exited
            continue
        if name == "gloo_tcp_loop":
            policies[int(tid)] = os.sched_getscheduler(int(tid))
    return policies


def _sum_matches(rank, world, group, seed):
    """matmul_all_reduce over `group` equals the unsharded product."""
    gen = torch.Generator().manual_seed(seed)
    k, n = 7 * world + 1, 5  # k does not divide: uneven shards of the contraction
    a, b = torch.randn(9, k, generator=gen), torch.randn(k, n, generator=gen)
    r = dist.get_rank(group)
    c0, c1 = tpx.shard_range(k, group)
    out = tpx.ops.matmul_all_reduce(a[:, c0:c1], b[c0:c1], group)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"rank {rank} (group rank {r}): {m}")


def _check_policies(rank, world, policy):
    if policy is not None:
        os.environ["TPX_GLOO_LOOP_POLICY"] = policy
    before = gloo_loop_threads()
    assert before, "no gloo_tcp_loop thread found: gloo names its event-loop thread otherwise"
    assert set(before.values()) == {os.SCHED_OTHER}, before
    # A thread the user gave its own policy keeps it.
    chosen = min(before)
    os.sched_setscheduler(chosen, os.SCHED_IDLE, os.sched_param(0))
    users = dict(gloo_loop_threads())

    _sum_matches(rank, world, dist.group.WORLD, seed=world)
    after = gloo_loop_threads()
    want = os.SCHED_OTHER if policy == "keep" else os.SCHED_BATCH
    # The user's threads as they were; the one thread tpx's own group brought, switched.
    assert {t: after[t] for t in users} == users, (users, after)
    mine = set(after) - set(users)
    assert len(mine) == 1, after
    assert {after[t] for t in mine} == {want}, (policy, after)

    # A group created afterwards brings its own loop thread, left alone; tpx's copy of it is
    # switched when tpx first uses it.
    group = dist.new_group(list(range(world)))
    fresh = set(gloo_loop_threads()) - set(after)
    assert len(fresh) == 1, "the new group started no gloo event-loop thread"
    _sum_matches(rank, world, group, seed=10 + world)
    now = gloo_loop_threads()
    assert {now[t] for t in fresh} == {os.SCHED_OTHER}, now
    theirs = set(now) - set(after) - fresh
    assert len(theirs) == 1 and {now[t] for t in theirs} == {want}, now


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("policy", [None, "batch", "keep"])
def test_gloo_loop_threads_policy(world, policy):
    reason = _skip_if_gloo_threads_unnamed()
    if reason:
        pytest.skip(reason)
    run_ranks(_check_policies, world, policy, fresh=True)  # every gloo thread of the process


def _check_bad_policy(rank, world, named):
    os.environ["TPX_GLOO_LOOP_POLICY"] = "fast"
    with pytest.raises(ValueError, match="TPX_GLOO_LOOP_POLICY must be 'batch'.*'keep'.*'fast'"):
        _sum_matches(rank, world, dist.group.WORLD, seed=3)
    if named:
        assert set(gloo_loop_threads().values()) == {os.SCHED_OTHER}
    os.environ["TPX_GLOO_LOOP_POLICY"] = "keep"
    _sum_matches(rank, world, dist.group.WORLD, seed=4)  # the group still works
    if named:
        assert set(gloo_loop_threads().values()) == {os.SCHED_OTHER}


def test_bad_gloo_loop_policy_is_a_value_error():
    # Without named loop threads (see _skip_if_gloo_threads_unnamed) only the error and the
    # results are checked.
    run_ranks(_check_bad_policy, 2, _skip_if_gloo_threads_unnamed() is None, fresh=True)
