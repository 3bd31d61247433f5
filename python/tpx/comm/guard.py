"""The failure guard of tpx's ops and layers: a failure on one rank is an error on every rank,
promptly.

When an exception leaves a tpx op or layer on one rank (bad input, out of memory, Ctrl-C) while its peers may already wait in
that op's collective, the rank asks, through the default group's store, whether every rank of
its tpx groups failed with it (the same bad input everywhere, say). If they all did within
``TPX_FAULT_GRACE`` seconds (default 2), nothing else happens: no collective was left half
done and the groups stay usable. If not, the rank marks its tpx groups broken and closes their
connections: a peer waiting in a collective on them raises at once
(``torch.distributed.DistBackendError``, a ``RuntimeError``, naming
the rank that failed and its error) instead of waiting out the group's timeout, or pairing its
messages with the failed rank's next step, and every later tpx op on those groups raises on
every rank. Only tpx's own groups are closed; the user's groups stay as they are.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Callable, Dict, Optional, TypeVar

import torch
import torch.distributed as dist

from .. import _ext, config
from .owned import live_groups

__all__ = ["guarded"]


_F = TypeVar("_F", bound=Callable)
_ABORT_TAG = 0x7472  # a receive on tpx's own group that is never sent: see _close
_FAILURES: Dict[str, int] = {}  # group id -> failures this rank reported on it


def guarded(fn: _F) -> _F:
    """Runs ``fn``; an exception leaving it goes through :func:`_on_failure` first (once per
    exception, however many guarded calls it unwinds through). Nothing is added under
    ``torch.compile``, where tpx makes no groups of its own."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (Exception, KeyboardInterrupt) as exc:
            replacement = _on_failure(exc)
            if replacement is not None:
                raise replacement from exc
            raise

    wrapper._tpx_guarded = True  # type: ignore[attr-defined]  (checked by the tests)
    return wrapper  # type: ignore[return-value]


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    try:
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    except Exception:
        return False


def _close(pg: dist.ProcessGroup) -> None:
    """Closes this rank's connections of ``pg`` (tpx's own gloo group), so that a peer
    blocked in a collective on it raises at once. Gloo closes the connections of a group
    when a receive times out; a receive from each peer that is never sent, waited on for a
    millisecond, does that."""
    me = pg.rank()
    for peer in range(pg.size()):
        if peer == me:
            continue
        try:
            work = pg.recv([torch.empty(1, dtype=torch.uint8)], peer, _ABORT_TAG)
        except Exception:  # this connection is already closed: try the next
            continue
        try:
            work.wait(timedelta(milliseconds=1))
        except Exception:
            pass
        # Newer gloo closes every connection of the group on the first timeout (the next
        # posts raise); with torch 2.5's gloo one receive did not reach every peer of a
        # four-rank group, so every peer gets its own.


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _refused(exc: BaseException) -> bool:
    """An op refused on a group tpx marked broken (:func:`wire_group`, and the C++ ops alike):
    ``torch.distributed.DistError`` itself, whose message says why."""
    return type(exc) is dist.DistError


def _is_communication_failure(exc: BaseException, groups) -> bool:
    """A collective failed (a peer died or closed its connections): tpx's collectives, Python's
    and the C++ ops', raise ``torch.distributed.DistBackendError``; or a group is broken here."""
    if any(_ext.group_broken_reason(pg.group_name) is not None for pg, _, _ in groups):
        return True
    return isinstance(exc, dist.DistBackendError)


def _on_failure(exc: BaseException) -> Optional[BaseException]:
    """What this rank does when ``exc`` leaves a tpx op or layer (module docstring). Returns
    the error to raise instead (a peer's failure, explained), or ``None`` to re-raise ``exc``."""
    if getattr(exc, "_tpx_failure_seen", False) or _tracing():
        return None
    try:
        exc._tpx_failure_seen = True  # type: ignore[attr-defined]
    except Exception:
        pass
    if _refused(exc):
        return None  # an op on a group already broken: its error says why
    try:
        return _handle_failure(exc)
    except Exception:  # never hide the user's error behind one of tpx's own
        return None


def _handle_failure(exc: BaseException) -> Optional[BaseException]:
    groups = live_groups()
    if not groups:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        rank = dist.get_rank()
    except Exception:
        store, rank = None, dist.get_rank() if dist.is_initialized() else -1

    def broken_reason() -> Optional[str]:
        if store is None:
            return None
        for _, gid, _ in groups:
            key = f"tpx/{gid}/broken"
            try:
                if store.check([key]):
                    return store.get(key).decode()
            except Exception:
                return None
        return None

    mine = _first_line(exc)
    why = broken_reason()
    told = why is not None  # another rank's failure, recorded before it closed its groups
    own_failure = not told and not _is_communication_failure(exc, groups)
    if own_failure and store is not None:
        # Did every rank of every group fail here too? Then nothing is left half done.
        grace = config.fault_grace()
        wanted = []
        try:
            for _, gid, ranks in groups:
                k = _FAILURES[gid] = _FAILURES.get(gid, 0) + 1
                store.set(f"tpx/{gid}/failed/{k}/{rank}", mine)
                wanted += [f"tpx/{gid}/failed/{k}/{r}" for r in ranks if r != rank]
            deadline = time.monotonic() + grace
            while True:
                missing = [key for key in wanted if not store.check([key])]
                if not missing:
                    return None  # every rank failed with this one: the groups stay in step
                why = broken_reason()
                if why is not None or time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
        except Exception:  # the store is gone (rank 0 ended): the group cannot be trusted
            missing = ["?"]
        if why is None:
            silent = sorted({int(key.rsplit("/", 1)[1]) for key in missing if key != "?"})
            why = (f"rank {rank} raised {mine} inside a tpx op"
                   + (f" while rank(s) {silent} did not (they were waiting in its collective, "
                      f"or more than TPX_FAULT_GRACE={grace:g} s late)" if silent else ""))
    elif why is None:
        why = f"a collective failed on rank {rank}: {mine}"
    if store is not None:
        for _, gid, _ in groups:
            try:
                if not store.check([f"tpx/{gid}/broken"]):
                    store.set(f"tpx/{gid}/broken", why)
            except Exception:
                break
    for pg, _, _ in groups:
        _ext.mark_group_broken(pg.group_name, why)
        _close(pg)
    if not told:
        # This rank's own error, or its collective failed (a peer died): the error says so
        # best; its later tpx ops raise `why`.
        return None
    replacement = dist.DistBackendError(
        f"tpx: {why}. This rank's tpx collectives were cut off so that it learns of it now "
        "rather than after the group's timeout; tpx's process groups can no longer be used "
        "(the user's groups are untouched): end the run and resume from the last checkpoint. "
        f"This rank's error: {mine}")
    replacement._tpx_failure_seen = True  # type: ignore[attr-defined]
    return replacement
