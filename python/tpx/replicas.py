"""The replica guard: parameters that must be the same on every rank of a TP group, checked with
one small collective.

A tensor-parallel model holds two kinds of parameters: the shards of the tpx layers, and
everything else (norms, a row-parallel layer's bias, modules a plan left whole), which every
rank of the group holds whole and must keep identical: same values, same gradients. A plan
mistake (a replicated parameter that only sees this rank's part of the computation, as a
per-head norm after a column-parallel projection; a replicated bias after a row-parallel
layer) breaks that without any error: the ranks' copies drift apart step after step.
:func:`check_replicas` compares checksums of those parameters (and of their gradients) across
the group and names the ones that differ.

``TPX_CHECK_REPLICAS=1`` makes every model sharded by ``tpx.parallelize_module`` run the check
at the end of every backward and raise on the first difference (for debugging: one small
all-gather per backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from torch import nn

from .comm import collectives
from .comm.agree import tensor_checksum
from .layout.sharded import mesh_params, sharded_params
from .comm.groups import GroupLike, resolve_group
from .layout.param_dtensors import local_of

__all__ = ["check_replicas", "ReplicaMismatch", "watch_replicas"]


@dataclass(frozen=True)
class ReplicaMismatch:
    """A replicated parameter whose value (``what="value"``) or gradient (``"grad"``) is not the
    same on every rank: ``ranks`` hold another value than rank 0 of the group, and ``spread``
    is the largest relative difference of the checksums."""

    name: str
    what: str
    ranks: tuple
    spread: float

    def __str__(self) -> str:
        return (f"{self.name} ({self.what}): ranks {list(self.ranks)} differ from rank 0 "
                f"(checksums {self.spread:.2e} apart, relative)")


def _replicated(model: nn.Module):
    """(name, parameter) of every parameter no tpx layer shards, ordered by name (the same on
    every rank whatever order the model registered them in)."""
    sharded = {sh.key for sh in sharded_params(model)} | {ms.key for ms in mesh_params(model)}
    seen = set()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        if name in sharded or id(p) in seen:
            continue
        seen.add(id(p))
        yield name, p


def _default_group(model: nn.Module):
    for mod in model.modules():
        pg = getattr(mod, "group", None)
        if isinstance(pg, dist.ProcessGroup):
            return pg
    return None


def check_replicas(model: nn.Module, group: GroupLike = None, *, grads: bool = True,
                   strict: bool = False) -> List[ReplicaMismatch]:
    """Compares every parameter of ``model`` that no tpx layer shards (and, with ``grads``, its
    gradient) across the ranks of ``group`` and returns those that differ (an empty list when
    every replica agrees). Collective over ``group``: one all-gather of two float64 checksums
    per tensor (no tensor leaves its rank).

    ``group``: the TP group (default: the group of the model's 1-D tpx layers, else the
    default group). ``strict=True`` raises ``RuntimeError`` listing the mismatches instead of
    returning them. A parameter without a gradient on some ranks and with one on others is a
    mismatch too. Replicas are expected to be bitwise equal (tpx's reductions give every rank
    the same bits), so any difference is reported."""
    pg = resolve_group(group) if group is not None else (_default_group(model)
                                                          or resolve_group(None))
    rows, labels = [], []
    for name, p in _replicated(model):
        kinds = [("value", p)] + ([("grad", p.grad)] if grads and p.requires_grad else [])
        for what, t in kinds:
            if t is None:
                rows.append([float("nan"), float("nan"), 0.0])  # no gradient: flagged below
            else:
                total, magnitude = _sums(t)
                rows.append([total, magnitude, 1.0])
            labels.append((name, what))
    if pg.size() == 1 or not rows:
        return []
    mine = torch.tensor(rows, dtype=torch.float64)
    device = _device_of(model, pg)
    pieces = [torch.empty(mine.shape, dtype=torch.float64, device=device)
              for _ in range(pg.size())]
    collectives.all_gather(pieces, mine.to(device), pg)
    everyone = torch.stack([p.cpu() for p in pieces])
    found = []
    for i, (name, what) in enumerate(labels):
        ref = everyone[0, i]
        ranks, spread = [], 0.0
        for r in range(1, pg.size()):
            other = everyone[r, i]
            if other[2] != ref[2]:
                ranks.append(r)
                spread = float("inf")
                continue
            if ref[2] == 0:
                continue
            if not torch.equal(other[:2], ref[:2]):
                ranks.append(r)
                scale = max(float(ref[1].abs()), float(other[1].abs()), 1e-300)
                spread = max(spread, float((other[:2] - ref[:2]).abs().max()) / scale)
        if ranks:
            found.append(ReplicaMismatch(name, what, tuple(ranks), spread))
    if strict and found:
        raise RuntimeError("tpx.check_replicas: replicated parameters differ across the ranks "
                           "of the group:\n  " + "\n  ".join(map(str, found)) +
                           "\nA replicated parameter that sees only this rank's part of the "
                           "computation needs its gradient summed over the group (the style "
                           "tpx.ReplicatedWithGradAllReduce), or to be sharded.")
    return found


def _sums(t: torch.Tensor):
    """Two float64 fingerprints of a tensor's values: their sum, and the sum of values plus
    magnitudes (tpx.comm.agree.tensor_checksum); neither makes a full-size copy."""
    t = local_of(t).detach()  # a replicated DTensor: its local tensor is all of it
    total = float(torch.sum(t, dtype=torch.float64)) if t.numel() else 0.0
    value = tensor_checksum(t)
    return total, float(value if value is not None else 0.0)


def _device_of(model: nn.Module, pg) -> torch.device:
    try:
        backend = dist.get_backend(pg)
    except Exception:  # noqa: BLE001
        backend = "gloo"
    if "nccl" in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def watch_replicas(model: nn.Module, group: GroupLike = None) -> None:
    """Runs :func:`check_replicas` (``strict=True``) at the end of every backward that reaches
    a replicated parameter of ``model``. ``tpx.parallelize_module`` calls it when
    ``TPX_CHECK_REPLICAS=1``."""
    state = {"queued": False}

    def at_end():
        state["queued"] = False
        check_replicas(model, group, strict=True)

    def hook(grad):
        if not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(at_end)
        return grad

    for _, p in _replicated(model):
        if p.requires_grad:
            p.register_hook(hook)


