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

import contextlib
import threading
import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..mappings import gather_dim
from .param_dtensors import (as_dtensor, cut, local_of, mesh_placements, replace_param,
                             strided_placement)
from .dtensor_io import DTensor, Replicate, Shard

__all__ = ["ATTR", "GroupSharding", "MeshSharding", "sharding_of", "describe_params",
           "KeepsParamSharding", "collect_unstated", "raw_state_dict", "unstated_layouts"]

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
    in_dtensor: bool = False  # the parameter is a DTensor whose placements say all of this
    transposed: bool = False  # the original model stores the transpose (HF Conv1D's weight)

    def full_size(self) -> int:
        """Entries of the full tensor along ``dim``."""
        return self.full_shape[self.dim]

    def orig_dim(self) -> int:
        """The sharded dim in the original model's orientation."""
        return 1 - self.dim if self.transposed else self.dim

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the full tensor in the ORIGINAL orientation."""
        d = self.orig_dim()
        pieces = [full.narrow(d, s, e - s) for s, e in self.rows[self.rank]]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
        return out.t() if self.transposed else out

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The full tensor in the original orientation, assembled from every rank's ``local``
        (a tensor of this rank's local shape). Collective over ``group``."""
        local = local.detach()
        sizes = [sum(e - s for s, e in r) for r in self.rows]
        gathered = gather_dim(local, self.dim, sizes, sum(sizes[:self.rank]), self.group)
        flat = [r for ranges in self.rows for r in ranges]
        if all(a[1] == b[0] for a, b in zip(flat, flat[1:])) and flat[0][0] == 0:
            full = gathered  # ranks hold consecutive blocks: the gather is the full tensor
        else:
            shape = list(local.shape)
            shape[self.dim] = self.full_size()
            full = local.new_empty(shape)
            offset = 0
            for ranges in self.rows:
                for s, e in ranges:
                    full.narrow(self.dim, s, e - s).copy_(gathered.narrow(self.dim, offset, e - s))
                    offset += e - s
        return full.t() if self.transposed else full

    @property
    def chunked(self) -> bool:
        """Whether every rank holds ``shard_range`` of ``dim``: the layout ``Shard(dim)`` of a
        ``DTensor`` describes."""
        world = len(self.rows)
        full = self.full_shape[self.dim]
        per = -(-full // world) if full else 0
        for r, ranges in enumerate(self.rows):
            start = min(r * per, full)
            if tuple(ranges) != ((start, min(start + per, full)),):
                return False
        return True

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

    def dtensor(self, local: torch.Tensor) -> "DTensor":
        """``local`` (a tensor of the block's shape: the parameter, or an optimizer state of
        it) as a ``DTensor`` of the full shape over the layer's mesh, sharing ``local``'s
        storage when it is contiguous: mesh dimension ``m`` is ``Shard(d)`` when it splits
        dim ``d``, else ``Replicate()``. A dim split by two mesh dimensions against the mesh's
        order (3-D weight rows, split by "output" then "input") is torch's nested layout, as
        FSDP2 states a dim it splits inside TP's blocks: ``_StridedShard(d, split_factor=``
        the outer one's size ``)`` on the inner (left) one, ``Shard(d)`` on the outer. So every
        parameter of a layout lives on one mesh, which torch's ``clip_grad_norm_`` needs.
        Where this torch's ``DTensor`` does not state that layout exactly, the ``DTensor``
        lives on the same ranks and process groups with its dimensions permuted."""
        from ..mesh import block_mesh

        info, spec = self.info, self.spec
        local = local_of(local).detach()
        device_type = info.device_type if local.is_meta else local.device.type
        shape = torch.Size(spec.full_shape)
        stride = torch.empty(shape, device="meta").stride()
        order, placements = mesh_placements(self.spec, self.info)
        mesh = block_mesh(info, order, device_type)
        return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                                  shape=shape, stride=stride)

    def __deepcopy__(self, memo) -> "MeshSharding":
        return self



def sharding_of(param) -> Optional[object]:
    """The description tpx attached to ``param`` (``None``: replicated)."""
    return getattr(param, ATTR, None)


