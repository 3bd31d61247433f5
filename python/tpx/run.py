"""Ending a distributed run: ``tpx.end_run()``."""

from __future__ import annotations

import time
from typing import Callable, List, Optional, TypeVar

import torch.distributed as dist

__all__ = ["end_run", "at_end_run", "run_cache"]

_C = TypeVar("_C")

# What end_run resets: every cache tpx keeps of process groups, meshes or tensors derived
# from them registers its reset here (one registry, so a new cache cannot be forgotten).
_AT_END: List[Callable[[], None]] = []


def at_end_run(reset: Callable[[], None]) -> Callable[[], None]:
    """Registers ``reset`` to run in :func:`end_run` (before the groups are destroyed)."""
    _AT_END.append(reset)
    return reset


def run_cache(cache: _C) -> _C:
    """``cache`` (a dict or set keyed by groups, meshes or devices), emptied by :func:`end_run`."""
    at_end_run(cache.clear)
    return cache

# How long the calling thread sleeps (and so releases the GIL) before the groups are destroyed.
_GLOO_GRACE_S = 0.2


def end_run(*, pause: Optional[float] = None) -> None:
    """Ends a distributed run cleanly: call it once, last, on every rank, where a script would
    call ``torch.distributed.destroy_process_group()``.

    It waits for every rank (a barrier over the default group), lets go of tpx's references to
    process groups, releases the GIL for ``pause`` seconds (default 0.2) so that gloo's worker
    threads can free the tensors of the last collectives (freeing a tensor Python has let go of
    needs the GIL), and then destroys every process group. Without that pause a process that
    exits next can abort ("terminate called without an active exception",
    pytorch/pytorch#190489) or, before torch 2.8, deadlock in ``destroy_process_group``
    (pytorch/pytorch#154976), with or without tpx. A process that goes on running after it (a
    notebook, a test harness starting the next run) on torch 2.8 or later can pass
    ``pause=0``: gloo's threads get the GIL as soon as it waits. Collective over the default
    group; does nothing when ``torch.distributed`` is not initialised."""
    if pause is None:
        pause = _GLOO_GRACE_S
    if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not pause >= 0:
        raise ValueError(f"tpx.end_run: `pause` must be a number of seconds >= 0; got {pause!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    for reset in _AT_END:
        reset()
    if pause > 0:
        time.sleep(pause)
    dist.destroy_process_group()
