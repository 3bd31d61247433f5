"""tpx's own process groups: its collectives never run on a gloo group the user owns.

The first time a tpx op (or a layer's forward) runs on a gloo group of two or more ranks, the
ranks of that group make, together, a gloo group of their own for tpx with the same ranks and
the same timeout (``torch.distributed.new_group(..., use_local_synchronization=True)``: only
the group's own ranks take part, once). From then on the C++ ops run every collective they
issue for the user's group on tpx's copy; ``tpx.comm_stats()`` still counts them under the
user's group. So:

* tpx's two-rank exchange (its send/recv all-reduce, ``TPX_GLOO_ALLREDUCE=exchange``, see
  docs/design.md) and its message tags never meet the user's own ``send``/``recv`` on that
  group;
* the scheduling policy tpx gives gloo's event-loop thread (``TPX_GLOO_LOOP_POLICY``) applies
  to the thread of tpx's copy only: the user's groups, DDP's, FSDP's keep gloo's default;
* how a two-rank sum is done (``TPX_GLOO_ALLREDUCE``), the thread policy and the default
  pipeline depth (``TPX_DEFAULT_CHUNKS``, which shapes the collectives) are compared across the
  ranks when the copy is made, and a disagreement raises the same ``ValueError`` on every rank
  instead of a hang later.

NCCL groups (and groups mixing backends) are used as they are: NCCL has no tags and no
event-loop thread, and a second NCCL communicator would cost GPU memory. A group of one rank
needs no communication. Under ``torch.compile`` nothing is created: a graph traced before any
eager call runs on the user's group, with the backend's own collectives.

Cost: one extra gloo group per group tpx meets (its TCP connections and one event-loop
thread), made in a few milliseconds.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Dict, Optional, Set, Tuple

import torch
import torch.distributed as dist

from . import _C

__all__ = ["own", "owned_group", "group_broken_reason", "settings"]

# user group name -> (a weak reference to the user's group, the name of tpx's own group or
# None when it needs none). Weak, and names only: tpx keeps no group alive past
# destroy_process_group (a group kept alive would be torn down at interpreter exit instead,
# with its threads still running).
_OWNED: Dict[str, Tuple[object, Optional[str]]] = {}

_ALLREDUCE_CHOICES = ("exchange", "gloo")
_POLICY_CHOICES = ("batch", "keep")


def settings() -> Dict[str, object]:
    """This rank's settings that shape tpx's collectives, validated (the ranks of a group must
    agree on them): ``TPX_GLOO_ALLREDUCE``, ``TPX_GLOO_LOOP_POLICY``, ``TPX_DEFAULT_CHUNKS``."""
    allreduce = os.environ.get("TPX_GLOO_ALLREDUCE") or "gloo"
    if allreduce not in _ALLREDUCE_CHOICES:
        raise ValueError(
            "TPX_GLOO_ALLREDUCE must be 'gloo' (the default: gloo's own all-reduce) or "
            "'exchange' (a two-rank all-reduce as one send/recv exchange and a local add); "
            f"got '{allreduce}'")
    policy = os.environ.get("TPX_GLOO_LOOP_POLICY") or "batch"
    if policy not in _POLICY_CHOICES:
        raise ValueError(
            "TPX_GLOO_LOOP_POLICY must be 'batch' (the default: the event-loop thread of "
            "tpx's own gloo groups runs as SCHED_BATCH) or 'keep' (leave it as gloo starts "
            f"it); got '{policy}'")
    return {"TPX_GLOO_ALLREDUCE": allreduce, "TPX_GLOO_LOOP_POLICY": policy,
            "TPX_DEFAULT_CHUNKS": int(_C.build_info()["default_chunks"])}


def _is_pure_gloo(pg: dist.ProcessGroup) -> bool:
    try:
        return dist.get_backend(pg) == "gloo"
    except Exception:  # a group torch.distributed does not know the backend of
        return False


def _timeout(pg: dist.ProcessGroup) -> timedelta:
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # older torch: the default gloo timeout
        return dist.default_pg_timeout


def _gloo_loop_threads() -> Set[int]:
    """The thread ids of this process's gloo event-loop threads (empty where threads have no
    names in /proc, or gloo does not name its thread)."""
    found = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.add(int(tid))
        except OSError:  # the thread has exited
            pass
    return found


def _batch(threads: Set[int]) -> None:
    # Gloo's TCP transport gives each group an event-loop thread. Its handler only try-locks
    # the pair a socket event is for, so when it wakes while the posting thread holds that
    # lock it spins until the poster runs again; SCHED_BATCH keeps the kernel from preempting
    # the poster when the loop thread wakes (docs/benchmarks.md, "Gloo's event-loop threads").
    for tid in threads:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except (OSError, AttributeError):  # exited, refused by a sandbox, or not Linux
            pass


def own(pg: dist.ProcessGroup) -> None:
    """Makes tpx's own copy of ``pg`` if it needs one and has none yet. Collective over the
    ranks of ``pg`` the first time (every rank of ``pg`` reaches it at the same tpx op); a
    dictionary lookup afterwards."""
    name = pg.group_name
    entry = _OWNED.get(name)
    if entry is not None and entry[0]() is pg:
        return
    if torch.compiler.is_compiling():
        return
    if pg.size() < 2 or not _is_pure_gloo(pg):
        _OWNED[name] = (weakref.ref(pg), None)
        return
    mine = settings()
    before = _gloo_loop_threads()
    owned = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo",
                           timeout=_timeout(pg), use_local_synchronization=True,
                           group_desc=f"tpx:{name}")
    threads = _gloo_loop_threads() - before
    everyone = [None] * pg.size()
    with torch.inference_mode(False):
        dist.all_gather_object(everyone, mine, group=owned)
    differ = {k: [s[k] for s in everyone] for k in mine if any(s[k] != mine[k] for s in everyone)}
    if differ:
        dist.destroy_process_group(owned)
        raise ValueError(
            f"tpx: the ranks of process group '{name}' run with different settings that shape "
            f"tpx's collectives ({', '.join(f'{k} = {v} by rank' for k, v in differ.items())}). "
            "Set them the same way on every rank (or unset them), e.g. in the launcher's "
            "environment.")
    if mine["TPX_GLOO_LOOP_POLICY"] == "batch":
        _batch(threads)
    _C.register_owned_group(name, owned.group_name,
                            mine["TPX_GLOO_ALLREDUCE"] == "exchange" and pg.size() == 2)
    _OWNED[name] = (weakref.ref(pg), owned.group_name)


def own_by_name(name: str) -> None:
    """:func:`own` for a group given by its registered name."""
    if torch.compiler.is_compiling():
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    own(_resolve_process_group(name))


def owned_group(group: dist.ProcessGroup) -> Optional[dist.ProcessGroup]:
    """tpx's own copy of ``group`` (``None`` when tpx uses ``group`` itself)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    entry = _OWNED.get(group.group_name)
    if entry is None or entry[0]() is not group or entry[1] is None:
        return None
    try:
        return _resolve_process_group(entry[1])
    except Exception:  # destroyed
        return None


def group_broken_reason(group: dist.ProcessGroup) -> Optional[str]:
    """Why tpx no longer runs collectives for ``group`` (an earlier op failed with messages
    in flight and the ranks may be out of step), or ``None``."""
    own_pg = owned_group(group)
    return _C.group_broken_reason((own_pg or group).group_name)


def _forget_all() -> None:  # tests
    _OWNED.clear()