def _attach(param: Optional[nn.Parameter], desc) -> None:
    if param is not None:
        setattr(param, ATTR, desc)


def group_layouts(module: nn.Module) -> Iterator[Tuple[str, GroupSharding]]:
    """``(name, layout)`` of each parameter a 1-D layer shards, from the layer's own
    ``_shards()`` (name, sharded dim, each rank's row ranges) and ``_transposed_weight`` (a
    layer made from a Hugging Face ``Conv1D``, whose weight the original model stores as
    ``[in, out]``): the one description checkpoints, clipping and the state-dict hooks read.
    Nothing for a module that is not such a layer."""
    if not hasattr(module, "_shards") or not hasattr(module, "group"):
        return
    rank = dist.get_rank(module.group)
    for name, dim, rows in module._shards():
        param = getattr(module, name, None)
        if param is None:
            continue
        rows_t = tuple(tuple((int(s), int(e)) for s, e in r) for r in rows)
        full = list(local_of(param).shape)
        full[dim] = max((e for r in rows_t for _, e in r), default=0)
        yield name, GroupSharding(module.group, dim, rows_t, tuple(full), rank,
                                  transposed=_transposed(module, name))


def mesh_layouts(module: nn.Module, present_only: bool = True
                 ) -> Iterator[Tuple[str, MeshSharding]]:
    """``(name, layout)`` of each parameter of a multi-dimensional layer, from its own
    ``_param_splits()`` (``present_only``: only the parameters it has, not a bias it was built
    without). Nothing for a module that is not such a layer."""
    if not hasattr(module, "_param_splits") or not hasattr(module, "mesh_info"):
        return
    for spec in module._param_splits():
        if not present_only or getattr(module, spec.name, None) is not None:
            yield spec.name, MeshSharding(spec, module.mesh_info)


def lays_out_params(module: nn.Module) -> bool:
    """Whether ``module`` says how its parameters are split: a tpx layer (``_shards()`` of a
    1-D layout, ``_param_splits()`` of a multi-dimensional one), or a model's module a tpx
    style sharded in place (experts)."""
    return hasattr(module, "_shards") or hasattr(module, "_param_splits")


# How a model sharded by tpx is written (the state layer, above this one, registers its writers
# when tpx is imported): "model" -> fn(model, save_directory, max_shard_size=...) for
# ``save_pretrained`` of a Hugging Face model; "adapters" -> fn(peft_model, save_directory,
# **options) for peft's ``save_pretrained`` of a model whose layers tpx shards.
_SHARDED_SAVE: Dict[str, object] = {}


def register_sharded_save(kind: str, fn) -> None:
    """Sets the writer of ``kind`` ("model" or "adapters") a sharded model's
    ``save_pretrained`` calls."""
    if kind not in ("model", "adapters"):
        raise ValueError(f"register_sharded_save: kind must be 'model' or 'adapters', got {kind!r}")
    _SHARDED_SAVE[kind] = fn


def sharded_save(kind: str):
    """The writer registered for ``kind``."""
    return _SHARDED_SAVE[kind]


def sharded_by_tpx(module: nn.Module) -> bool:
    """Whether a module of ``module``'s tree has its parameters laid out by tpx."""
    return any(lays_out_params(m) for m in module.modules())


def params_laid_out_by(module: nn.Module) -> List[torch.Tensor]:
    """The parameters whose placement ``module`` decides: all of a tpx layer's; of a model's
    module a tpx style sharded in place (experts, an attention's per-head parameters), the
    ones its ``_shards()`` names (a norm inside keeps its own, unsharded)."""
    if not lays_out_params(module):
        return []
    if hasattr(module, "_shards") and not type(module).__module__.startswith("tpx."):
        return [p for p in (getattr(module, n, None) for n, _, _ in module._shards())
                if isinstance(p, torch.Tensor)]
    return list(module.parameters())


