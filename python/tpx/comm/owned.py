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

The failure guard that closes these groups when one rank fails is :mod:`tpx.comm.guard`.
"""

from __future__ import annotations

import os
import time
import uuid
import weakref
from datetime import timedelta
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from .. import _ext, config
from ..run import at_end_run

__all__ = ["own", "owned_group", "group_broken_reason", "settings", "wire_group",
           "live_groups"]

# user group name -> (a weak reference to the user's group, the name of tpx's own group or
# None when it needs none). Weak, and names only: tpx keeps no group alive past
# destroy_process_group (a group kept alive would be torn down at interpreter exit instead,
# with its threads still running).
_OWNED: Dict[str, Tuple[object, Optional[str]]] = {}

# tpx's own group name -> the id its ranks agreed when it was made (rank 0's), which names
# the group's keys in the store (group names repeat within a run; ids do not).
_IDS: Dict[str, str] = {}



def settings() -> Dict[str, object]:
    """This rank's settings that shape tpx's collectives, validated (the ranks of a group must
    agree on them): ``TPX_GLOO_ALLREDUCE``, ``TPX_GLOO_LOOP_POLICY``, ``TPX_DEFAULT_CHUNKS``."""
    allreduce, policy = config.gloo_allreduce(), config.gloo_loop_policy()
    return {"TPX_GLOO_ALLREDUCE": allreduce, "TPX_GLOO_LOOP_POLICY": policy,
            "TPX_DEFAULT_CHUNKS": int(_ext.build_info()["default_chunks"])}


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
    mine_id = uuid.uuid4().hex  # not compared: rank 0's becomes the group's id
    before = _gloo_loop_threads()
    owned = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo",
                           timeout=_timeout(pg), use_local_synchronization=True,
                           group_desc=f"tpx:{name}")
    threads = _gloo_loop_threads() - before
    everyone = [None] * pg.size()
    from torch.utils._python_dispatch import _disable_current_modes

    # Not a collective of the model's layout: no dispatch mode (CommDebugMode) sees it.
    with torch.inference_mode(False), _disable_current_modes():
        dist.all_gather_object(everyone, dict(mine, id=mine_id), group=owned)
    group_id = everyone[0].pop("id")
    for s in everyone[1:]:
        s.pop("id")
    differ = {k: [s[k] for s in everyone] for k in mine if any(s[k] != mine[k] for s in everyone)}
    if differ:
        # The pause lets gloo's threads free the exchange's tensors first: torch before 2.8
        # destroys a group holding the GIL, which those threads need (the deadlock that
        # tpx.end_run sidesteps the same way).
        time.sleep(0.2)
        dist.destroy_process_group(owned)
        raise ValueError(
            f"tpx: the ranks of process group '{name}' run with different settings that shape "
            f"tpx's collectives ({', '.join(f'{k} = {v} by rank' for k, v in differ.items())}). "
            "Set them the same way on every rank (or unset them), e.g. in the launcher's "
            "environment.")
    if mine["TPX_GLOO_LOOP_POLICY"] == "batch":
        _batch(threads)
    _ext.register_owned_group(name, owned.group_name,
                            mine["TPX_GLOO_ALLREDUCE"] == "exchange" and pg.size() == 2)
    _OWNED[name] = (weakref.ref(pg), owned.group_name)
    _IDS[owned.group_name] = group_id


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
    return _ext.group_broken_reason((own_pg or group).group_name)


def wire_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group a collective tpx issues from Python for ``group`` runs on: tpx's own copy
    when it has one, else ``group``. Raises, as the C++ ops do, when tpx marked it broken.
    Under ``torch.compile``, ``group`` itself (the graph uses the backend's collectives)."""
    if torch.compiler.is_compiling():
        return group
    own_pg = owned_group(group)
    target = own_pg or group
    why = _ext.group_broken_reason(target.group_name)
    if why is not None:
        raise dist.DistError(
            f"tpx: process group '{group.group_name}' can no longer be used by tpx: {why}. The "
            "ranks of the group no longer agree on which message comes next, so any later "
            "collective could pair the wrong messages; end the run (or destroy the group and "
            "make a new one) and resume from the last checkpoint.")
    return target


# ---------------------------------------------------------------------------------------------
# A failure on one rank: every rank learns of it promptly (module docstring).

def live_groups() -> List[Tuple[dist.ProcessGroup, str, List[int]]]:
    """(tpx's own group, its id, its global ranks) for every live group tpx owns here."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = []
    for user_ref, owned_name in list(_OWNED.values()):
        if owned_name is None or user_ref() is None or owned_name not in _IDS:
            continue
        try:
            pg = _resolve_process_group(owned_name)
            out.append((pg, _IDS[owned_name], dist.get_process_group_ranks(pg)))
        except Exception:  # destroyed
            continue
    return out


@at_end_run
def forget_all() -> None:
    _OWNED.clear()

