"""The gated RMS norm of a Mamba-2 mixer whose features are split over the ranks.

A Mamba-2 mixer (Mamba-2, Bamba, Falcon-H1, Nemotron-H, GraniteMoE-hybrid, Zamba 2) normalises
its scan output ``y`` gated by ``z``: ``rms_norm(y * silu(z))`` over each group of
``group_size`` consecutive features of the ``I`` features (``I / n_groups``; one group, all
``I`` features, in most released configs). Split by heads, each rank holds a block of those
features; a group that spans several ranks needs the sum of its squares from all of them.
:class:`GatedRMSNormParallel` computes each rank's sums per group and adds them over the
group of ranks in one all-reduce per call (its gradient in one more in the backward); where
every group this rank holds lies on it alone, it computes locally.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import mappings
from ..comm.guard import guarded
from ..layout.param_dtensors import local_params

__all__ = ["GatedRMSNormParallel"]


class GatedRMSNormParallel(nn.Module):
    """``rms_norm(y * silu(z)) * weight`` (or, with ``norm_before_gate``, ``rms_norm(y) *
    weight * silu(z)``) over groups of ``group_size`` features of ``features`` in all, of which
    this rank holds ``cols[rank]`` (``(start, end)``, one range per rank, in rank order).

    ``weight`` (this rank's ``end - start`` features, the ``Parameter`` given) is kept as it
    is. ``cast_before_weight``: the normalised features are cast to the input's dtype before
    the weight multiplies them (transformers' Mamba-2 norms) rather than after (Falcon-H1's).

    Placement: ``y``, ``z`` and the output ``S(-1)`` (this rank's features), ``weight``
    ``S(0)``; the sums of squares of a group split over ranks are all-reduced (``P -> R``),
    their gradient likewise."""

    def __init__(self, weight: nn.Parameter, *, cols: List[Tuple[int, int]], features: int,
                 group_size: int, eps: float, group: dist.ProcessGroup,
                 norm_before_gate: bool = False, cast_before_weight: bool = True) -> None:
        super().__init__()
        if features % group_size:
            raise ValueError(f"tpx.GatedRMSNormParallel: {features} features do not make "
                             f"groups of {group_size}")
        self.weight = weight
        self.cols = [tuple(c) for c in cols]
        self.features, self.group_size, self.variance_epsilon = features, group_size, eps
        self.norm_before_gate, self.cast_before_weight = norm_before_gate, cast_before_weight
        self.group = group
        start, end = self.cols[dist.get_rank(group)]
        self.start, self.end = start, end
        # every group this rank touches lies on it alone: no sum over ranks
        self.local = all(s % group_size == 0 and e % group_size == 0 for s, e in self.cols)
        self._index: dict = {}  # device -> the global group of each local feature

    def _group_index(self, device: torch.device) -> Tensor:
        # built on first use on each device (a model built on the meta device has no values)
        index = self._index.get(str(device))
        if index is None:
            index = (torch.arange(self.start, self.end) // self.group_size).to(device)
            self._index[str(device)] = index
        return index

    def _shards(self):
        return [("weight", 0, [[c] for c in self.cols])]

    @guarded
    def forward(self, hidden_states: Tensor, gate: Optional[Tensor] = None) -> Tensor:
        (weight,) = local_params(self.weight)
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if gate is not None and not self.norm_before_gate:
            x = x * F.silu(gate.to(torch.float32))
        if self.local:
            groups = x.view(*x.shape[:-1], -1, self.group_size)
            inv = torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            x = (groups * inv).view_as(x)
        else:
            # each group's sum of squares over this rank's features, then over the ranks
            n_groups = self.features // self.group_size
            sums = torch.zeros(*x.shape[:-1], n_groups, dtype=x.dtype, device=x.device)
            index = self._group_index(x.device)
            sums = sums.index_add(-1, index, x.pow(2))
            sums = mappings.all_reduce_sum(mappings.all_reduce_grad(sums, self.group),
                                           self.group)
            inv = torch.rsqrt(sums / self.group_size + self.variance_epsilon)
            x = x * inv.index_select(-1, index)
        if self.cast_before_weight:
            return weight * x.to(dtype)
        x = weight * x
        if gate is not None and self.norm_before_gate:
            x = x * F.silu(gate.to(torch.float32))
        return x.to(dtype)

    def extra_repr(self) -> str:
        return (f"features={self.features} (local {self.start}:{self.end}), "
                f"group_size={self.group_size}, eps={self.variance_epsilon}")