def mark_transposed_weight(module: nn.Module) -> None:
    """Records that the original model stores ``module``'s weight transposed (a Hugging Face
    ``Conv1D``, ``[in, out]``): its state dict, checkpoints and clipping then speak that
    orientation."""
    module._transposed_weight = True
    describe_params(module)


def describe_params(module: nn.Module) -> None:
    """Attaches the description of each parameter ``module`` shards, from the module's own
    ``_param_splits()`` (multi-dimensional layers) or ``_shards()`` (1-D layers).

    A 1-D layer that computes through :func:`local_params` (``_tpx_dtensor_params``) gets its
    parameters as ``DTensor`` s where torch's placements say the whole layout: a parameter
    split with ``shard_range`` becomes ``Shard(dim)`` of its global shape, a replicated one
    (a row-parallel bias) ``Replicate()``, both on the layer's 1-D mesh; fused segments each
    split by ``shard_range`` along a dim other than 0 torch's ``_StridedShard``
    (:func:`dtensor_placement`). Parameters split another way (segments along dim 0, rows held
    by several ranks) stay this rank's plain tensor, described here."""
    if hasattr(module, "_param_splits") and hasattr(module, "mesh_info"):
        for name, desc in mesh_layouts(module, present_only=False):
            param = getattr(module, name, None)
            if (param is not None and getattr(module, "_tpx_dtensor_params", False)
                    and not isinstance(param, DTensor)):
                param = replace_param(module, name, desc.dtensor(param))
            _attach(param, desc)
        return
    in_dtensors = getattr(module, "_tpx_dtensor_params", False)
    sharded = set()
    for name, desc in group_layouts(module):
        param = getattr(module, name)
        sharded.add(name)
        placement = dtensor_placement(desc) if in_dtensors else None
        if placement is not None:
            desc = dataclasses.replace(desc, in_dtensor=True)
            if not isinstance(param, DTensor):
                param = replace_param(module, name, as_dtensor(param, module.group, placement,
                                                                 desc.full_shape))
        _attach(param, desc)
    if in_dtensors:
        for name, param in list(module._parameters.items()):
            if param is not None and name not in sharded and not isinstance(param, DTensor):
                replace_param(module, name, as_dtensor(param, module.group, Replicate(),
                                                         tuple(param.shape)))
    if sharded and not isinstance(module, KeepsParamSharding):
        # a module tpx split in place (a mixer's convolution, its per-head vectors): its
        # state_dict() speaks the full names too, or raises; never this rank's rows alone
        guard_state_dict(module)


_RAW = threading.local()


@contextlib.contextmanager
def raw_state_dict():
    """Within this block, ``state_dict()`` of tpx's layers gives each parameter as the layer
    stores it (a ``DTensor`` in the layer's orientation, or this rank's plain tensor), for tpx's
    own checkpoint code that reads every layer's layout itself."""
    before = getattr(_RAW, "on", False)
    _RAW.on = True
    try:
        yield
    finally:
        _RAW.on = before


def _full_shape_original(module, name: str, desc) -> Tuple[int, ...]:
    shape = tuple(desc.full_shape)
    return shape[::-1] if _transposed(module, name) else shape


def _transposed(module, name: str) -> bool:
    return name == "weight" and getattr(module, "_transposed_weight", False)


