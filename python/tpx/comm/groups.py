"""Process groups: what tpx accepts as ``group``, how a dimension is sharded over its ranks
(:func:`shard_range`, :func:`shard_bounds`, :func:`head_rows`), and the 1-D ``DeviceMesh`` the
``DTensor`` s of a group live on. (Agreement across ranks: :mod:`tpx.comm.agree`; initial weights
from a source rank: :mod:`tpx.layout.initial`.)

``group`` everywhere in tpx accepts ``None`` (the default group), a
``torch.distributed.ProcessGroup`` or a 1-D ``torch.distributed.device_mesh.DeviceMesh``.
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..run import run_cache

try:  # DeviceMesh is importable on every supported torch, but keep the import soft.
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # pragma: no cover
    DeviceMesh = ()  # type: ignore[assignment,misc]

GroupLike = Union[None, "dist.ProcessGroup", "DeviceMesh"]

__all__ = ["GroupLike", "resolve_group", "shard_range", "shard_bounds", "shard_sizes", "head_rows",
           "head_split", "balanced_bounds", "group_ranks", "mesh_for_group", "remember_mesh", "SharesGroupOnCopy",
           "copied_with_module"]


# The groups this rank was found to be a member of (weakly held: a destroyed group drops out).
_MEMBER_OF: "weakref.WeakSet" = run_cache(weakref.WeakSet())


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
        pg = group.get_group()
        remember_mesh(pg, group)  # the DTensors of layers over pg live on this mesh
        return pg
    if isinstance(group, dist.ProcessGroup):
        if torch.compiler.is_compiling() or group in _MEMBER_OF:
            # traced code: the group was resolved when the layer was built (and torch 2.5's
            # compiler cannot trace a WeakSet lookup)
            return group
        if dist.get_rank(group) < 0:
            raise ValueError(
                "tpx: this rank is not a member of the `group` passed; every rank that calls a "
                "tpx op or builds a tpx module must belong to its group."
            )
        _MEMBER_OF.add(group)
        return group
    raise TypeError(
        "tpx: `group` must be None, a torch.distributed.ProcessGroup or a 1-D DeviceMesh; got "
        f"{type(group).__name__}."
    )


def group_ranks(pg: dist.ProcessGroup) -> Tuple[int, ...]:
    """The global ranks of ``pg``, in group-rank order."""
    return tuple(dist.get_process_group_ranks(pg))


# (group name, device type) -> (the group, its 1-D DeviceMesh).
_MESHES: dict = run_cache({})


def remember_mesh(pg: dist.ProcessGroup, mesh) -> None:
    """``mesh`` (a 1-D ``DeviceMesh`` whose group is ``pg``, as the user passed it) is the mesh
    of the ``DTensor`` s tpx builds over ``pg`` from now on (a sub-mesh of a ("dp", "tp") mesh
    keeps its parent, which FSDP2 needs)."""
    _MESHES[(pg.group_name, mesh.device_type)] = (pg, mesh)


def group_device_type(pg: dist.ProcessGroup) -> str:
    """The device type ``pg`` carries by default: "cuda" for a group with an NCCL backend (on a
    machine with CUDA), else "cpu"."""
    import torch

    return "cuda" if "nccl" in str(dist.get_backend(pg)) and torch.cuda.is_available() else "cpu"


def mesh_for_group(pg: dist.ProcessGroup, device_type: str, mesh=None):
    """The 1-D ``DeviceMesh`` over ``pg`` (``mesh`` itself when it is one over the same ranks).
    For tensors on the meta device (a model built there, materialized later), the mesh of the
    device they will have: the given mesh's, else the group's (:func:`group_device_type`), as
    PyTorch's meta initialization has it."""
    if device_type == "meta":
        device_type = getattr(mesh, "device_type", None) or group_device_type(pg)
    if mesh is not None and getattr(mesh, "ndim", None) == 1 and mesh.device_type == device_type:
        if tuple(mesh.mesh.flatten().tolist()) == group_ranks(pg):
            return mesh
    key = (pg.group_name, device_type)
    cached = _MESHES.get(key)
    if cached is None or cached[0] is not pg:  # a group of the same name made anew
        from torch.distributed.device_mesh import DeviceMesh

        cached = _MESHES[key] = (pg, DeviceMesh.from_group(pg, device_type))
    return cached[1]


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
    return shard_bounds(size, dist.get_rank(pg), pg.size())


