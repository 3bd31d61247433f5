"""Agreement across ranks: the check, run when a module is built, that every rank of a group
was given the same configuration (the same ``ValueError`` on every rank instead of a hang or
a wrong answer later), and the fingerprints it compares."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from . import collectives
from ..config import rank_checks

__all__ = ["check_same_on_ranks", "tensor_checksum"]


def check_same_on_ranks(pg: dist.ProcessGroup, what: str, config: dict, *,
                        extra: Any = None) -> Optional[list]:
    """Raises the same ``ValueError`` on every rank when the ranks of ``pg`` were given
    different ``config`` values (sizes, flags, checksums of initial weights). It is one
    small collective, run when a module is built; it keeps a mismatch from turning into a
    hang or a wrong answer later.

    ``extra`` travels in the same collective without being compared; the list of every
    rank's ``extra`` is returned (``None`` when nothing was gathered: a group of one rank,
    or ``TPX_RANK_CHECKS=0``)."""
    if pg.size() == 1 or not rank_checks():
        return None
    # With NCCL the object all-gather below runs on the current CUDA device: two ranks of one
    # host on the same device would fail or hang there, so say so first (once per group).
    from .checks import check_distinct_devices

    check_distinct_devices(pg)
    gathered: list[Any] = [None] * pg.size()
    # Outside inference mode: torch < 2.6's all_gather_object updates its buffers in place.
    with torch.inference_mode(False):
        collectives.all_gather_object(gathered, (config, extra), pg)
    for rank, (other, _) in enumerate(gathered):
        if other != config:
            diff = {k: (config.get(k), other.get(k)) for k in set(config) | set(other)
                    if config.get(k) != other.get(k)}
            raise ValueError(
                f"tpx: {what}: ranks of the group were given different arguments "
                f"(this rank {dist.get_rank(pg)} vs rank {rank}: {diff}). Every rank must build "
                "the same model with the same arguments; `initial_weights` differing means the "
                "ranks drew different random weights under src_rank=None: call "
                "torch.manual_seed(seed) with the same seed on every rank before building tpx "
                "modules, or leave src_rank=0 (the default) so that every rank takes rank 0's "
                "initial weights."
            )
    return [e for _, e in gathered]


_CHECKSUM_CHUNK = 1 << 20  # elements reduced per step by tensor_checksum


def tensor_checksum(t: Optional[torch.Tensor]) -> Optional[float]:
    """A cheap fingerprint of a tensor's values for :func:`check_same_on_ranks`: the sum of
    its values plus the sum of their magnitudes, accumulated in float64 over blocks of at most
    about a million elements, so it needs no full-size temporary (a float64 copy of a
    128k x 4096 LM head would be 4 GiB)."""
    if t is None or t.device.type == "meta" or t.numel() == 0:
        return None
    t = t.detach()
    if t.is_contiguous() or t.dim() <= 1:
        t = t.reshape(-1)  # a view: contiguous, or 1-D (any stride)
        step = _CHECKSUM_CHUNK
    else:  # a strided view (a transposed weight): blocks of whole rows, still views
        step = max(1, _CHECKSUM_CHUNK // max(1, t[0].numel()))
    total = torch.zeros(2, dtype=torch.float64, device=t.device)
    for i in range(0, t.shape[0], step):
        block = t[i:i + step].to(torch.float64, copy=True)
        total[0] += block.sum()
        total[1] += block.abs_().sum()
        del block  # before the next block is made: one block alive at a time
    return float(total.sum())