class KeepsParamSharding:
    """Mixin of the tpx layers: a ``Parameter`` assigned to an attribute that holds a
    described parameter inherits the description (unless it has its own); ``state_dict()``
    and ``load_state_dict()`` speak the unsharded model's names, shapes and orientation.

    In ``state_dict()`` a ``DTensor`` parameter is that ``DTensor`` (transposed back for a
    layer made from a Hugging Face ``Conv1D``: a view, so an in-place
    ``torch.distributed.checkpoint.load`` still reaches the parameter); a block of a
    multi-dimensional layer is a ``DTensor`` over its mesh (also a view); fused segments split
    separately along a dim other than 0 are a ``_StridedShard`` ``DTensor``. A parameter whose
    layout no ``DTensor`` says (segments split separately along dim 0, rows held by several
    ranks) raises: its local tensor under the full name would be a checkpoint that
    reloads to a different model. ``load_state_dict()`` takes ``DTensor`` s, or FULL tensors
    (each rank keeps its part; no communication)."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, nn.Parameter) and not hasattr(value, ATTR):
            params = self.__dict__.get("_parameters")
            old = params.get(name) if params else None
            desc = getattr(old, ATTR, None)
            if desc is not None:
                setattr(value, ATTR, desc)
        super().__setattr__(name, value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        present_state(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        take_state(self, state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def present_state(module: nn.Module, destination, prefix: str) -> None:
    """Rewrites the entries of ``module``'s own parameters in ``destination`` (what
    ``state_dict()`` gathered) into the unsharded model's shapes and orientation: a
    ``DTensor`` (a view of the parameter, no communication) wherever one states the layout;
    raises where none can (see :class:`KeepsParamSharding`)."""
    if getattr(_RAW, "on", False):
        return
    layouts = None
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in destination:
            continue
        desc = sharding_of(param)
        value = destination[key]
        if isinstance(param, DTensor):
            # A DTensor tpx did not make (FSDP2's, over the data-parallel mesh) of a parameter
            # tpx split in a layout no DTensor states: it states the data-parallel split only.
            if layouts is None:
                layouts = dict(unstated_layouts(module))
            lay = layouts.get(name)
            if lay is None and not _distinct_dims(value):
                mine = dict(group_layouts(module)).get(name)
                if mine is not None and not mine.chunked:
                    # FSDP2 split the dim tpx splits in segments: no DTensor states the two
                    raise _layout_not_stated(module, name, key, mine, fsdp=True)
            if lay is not None:
                unstated = getattr(_RAW, "unstated", None)
                if unstated is None:
                    raise _layout_not_stated(module, name, key, lay, fsdp=True)
                unstated.append((key, lay))  # the caller gathers it over the TP group
                continue
            if _transposed(module, name):
                destination[key] = value.t()
        elif isinstance(desc, MeshSharding):
            destination[key] = desc.dtensor(value)
        elif isinstance(desc, GroupSharding) and desc.group.size() > 1:
            if not desc.chunked:
                raise _layout_not_stated(module, name, key, desc, fsdp=False)
            dt = as_dtensor(value, desc.group, Shard(desc.dim), desc.full_shape)
            destination[key] = dt.t() if _transposed(module, name) else dt


@contextlib.contextmanager
def collect_unstated():
    """Within this block, ``state_dict()`` of a model FSDP2 shards too gives a parameter tpx
    split in a layout no ``DTensor`` states as FSDP2 gives it (this rank's TP part, split over
    the data-parallel mesh) instead of raising, and lists ``(key, layout)`` of each in the
    list this yields, for tpx's own code to gather them over the TP group."""
    before = getattr(_RAW, "unstated", None)
    _RAW.unstated = []
    try:
        yield _RAW.unstated
    finally:
        _RAW.unstated = before


def unstated_layouts(module: nn.Module) -> Iterator[Tuple[str, GroupSharding]]:
    """``(name, layout)`` of each parameter of the 1-D layer ``module`` split over more than one
    rank in a layout no ``DTensor`` states (fused segments split separately, rows held by
    several ranks: such a parameter stays this rank's plain tensor)."""
    in_dtensors = getattr(module, "_tpx_dtensor_params", False)
    for name, lay in group_layouts(module):
        if lay.group.size() > 1 and not (in_dtensors and dtensor_placement(lay) is not None):
            yield name, lay


def dtensor_placement(lay: GroupSharding):
    """The placement of the ``DTensor`` that states ``lay`` on the layer's 1-D mesh:
    ``Shard(dim)`` for ``shard_range`` rows; torch's ``_StridedShard`` for fused segments each
    split by ``shard_range`` into equal pieces along a dim other than 0 (FSDP2 shards dim 0
    by default, and its ``DTensor`` of a strided split of that same dim would not say where
    the rows are); ``None`` where no placement states it (it stays this rank's plain
    tensor)."""
    if lay.chunked:
        return Shard(lay.dim)
    if lay.dim == 0 or lay.transposed:
        return None
    return strided_placement(lay.dim, lay.rows, lay.full_size())


