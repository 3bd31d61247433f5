"""Process groups: what tpx accepts as ``group``, how a dimension is sharded over it, and the
check that every rank of a group was given the same configuration.

``group`` everywhere in tpx accepts ``None`` (the default group), a
``torch.distributed.ProcessGroup`` or a 1-D ``torch.distributed.device_mesh.DeviceMesh``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist

try:  # DeviceMesh is importable on every supported torch, but keep the import soft.
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover
    DeviceMesh = ()  # type: ignore[assignment,misc]

GroupLike = Union[None, "dist.ProcessGroup", "DeviceMesh"]

__all__ = ["resolve_group", "group_name", "shard_range", "check_same_on_ranks"]


def resolve_group(group: GroupLike = None) -> dist.ProcessGroup:
    """Returns the ``ProcessGroup`` that ``group`` designates, or raises an error that says
    what to change: torch.distributed not initialised, a mesh that is not 1-D, a group this
    rank is not a member of, or an object of another type."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "tpx: torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl') first (torchrun sets "
            "up the environment for it), even for a single process."
        )
    if group is None:
        return dist.group.WORLD
    if DeviceMesh and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None)
            raise ValueError(
                f"tpx: `group` is a {group.ndim}-D DeviceMesh (dims {names}); tensor parallelism "
                "needs a 1-D mesh. Pass the TP dimension of it, e.g. mesh['tp']."
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        if dist.get_rank(group) < 0:
            raise ValueError(
                "tpx: this rank is not a member of the `group` passed; every rank that calls a "
                "tpx op or builds a tpx module must belong to its group."
            )
        return group
    raise TypeError(
        "tpx: `group` must be None, a torch.distributed.ProcessGroup or a 1-D DeviceMesh; got "
        f"{type(group).__name__}."
    )


def group_name(group: GroupLike = None) -> str:
    """The registered name of the group, as the C++ ops take it."""
    return resolve_group(group).group_name


def shard_range(size: int, group: GroupLike = None) -> Tuple[int, int]:
    """The slice ``[start, end)`` of a dimension of ``size`` entries that this rank holds when
    it is sharded over ``group``, with ``torch.chunk``'s split: every rank but the last ones
    holds ``ceil(size / world_size)`` entries; trailing ranks may hold fewer, or none when
    ``size < world_size``.

    >>> start, end = tpx.shard_range(50257)   # at TP 4: 12565 rows, the last rank 12562
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"tpx.shard_range: `size` must be a non-negative int; got {size!r}")
    pg = resolve_group(group)
    return _range(size, dist.get_rank(pg), pg.size())


def _range(size: int, rank: int, world: int) -> Tuple[int, int]:
    per = -(-size // world) if size else 0
    start = min(rank * per, size)
    return start, min(start + per, size)


def shard_sizes(size: int, world: int) -> list:
    """The local sizes of every rank for a dimension of ``size`` sharded with ``shard_range``."""
    return [e - s for s, e in (_range(size, r, world) for r in range(world))]


def rank_checks_enabled() -> bool:
    """Whether modules compare their configuration across ranks when they are built
    (``TPX_RANK_CHECKS=0`` turns it off)."""
    return os.environ.get("TPX_RANK_CHECKS", "1") != "0"


def check_same_on_ranks(pg: dist.ProcessGroup, what: str, config: dict) -> None:
    """Raises the same ``ValueError`` on every rank when the ranks of ``pg`` were given
    different ``config`` values (sizes, flags, checksums of initial weights). It is one
    small collective, run when a module is built; it keeps a mismatch from turning into a
    hang or a wrong answer later."""
    if pg.size() == 1 or not rank_checks_enabled():
        return
    gathered: list[Any] = [None] * pg.size()
    dist.all_gather_object(gathered, config, group=pg)
    for rank, other in enumerate(gathered):
        if other != config:
            diff = {k: (config.get(k), other.get(k)) for k in set(config) | set(other)
                    if config.get(k) != other.get(k)}
            raise ValueError(
                f"tpx: {what}: ranks of the group were given different arguments "
                f"(this rank {dist.get_rank(pg)} vs rank {rank}: {diff}). Every rank must build "
                "the same model with the same arguments; `initial_weights` differing means the "
                "ranks drew different random weights: call torch.manual_seed(seed) with the same "
                "seed on every rank before building tpx modules (or use from_linear / load a "
                "checkpoint)."
            )


def tensor_checksum(t: Optional[torch.Tensor]) -> Optional[float]:
    """A cheap fingerprint of a tensor's values for :func:`check_same_on_ranks`."""
    if t is None or t.device.type == "meta" or t.numel() == 0:
        return None
    return float(t.detach().double().sum()) + float(t.detach().double().abs().sum())


def vocab_layout(local_size: int, pg: dist.ProcessGroup, vocab_size: Optional[int] = None,
                 device: Optional[torch.device] = None) -> Tuple[int, int]:
    """``(start, full_size)`` of this rank's block of a dimension sharded over ``pg`` whose
    local size is ``local_size``. With ``vocab_size`` the layout is ``shard_range(vocab_size)``
    (checked, no communication); without it the ranks' local sizes are all-gathered (one
    integer each) and the blocks follow rank order, so any split is accepted."""
    rank, world = dist.get_rank(pg), pg.size()
    if vocab_size is not None:
        start, end = _range(vocab_size, rank, world)
        if end - start != local_size:
            raise ValueError(
                f"tpx: this rank holds {local_size} vocabulary entries but shard_range("
                f"{vocab_size}) gives it {end - start} ([{start}, {end})); shard the vocabulary "
                "with tpx.shard_range, or pass the right vocab_size")
        return start, vocab_size
    if world == 1:
        return 0, local_size
    mine = torch.tensor([local_size], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=pg)
    sizes = [int(s) for s in sizes]
    return sum(sizes[:rank]), sum(sizes)


class SharesGroupOnCopy:
    """Mixin for modules that hold a ``group``: ``copy.deepcopy`` shares the process group
    (which cannot be copied) instead of failing."""

    def __deepcopy__(self, memo):
        import copy

        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new