def shard_bounds(size: int, rank: int, world: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s block when ``size`` entries are split over ``world``
    ranks in blocks of ``ceil(size / world)`` (the last blocks may be short or empty): the
    layout of :func:`shard_range`, for any rank."""
    per = -(-size // world) if size else 0
    start = min(rank * per, size)
    return start, min(start + per, size)


def shard_sizes(size: int, world: int) -> list:
    """The local sizes of every rank for a dimension of ``size`` sharded with ``shard_range``."""
    return [e - s for s, e in (shard_bounds(size, r, world) for r in range(world))]


def balanced_bounds(size: int, rank: int, world: int) -> Tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s block when ``size`` units are dealt as evenly as
    they go: the first ``size % world`` ranks take one more (20 over 8: 3,3,3,3,2,2,2,2)."""
    base, extra = divmod(size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def head_split(heads: int, kv_heads: int, world: int) -> List[Tuple[Tuple[int, int],
                                                                     Tuple[int, int]]]:
    """Per rank, ``((first query head, end), (first KV head, end))`` of attention with
    ``heads`` query heads reading ``kv_heads`` KV heads (``heads / kv_heads`` each) split over
    ``world`` ranks, the query heads of each rank reading whole KV heads it holds:

    * as many KV heads as ranks or more: the KV heads dealt as evenly as they go, each rank
      with their query heads (12 heads of multi-head attention at TP 8: 2,2,2,2,1,1,1,1);
    * fewer: the ranks dealt over the KV heads as evenly as they go, each KV head replicated
      on its ranks, and its query heads dealt among them (20 heads, 4 KV heads, TP 8: each
      KV head on 2 ranks, its 5 query heads as 3 and 2).

    When the counts divide, this is the usual even split (KV heads replicated when fewer than
    ranks). ``ValueError`` where a rank would hold no query head."""
    if heads % kv_heads:
        raise ValueError(f"the model has {heads} query heads and {kv_heads} KV heads: not a GQA "
                         "layout")
    if heads < world:
        raise ValueError(f"the model has {heads} attention heads, fewer than the TP size "
                         f"{world}: each rank needs at least one; use a TP size of at most "
                         f"{heads}")
    per_kv = heads // kv_heads
    out = []
    if kv_heads >= world:
        for r in range(world):
            ks, ke = balanced_bounds(kv_heads, r, world)
            out.append(((ks * per_kv, ke * per_kv), (ks, ke)))
        return out
    for r in range(world):
        kv = next(i for i in range(kv_heads) if balanced_bounds(world, i, kv_heads)[1] > r)
        first, end = balanced_bounds(world, kv, kv_heads)
        if per_kv < end - first:
            raise ValueError(
                f"the model has {heads} query heads over {kv_heads} KV heads: at TP size {world} "
                f"KV head {kv} is held by {end - first} ranks but reads {per_kv} query heads, "
                f"so a rank would hold none; use a TP size of at most {kv_heads * per_kv} that "
                "gives each KV head's ranks a query head each")
        qs, qe = balanced_bounds(per_kv, r - first, end - first)
        out.append(((kv * per_kv + qs, kv * per_kv + qe), (kv, kv + 1)))
    return out


def head_rows(segments: Sequence[int], head_size: Optional[int], replicate_heads: bool,
               world: int, heads: Optional[Tuple[int, int]] = None
               ) -> List[List[Tuple[int, int]]]:
    """Per rank, the row ranges it holds of a projection whose output is the concatenation of
    ``segments``, each split over the ranks separately (in whole heads of ``head_size`` when
    given; a segment with fewer heads than ranks is replicated when ``replicate_heads``).
    ``heads``: ``(query heads, KV heads)`` of the attention the projection feeds; each
    segment of that many heads is split as :func:`head_split` deals them (evenly where the
    counts divide, in blocks that differ by one head where they do not)."""
    rows: List[List[Tuple[int, int]]] = [[] for _ in range(world)]
    split = head_split(heads[0], heads[1], world) if heads is not None else None
    offset = 0
    for i, n in enumerate(segments):
        if split is not None and head_size is not None and n // head_size in heads \
                and n % head_size == 0:
            role = 0 if n // head_size == heads[0] else 1
            for r in range(world):
                s, e = split[r][role]
                rows[r].append((offset + s * head_size, offset + e * head_size))
        elif head_size is None:
            for r in range(world):
                s, e = shard_bounds(n, r, world)
                rows[r].append((offset + s, offset + e))
        else:
            if n % head_size:
                raise ValueError(f"tpx.ColwiseParallel: segment {i} has {n} features, not a whole "
                                 f"number of heads of head_size={head_size}")
            heads = n // head_size
            if heads % world == 0:
                per = heads // world
                for r in range(world):
                    rows[r].append((offset + r * per * head_size, offset + (r + 1) * per * head_size))
            elif replicate_heads and world % heads == 0:
                for r in range(world):
                    h = r * heads // world
                    rows[r].append((offset + h * head_size, offset + (h + 1) * head_size))
            else:
                extra = (" and the TP size is not a multiple of it either (KV heads can be "
                         "replicated only when it is)") if replicate_heads else ""
                raise ValueError(
                    f"tpx.ColwiseParallel: {heads} heads (head_size={head_size}) do not divide by "
                    f"the TP size {world}{extra}; choose a TP size that divides the head count")
        offset += n
    return rows


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


def _share_groups(value, memo) -> None:
    """Seeds ``memo`` so that ``copy.deepcopy(value, memo)`` shares the process groups it
    finds in ``value``: in the tuples, lists, dicts and sets within it and in the attributes
    of tpx's own objects (a style); a group cannot be copied (nor can a Python module a
    closure imported). ``nn.Module`` s copy themselves."""
    todo, seen = [value], set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        kind = type(x)
        if isinstance(x, (dist.ProcessGroup, types.ModuleType)):
            memo[id(x)] = x
        elif kind in (tuple, list, set, frozenset):
            todo.extend(x)
        elif kind is dict:
            todo.extend(x.keys())
            todo.extend(x.values())
        elif kind.__module__.split(".")[0] == "tpx" and hasattr(x, "__dict__") \
                and not isinstance(x, torch.nn.Module):
            todo.extend(vars(x).values())


def _copy_closure(fn, memo):
    """``fn`` (a function) with its closure's cells deep-copied under ``memo``: what it read of
    the module tree being copied becomes the copy's; process groups are shared. Cells two
    functions share stay shared between their copies; nested closures are copied too."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    if id(fn) in memo:
        return memo[id(fn)]
    cells = []
    for cell in fn.__closure__:
        new = memo.get(id(cell))
        if new is None:
            new = memo[id(cell)] = types.CellType()
            copy._keep_alive(cell, memo)  # noqa: SLF001 - the ids in memo must stay unique
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                pass
            else:
                if isinstance(value, types.FunctionType):
                    new.cell_contents = _copy_closure(value, memo)
                else:
                    _share_groups(value, memo)
                    new.cell_contents = copy.deepcopy(value, memo)
        cells.append(new)
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             tuple(cells))
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    out.__dict__.update(fn.__dict__)
    memo[id(fn)] = out
    copy._keep_alive(fn, memo)  # noqa: SLF001
    return out


class _CopiedWithModule(functools.partial):
    """A hook whose closure ``copy.deepcopy`` copies with the module it is registered on."""

    def __deepcopy__(self, memo):
        _share_groups((self.args, self.keywords), memo)
        return type(self)(_copy_closure(self.func, memo), *copy.deepcopy(self.args, memo),
                          **copy.deepcopy(self.keywords, memo))


def copied_with_module(fn):
    """``fn``, a hook tpx registers on a module, made to follow ``copy.deepcopy`` of that
    module: a copied model (an EMA copy, ``torch.optim.swa_utils.AveragedModel``) gets hooks
    that read and swap its own modules and parameters, not the original's. A plain function
    is copied by reference, closure and all; this one's closure is copied with the modules
    (process groups shared). Calls pass straight through (``functools.partial``)."""
    return _CopiedWithModule(fn)