def _layout_not_stated(module, name: str, key: str, desc: GroupSharding, fsdp: bool):
    what = " (its DTensor, FSDP2's, states the data-parallel split only)" if fsdp else ""
    return RuntimeError(
        f"tpx: {type(module).__name__}.{name} ({key!r}) is split over its TP group in a layout "
        f"a DTensor cannot state{what} (each rank holds the rows {list(desc.rows[desc.rank])} "
        f"of {desc.full_shape[desc.dim]}: segments split separately, or rows held by several "
        "ranks), so state_dict() cannot give it under its full name without gathering. "
        + "Save with tpx.checkpoint.save(model, path) (torch.distributed.checkpoint, any TP "
          "degree on load), or take the full model with tpx.checkpoint.full_state_dict(model, "
          "rank0_only=True) (for save_pretrained: pass it as state_dict=)")


def _distinct_dims(dt) -> bool:
    dims = [p.dim for p in dt.placements if not p.is_replicate()]
    return len(dims) == len(set(dims))


def take_state(module: nn.Module, state_dict, prefix: str) -> None:
    """Rewrites, in the (already copied) ``state_dict`` that ``load_state_dict`` hands down,
    the entries of ``module``'s own parameters into the form each is stored in: a ``DTensor``
    or a full tensor becomes this rank's part (no communication unless a ``DTensor`` in
    another layout must be gathered)."""
    for name, param in module._parameters.items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, torch.Tensor):
            state_dict[key] = _to_stored(module, name, param, value)


def guard_state_dict(module: nn.Module) -> None:
    """Gives a module tpx shards but did not write (a model's experts) the state dict rules of
    tpx's own layers (:class:`KeepsParamSharding`), as hooks."""
    if getattr(module, "_tpx_state_hooks", False):
        return
    module._register_state_dict_hook(
        lambda mod, destination, prefix, _meta: present_state(mod, destination, prefix))
    module._register_load_state_dict_pre_hook(
        lambda mod, state_dict, prefix, *_: take_state(mod, state_dict, prefix),
        with_module=True)
    module._tpx_state_hooks = True


def _to_stored(module, name: str, param, value):
    """``value`` (a full tensor or a ``DTensor`` of the original orientation) in the form the
    parameter is stored; ``value`` itself when it is already in that form (or cannot be
    converted: the loader then reports the shape that disagrees)."""
    desc = sharding_of(param)
    if _raw_loading():
        return value
    if isinstance(param, DTensor):
        if _transposed(module, name):
            value = value.t()
        if isinstance(value, DTensor) or tuple(value.shape) != tuple(param.shape):
            return value
        return cut(value, param)  # this rank's part, no communication
    if isinstance(desc, MeshSharding):
        if isinstance(value, DTensor):
            mine = desc.dtensor(param.detach())
            if value._spec == mine._spec:
                return value._local_tensor
            value = value.full_tensor()
        if tuple(value.shape) == tuple(desc.full_shape):
            return desc.spec.slice_of(value, desc.info)
        return value
    if isinstance(desc, GroupSharding):
        if isinstance(value, DTensor):
            v = value.t() if _transposed(module, name) else value
            if (desc.chunked and tuple(v.placements) == (Shard(desc.dim),)
                    and tuple(v.shape) == tuple(desc.full_shape)
                    and v.device_mesh.mesh.flatten().tolist()
                    == dist.get_process_group_ranks(desc.group)):
                return v._local_tensor  # this rank's rows, as stored
            value = value.full_tensor()
        if _transposed(module, name):
            if tuple(value.shape) != tuple(desc.full_shape)[::-1]:
                return value
            value = value.t()
        if tuple(value.shape) != tuple(desc.full_shape) or desc.group.size() == 1:
            return value
        pieces = [value.narrow(desc.dim, s, e - s) for s, e in desc.rows[desc.rank]]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, desc.dim)
    return value


def _raw_loading() -> bool:
    return getattr(_RAW, "on", False)
