"""Input checks that cost no host synchronisation on the fast path.

Checks of tensor *values* (ids inside the vocabulary, targets inside ``[0, V)``) need the
values on the host, which on a GPU means waiting for the GPU. tpx instead states each check
as a boolean tensor and hands it to ``torch._assert_async``:

- on the CPU it is evaluated at once (no device to wait for, no Python-level host read), and
  a failure is turned into a ``ValueError`` that names the offending value;
- on a GPU it becomes a device-side assertion: the CPU runs ahead, and a bad id stops the
  stream with the check's message (surfaced at the next synchronisation, as a CUDA error).

``TPX_INPUT_CHECKS`` picks the mode: ``async`` (the default, as above), ``sync`` (every
check reads its result on the host at once and raises the ``ValueError`` right there, at the
cost of one synchronisation per check on GPUs: for debugging) or ``off`` (no value checks).
Under ``torch.compile`` value checks are skipped.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .. import config

__all__ = ["check_values"]

def check_values(ok: Callable[[], Tensor], message: Callable[[], str]) -> None:
    """Raises ``ValueError(message())`` when the 0-d bool tensor ``ok()`` is False (see the
    module docstring for when and where). ``message`` runs only on failure, so it may read
    values on the host to name the offending one."""
    if torch.compiler.is_compiling():
        return
    mode = config.input_checks()
    if mode == "off":
        return
    cond = ok()
    if mode == "sync":
        if not bool(cond):
            raise ValueError(message())
        return
    if cond.device.type == "cpu":  # evaluated at once, in C++: no Python-level host read
        try:
            torch._assert_async(cond, "tpx: input check failed")
        except RuntimeError:
            raise ValueError(message()) from None
        return
    torch._assert_async(cond, _DEVICE_MESSAGE)


# A device-side assertion cannot format values that live on the device: it says what failed
# and how to get the precise error.
_DEVICE_MESSAGE = ("tpx: an input value check failed on the device (an id or a target outside "
                   "its range). Rerun with TPX_INPUT_CHECKS=sync for the offending value.")


_DEVICES_CHECKED: set = set()


def check_distinct_devices(pg, current_device=None) -> None:
    """Raises the same ``ValueError`` on every rank of ``pg`` when two of its ranks on one host
    use the same CUDA device — typically ``torch.cuda.set_device(local_rank)`` was not called
    before building tpx modules, so every process of the node sits on ``cuda:0`` and NCCL
    would fail or hang. Done once per group, for groups with an NCCL backend, through the
    process group's store (no GPU work). ``current_device`` (a callable returning this
    rank's device index) is for tests; it also forces the check on other backends."""
    import socket

    import torch.distributed as dist

    if pg.size() == 1 or pg.group_name in _DEVICES_CHECKED:
        return
    if current_device is None:
        if "nccl" not in str(dist.get_backend(pg)).lower():
            return
        current_device = torch.cuda.current_device
    _DEVICES_CHECKED.add(pg.group_name)
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(pg), pg.size()
    prefix = f"tpx/devices/{pg.group_name}/"
    me = f"{socket.gethostname()}|{int(current_device())}"
    store.set(prefix + str(rank), me)
    seen = {}
    for r in range(world):
        value = me if r == rank else store.get(prefix + str(r)).decode()
        if value in seen:
            host, dev = value.split("|")
            raise ValueError(
                f"tpx: ranks {seen[value]} and {r} of the group both use cuda:{dev} on host "
                f"{host}. Call torch.cuda.set_device(local_rank) (local_rank = "
                "int(os.environ['LOCAL_RANK']) under torchrun) before building tpx modules or "
                "calling tpx ops, so each process has its own GPU.")
        seen[value] = r
