"""Calls that need every rank: entered by all of them, or an error instead of a wait.

A script calls ``save_pretrained``, ``tpx.checkpoint.save`` or ``parallelize_module`` at a
point of its choosing; if one rank calls it and another does not (``if rank == 0:
model.save_pretrained(d)``, the idiom of many tutorials), the ranks that came would wait in
the call's first collective for the group's timeout (30 minutes on gloo, NCCL's watchdog 10)
without a word. :func:`every_rank` runs before such a call does anything: each rank records
its arrival in the default group's store and waits, for at most ``TPX_ENTRY_GRACE`` seconds
(default 30), until every rank of the call's group has arrived. If one has not, the ranks that
came raise :class:`RanksMissingError`, naming the call and the ranks that never came; nothing
was written or changed. No data collective is involved, and the ranks that did not come are
not harmed: their next call works.

How the ranks agree, without a collective. Each rank counts the calls it has decided with a
set of ranks (``step``). At step ``k`` a rank writes its arrival (``k/<rank>`` holds the call's
name), adds one to ``k/count``, and waits for ``k/outcome``. The rank whose addition makes the
count whole sets the outcome to ``go``; a rank whose grace period ends first sets it to
``abandoned``. Both use the store's compare-and-set, so exactly one outcome is ever set, and
every rank that waits reads the same one: ``go`` lets every rank in, ``abandoned`` raises on
every rank that came. After an outcome every rank that took part moves to step ``k + 1``. A rank that arrives at a step already abandoned (it did not come in time, or
did not come at all) moves on to the next step, so the ranks that never came are in step with
the others at their next call; one that came too late waits at the next step and raises in
turn, naming the ranks that did not come there.

Only the outermost such call checks (``from_pretrained`` enters ``parallelize_module``
inside). Nothing is checked in a world of one rank, on torch's fake process group, or under
``torch.compile``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from .. import config

__all__ = ["RanksMissingError", "collective_call", "every_rank", "ranks_of"]

_F = TypeVar("_F", bound=Callable)


class RanksMissingError(RuntimeError):
    """Raised on the ranks that entered a call that needs every rank of its group, when some
    did not enter it within ``TPX_ENTRY_GRACE`` seconds (or entered a different one). Its
    ``missing`` attribute lists the global ranks that did not come."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)


# Per default group (a new ``init_process_group`` starts again from step 0): for each set of
# ranks and each rank of this process (threads may play ranks), the step it is at.
_STEPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[Tuple[Tuple[int, ...], int], int]]" = \
    weakref.WeakKeyDictionary()
_DEPTH = threading.local()
_SEP = "\x1f"  # between a call's name and its arguments in the store


def _store_and_world():
    if not dist.is_available() or not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if dist.get_backend(default) == "fake" or dist.get_world_size() == 1:
        return None
    return default, dist.distributed_c10d._get_default_store()


def _wait_key(store, key: str, deadline: float) -> Optional[str]:
    """The value of ``key`` once it is set, or ``None`` at ``deadline``."""
    pause = 0.002
    while True:
        if store.check([key]):
            return store.get(key).decode()
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _names(store, base: str, ranks: Sequence[int]) -> Dict[int, str]:
    keys = {r: f"{base}/{r}" for r in ranks}
    return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}


