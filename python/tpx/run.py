"""Ending a distributed run: ``tpx.end_run()``."""

from __future__ import annotations

import time

import torch.distributed as dist

__all__ = ["end_run"]

# How long the calling thread sleeps (and so releases the GIL) before the groups are destroyed.
_GLOO_GRACE_S = 0.2


def end_run() -> None:
    """Ends a distributed run cleanly: call it once, last, on every rank, where a script would
    call ``torch.distributed.destroy_process_group()``.

    It waits for every rank (a barrier over the default group), lets go of tpx's references to
    process groups, releases the GIL for 0.2 s so that gloo's worker threads can free the
    tensors of the last collectives (freeing a tensor Python has let go of needs the GIL), and
    then destroys every process group. Without that pause a process can abort at exit
    ("terminate called without an active exception", pytorch/pytorch#190489) or, before torch
    2.8, deadlock in ``destroy_process_group`` (pytorch/pytorch#154976), with or without tpx.
    Collective over the default group; does nothing when ``torch.distributed`` is not
    initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    from . import comm_groups
    from . import sharding
    from .nn import dtensor_io

    comm_groups._forget_all()
    dtensor_io._MESHES.clear()
    sharding._BLOCK_MESHES.clear()
    time.sleep(_GLOO_GRACE_S)
    dist.destroy_process_group()
