"""How a parameter of a tpx layer is laid out over ranks, read from the parameter itself.

Every parameter a tpx layer shards carries a description in the attribute ``_tpx_sharding``
(:data:`ATTR`), derived from the layer's own layout data (``_shards()`` of the 1-D layers,
``_param_splits()`` of the multi-dimensional ones): which ranks hold which part of the full
tensor, over which process groups the parts are spread, and which ranks hold replicas.
Functions that receive parameters rather than modules (gradient clipping) read it. A
parameter without a description is replicated: every rank holds all of it, with the same
values (a row-parallel bias, a norm weight under ``SequenceParallel``).

A parameter put into a tpx layer in place of one that carries a description inherits it
(``fully_shard`` swapping in its ``DTensor`` parameters, ``parallelize_module`` keeping the
original ``Parameter`` objects).

Two kinds:

- :class:`GroupSharding` (1-D layers): the local tensor is rows ``rows[rank]`` (concatenated)
  of the full tensor along ``dim``, over ``group``. Rows held by several ranks (replicated KV
  heads of a GQA projection) are counted, where each element must count once, on the lowest
  rank holding them (:meth:`GroupSharding.owned`).
- :class:`MeshSharding` (2-D, 2.5-D, 3-D layers): the local tensor is one block of the full
  tensor (:class:`tpx.nn.multidim.BlockSpec`), replicated over the mesh dimensions that split
  none of its dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist
from torch import nn

__all__ = ["ATTR", "GroupSharding", "MeshSharding", "sharding_of", "describe_params",
           "KeepsParamSharding"]

ATTR = "_tpx_sharding"

Ranges = Tuple[Tuple[int, int], ...]


@dataclass(frozen=True, eq=False)
class GroupSharding:
    """A parameter of a 1-D tpx layer: this rank (``rank`` of ``group``) holds rows
    ``rows[rank]`` of the full tensor along ``dim``, concatenated in that order; the other
    dims are whole. ``full_shape`` is the full tensor's shape in the local orientation."""

    group: dist.ProcessGroup
    dim: int
    rows: Tuple[Ranges, ...]
    full_shape: Tuple[int, ...]
    rank: int

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = sum(e - s for s, e in self.rows[self.rank])
        return tuple(shape)

    @property
    def replicated_rows(self) -> bool:
        """Whether some row is held by more than one rank."""
        seen = sorted(r for ranges in self.rows for r in ranges if r[1] > r[0])
        return any(b[0] < a[1] for a, b in zip(seen, seen[1:]))

    def owned(self) -> Optional[List[Tuple[int, int]]]:
        """The ``(start, end)`` ranges of the LOCAL tensor along ``dim`` whose rows this rank
        counts when each row must count once (a row held by several ranks counts on the
        lowest of them); ``None`` when every local row is this rank's alone."""
        if not self.replicated_rows:
            return None
        out: List[Tuple[int, int]] = []
        offset = 0
        for s, e in self.rows[self.rank]:
            cuts = {s, e}
            for r in range(self.rank):
                for a, b in self.rows[r]:
                    cuts.update(c for c in (a, b) if s < c < e)
            points = sorted(cuts)
            for a, b in zip(points, points[1:]):
                held_before = any(x <= a and b <= y for r in range(self.rank)
                                  for x, y in self.rows[r])
                if not held_before:
                    if out and out[-1][1] == offset + a - s:
                        out[-1] = (out[-1][0], offset + b - s)
                    else:
                        out.append((offset + a - s, offset + b - s))
            offset += e - s
        return out

    def reduce_groups(self) -> List[dist.ProcessGroup]:
        """The groups over which the per-rank parts add up to the whole."""
        return [self.group] if self.group.size() > 1 else []

    def __deepcopy__(self, memo) -> "GroupSharding":
        return self  # immutable; a copied layer shares its group


@dataclass(frozen=True, eq=False)
class MeshSharding:
    """A parameter of a multi-dimensional tpx layer: ``spec`` (a
    :class:`tpx.nn.multidim.BlockSpec`) says which mesh dimensions split each of its dims,
    ``info`` (a :class:`tpx.mesh.MeshInfo`) gives this rank's coordinates and the groups."""

    spec: object
    info: object

    @property
    def full_shape(self) -> Tuple[int, ...]:
        return tuple(self.spec.full_shape)

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(e - s for s, e in self.spec.ranges(self.info))

    @property
    def replicated_over(self) -> Tuple[str, ...]:
        """The mesh dimensions over which the block is replicated."""
        used = {d for dims in self.spec.splits for d in dims}
        return tuple(n for n in self.info.names if n not in used)

    def owned(self) -> None:
        return None  # blocks do not overlap; replicas are left out of reduce_groups

    def reduce_groups(self) -> List[dist.ProcessGroup]:
        out: List[dist.ProcessGroup] = []
        for dims in self.spec.splits:
            for d in dims:
                g = self.info.groups[d]
                if g.size() > 1 and all(g is not o for o in out):
                    out.append(g)
        return out

    def __deepcopy__(self, memo) -> "MeshSharding":
        return self


def sharding_of(param) -> Optional[object]:
    """The description tpx attached to ``param`` (``None``: replicated)."""
    return getattr(param, ATTR, None)


def _attach(param: Optional[nn.Parameter], desc) -> None:
    if param is not None:
        setattr(param, ATTR, desc)


def describe_params(module: nn.Module) -> None:
    """Attaches the description of each parameter ``module`` shards, from the module's own
    ``_param_splits()`` (multi-dimensional layers) or ``_shards()`` (1-D layers)."""
    if hasattr(module, "_param_splits") and hasattr(module, "mesh_info"):
        for spec in module._param_splits():
            _attach(getattr(module, spec.name, None), MeshSharding(spec, module.mesh_info))
        return
    if not hasattr(module, "_shards") or not hasattr(module, "group"):
        return
    rank = dist.get_rank(module.group)
    for name, dim, rows in module._shards():
        param = getattr(module, name, None)
        if param is None:
            continue
        rows_t = tuple(tuple((int(s), int(e)) for s, e in r) for r in rows)
        full = list(param.shape)
        full[dim] = max((e for r in rows_t for _, e in r), default=0)
        _attach(param, GroupSharding(module.group, dim, rows_t, tuple(full), rank))


class KeepsParamSharding:
    """Mixin of the tpx layers: a ``Parameter`` assigned to an attribute that holds a
    described parameter inherits the description (unless it has its own)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, nn.Parameter) and not hasattr(value, ATTR):
            params = self.__dict__.get("_parameters")
            old = params.get(name) if params else None
            desc = getattr(old, ATTR, None)
            if desc is not None:
                setattr(value, ATTR, desc)
        super().__setattr__(name, value)