def _check_entry(what: str, ranks: Tuple[int, ...], grace: float, detail: str) -> None:
    found = _store_and_world()
    if found is None:
        return
    default, store = found
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"{what}: this rank ({me}) is not in the group it was given (global "
                         f"ranks {list(ranks)}); call it on the ranks of that group")
    steps = _STEPS.setdefault(default, {})
    slot = (ranks, me)
    prefix = "tpx/entry/" + ",".join(map(str, ranks))
    deadline = time.monotonic() + grace
    while True:
        k = steps.get(slot, 0)
        base = f"{prefix}/{k}"
        outcome_key = f"{base}/outcome"
        if store.check([outcome_key]):  # decided without this rank: it came late, or never
            steps[slot] = k + 1
            continue
        store.set(f"{base}/{me}", what + _SEP + detail)
        if store.add(f"{base}/count", 1) == len(ranks):
            outcome = store.compare_set(outcome_key, "", "go").decode()
        else:
            outcome = _wait_key(store, outcome_key, deadline)
            if outcome is None:
                outcome = store.compare_set(outcome_key, "", "abandoned").decode()
        steps[slot] = k + 1
        if outcome == "go":
            break
        came = _names(store, base, ranks)
        missing = [r for r in ranks if r not in came]
        late = ("" if missing else
                " (every rank came, but this one after another had given up waiting)")
        raise RanksMissingError(
            f"{what} needs every rank of its group (global ranks {list(ranks)}), and rank(s) "
            f"{missing} did not call it within TPX_ENTRY_GRACE={grace:g} s{late}; this is rank "
            f"{me}. Call it on every rank, each writes its part: not under `if rank == 0:`. "
            "Nothing was written or changed; the ranks that did not call it can go on.",
            missing)
    came = {r: v.split(_SEP, 1) for r, v in _names(store, base, ranks).items()}
    other = {r: name for r, (name, _) in came.items() if name != what}
    if other:
        raise RanksMissingError(
            f"{what}: the ranks of its group (global ranks {list(ranks)}) entered different "
            f"calls that need every rank: this rank ({me}) {what}, "
            + ", ".join(f"rank {r} {name}" for r, name in sorted(other.items()))
            + ". Every rank must make the same calls in the same order; nothing was written "
            "or changed", sorted(other))
    differ = {r: d for r, (_, d) in came.items() if d != detail}
    if differ:
        raise RanksMissingError(
            f"{what}: the ranks of its group (global ranks {list(ranks)}) called it with "
            f"different arguments: this rank ({me}) {detail!r}, "
            + ", ".join(f"rank {r} {d!r}" for r, d in sorted(differ.items()))
            + ". Every rank makes the same call (each writes or reads its part of the same "
            "files); nothing was written or changed", sorted(differ))


@contextlib.contextmanager
def every_rank(what: str, group=None, ranks: Optional[Sequence[int]] = None,
               detail: object = "") -> Iterator[None]:
    """Within the block, ``what`` (the public name of the call) runs as a call every rank of
    ``group`` (a ``ProcessGroup`` or ``DeviceMesh``; or of the global ``ranks``; default: the
    whole world) has entered: on entry this rank waits at most ``TPX_ENTRY_GRACE`` seconds for
    the others, then raises :class:`RanksMissingError` (module docstring). ``detail`` (the
    directory written, say) must be the same on every rank too. Nested blocks check
    nothing."""
    depth = getattr(_DEPTH, "n", 0)
    if depth == 0 and not torch.compiler.is_compiling():
        ranks = ranks_of(group) if ranks is None else ranks
        if len(ranks) > 1:
            _check_entry(what, tuple(sorted(set(int(r) for r in ranks))), config.entry_grace(),
                         str(detail))
    _DEPTH.n = depth + 1
    try:
        yield
    finally:
        _DEPTH.n = depth


def ranks_of(target=None) -> Tuple[int, ...]:
    """The global ranks of a call's group: ``None`` (the whole world), a ``ProcessGroup``, or a
    ``DeviceMesh`` (every rank of it, whatever its dimensions)."""
    if not dist.is_initialized():
        return ()
    if target is None:
        return tuple(range(dist.get_world_size()))
    if isinstance(target, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(target))
    mesh = getattr(target, "mesh", None)
    if isinstance(mesh, torch.Tensor):
        return tuple(int(r) for r in mesh.flatten().tolist())
    raise TypeError(f"tpx: expected a ProcessGroup, a DeviceMesh or None; got "
                    f"{type(target).__name__}")


def collective_call(what: str, group_of: Callable[..., object],
                    detail_of: Optional[Callable[..., object]] = None) -> Callable[[_F], _F]:
    """Decorates a call that needs every rank: ``group_of(*args, **kwargs)`` gives its group
    (a ``ProcessGroup`` or ``DeviceMesh``), its global ranks (a list or tuple), or ``None`` for
    the whole world; ``detail_of(*args, **kwargs)`` what must be the same on every rank (the
    directory)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(_DEPTH, "n", 0) or not dist.is_initialized():
                return fn(*args, **kwargs)
            where = group_of(*args, **kwargs)
            ranks = where if isinstance(where, (list, tuple)) else ranks_of(where)
            detail = "" if detail_of is None else detail_of(*args, **kwargs)
            with every_rank(what, ranks=ranks, detail=detail):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
