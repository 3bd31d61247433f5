"""How parameters and activations of the multi-dimensional layers are split over a mesh:
the hidden and batch mesh dims of a layout, each parameter's :class:`BlockSpec`, the shared
bookkeeping of the layers' parameters (initial weights from ``src_rank``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ... import mappings
from ...comm.agree import check_same_on_ranks
from ...layout.initial import load_initial, ShardSpec
from ...mesh import LAYOUTS, MeshInfo, check_mesh, mesh_layout
from ...run import run_cache
from ...layout.sharding import KeepsParamSharding, describe_params
from ...layout.param_dtensors import local_of


HIDDEN_3D = ("output", "weight")


def other_3d(hidden_mesh_dim: str) -> str:
    return "weight" if hidden_mesh_dim == "output" else "output"


def check_hidden_dim(who: str, hidden_mesh_dim: str) -> str:
    if hidden_mesh_dim not in HIDDEN_3D:
        raise ValueError(f"tpx.{who}: `hidden_mesh_dim` must be 'output' or 'weight' (the 3-D "
                         f"mesh dimension that splits the hidden features of the input); got "
                         f"{hidden_mesh_dim!r}")
    return hidden_mesh_dim


def mesh_splits(info: MeshInfo, hidden_mesh_dim: Optional[str]) -> Tuple[List[str], List[str]]:
    """The mesh dims splitting (batch dim 0, hidden dim -1), outermost first."""
    if info.layout == "2d":
        return ["row"], ["col"]
    if info.layout == "2.5d":
        return ["depth", "row"], ["col"]
    if info.layout == "3d":
        h = hidden_mesh_dim or "output"
        return ["input", other_3d(h)], [h]
    return [], []


def block_of(info: MeshInfo, dims: Sequence[str], coord: Optional[Dict[str, int]] = None
           ) -> Tuple[int, int]:
    """(block index, number of blocks) for a tensor dim split by ``dims`` (outermost first), of
    this rank or of the rank at ``coord``."""
    coord = info.coord if coord is None else coord
    idx, count = 0, 1
    for d in dims:
        size = info.q if d != "depth" else info.depth
        idx, count = idx * size + coord[d], count * size
    return idx, count


# How a parameter is split over the mesh, for initial weights and checkpoints ------------------


@dataclass
class BlockSpec:
    """How one parameter of a multi-dimensional layer is split over its mesh.

    ``splits[d]`` lists the mesh dimensions that split dim ``d`` of the parameter, outermost
    first (block index ``c[splits[d][0]] * size + c[splits[d][1]]`` for a rank at coordinates
    ``c``); an empty tuple means the dim is whole on every rank. The parameter is replicated
    over every mesh dimension that splits none of its dims. ``full_shape`` is the shape of
    the ORIGINAL module's tensor (``nn.Linear`` weight ``[out, in]``, norm weight ``[H]``,
    embedding ``[V, D]``); the local tensor is this rank's block of it, same orientation."""

    name: str
    splits: Tuple[Tuple[str, ...], ...]
    full_shape: Tuple[int, ...]

    def ranges(self, info: MeshInfo, coord: Optional[Dict[str, int]] = None
               ) -> Tuple[Tuple[int, int], ...]:
        """Per dim, the ``(start, end)`` of the full tensor held by this rank (or ``coord``)."""
        out = []
        for size, dims in zip(self.full_shape, self.splits):
            idx, count = block_of(info, dims, coord)
            n = size // count
            out.append((idx * n, (idx + 1) * n))
        return tuple(out)

    def slice_of(self, full: Tensor, info: MeshInfo) -> Tensor:
        """This rank's block of the full tensor (a view)."""
        return full[tuple(slice(s, e) for s, e in self.ranges(info))]

    def gather(self, local: Tensor, info: MeshInfo) -> Tensor:
        """The full tensor from every rank's block (mesh all-gathers over the splitting dims;
        collective over them)."""
        t = local.detach().contiguous()
        for d, dims in enumerate(self.splits):
            if dims:
                t = gather_block_dim(t, info, d, dims)
        return t


def block_specs(module: nn.Module) -> List[BlockSpec]:
    """The :class:`BlockSpec` of every parameter ``module`` holds (absent ones skipped)."""
    return [s for s in module._param_splits() if getattr(module, s.name, None) is not None]


_MESH_GROUPS: Dict[Tuple[int, ...], Tuple[object, "dist.ProcessGroup"]] = run_cache({})


def tp_mesh_group(info: MeshInfo) -> "dist.ProcessGroup":
    """A process group of all the mesh's ranks: the default group when the mesh spans it
    (as ``tpx.init_mesh`` builds it), else one group built once per set of ranks (every rank
    of the mesh takes part in building it)."""
    world = dist.group.WORLD
    ranks = tuple(sorted(info.ranks))
    if ranks == tuple(range(dist.get_world_size())):
        return world
    cached = _MESH_GROUPS.get(ranks)
    if cached is not None and cached[0] is world:
        return cached[1]
    pg = dist.new_group(list(ranks), use_local_synchronization=True)
    _MESH_GROUPS[ranks] = (world, pg)
    return pg


def _check_src_rank(who: str, src_rank, info: MeshInfo) -> None:
    n = len(info.ranks)
    if src_rank is None:
        return
    if not isinstance(src_rank, int) or isinstance(src_rank, bool) or not 0 <= src_rank < n:
        raise ValueError(f"tpx.{who}: `src_rank` must be None or the index of a rank of the "
                         f"mesh, an int in [0, {n}) (for a mesh from tpx.init_mesh, the global "
                         f"rank); got {src_rank!r}. It names the rank whose full initial "
                         f"weights every rank takes its block of.")


class MeshParams(KeepsParamSharding):
    """Construction of a multi-dimensional layer's parameters from full tensors of one rank.

    ``_begin`` validates the mesh and compares the layer's arguments across the mesh's ranks
    (one small collective, so that a mismatch raises the same error everywhere instead of
    hanging a later collective); ``_fill`` gives every rank its block of the full tensors of
    mesh rank ``src_rank`` (chunked scatters over a group of all the mesh's ranks, see
    :func:`tpx.layout.initial.load_initial`), or with ``src_rank=None`` its block of its own full
    tensors, with no communication of weights (the ranks' tensors must then agree: a checksum
    is compared)."""

    _tpx_dtensor_params = True  # each block is a DTensor over the layer's mesh

    def _begin(self, mesh, who: str, args: dict, src_rank) -> MeshInfo:
        info = check_mesh(mesh, self._layout, who)
        pg = tp_mesh_group(info)
        check_same_on_ranks(pg, who, dict(args, layout=self._layout, mesh=info.ranks,
                                          src_rank=src_rank))
        _check_src_rank(who, src_rank, info)
        self.src_rank = src_rank
        return info

    @classmethod
    def _converted(cls, mesh, src_rank, args: dict, configure: Callable[[Any], None],
                   params: Dict[str, Optional[Tensor]]):
        """The layer made from an unsharded module (``from_linear``, ``from_layernorm``, ...):
        ``args`` are compared across the mesh's ranks, ``configure(layer)`` sets up the layout
        and the layer's attributes, and every parameter of ``params`` that is not None gets
        this rank's block of rank ``src_rank``'s tensor (``None``: of this rank's own)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        who = cls.__name__
        self._begin(mesh, who, args, src_rank)
        configure(self)
        present = [name for name, t in params.items() if t is not None]
        first = params[present[0]] if present else None
        self._alloc(present, None if first is None else first.device,
                    None if first is None else first.dtype)
        self._fill(who, self._layer_config(), lambda: params, drawn=False)
        return self

    def _alloc(self, names: Sequence[str], device, dtype) -> None:
        """Registers an uninitialised local block for every parameter in ``names`` (the
        others are None)."""
        for spec in self._param_splits():
            if spec.name in names:
                shape = [e - s for s, e in spec.ranges(self.mesh_info)]
                setattr(self, spec.name, nn.Parameter(torch.empty(shape, device=device,
                                                                  dtype=dtype)))
            else:
                self.register_parameter(spec.name, None)

    def _fill(self, who: str, config: dict,
              full_fn: Callable[[], Dict[str, Optional[Tensor]]], *, drawn: bool) -> None:
        describe_params(self)  # each parameter knows its layout (tpx.layout.sharding)
        info = self.mesh_info
        pg = tp_mesh_group(info)
        specs = block_specs(self)
        if not specs:
            return
        ranks = [dist.get_global_rank(pg, g) for g in range(pg.size())]
        coords = [info.coord_of(info.ranks.index(r)) for r in ranks]
        shard_specs = [ShardSpec(local_of(getattr(self, s.name)),
                                 blocks=[s.ranges(info, c) for c in coords]) for s in specs]
        src = self.src_rank
        if src is not None:
            src = dist.get_group_rank(pg, info.ranks[src])

        def fulls():
            full = full_fn()
            return [full[s.name].detach() for s in specs]

        config = dict(config, layout=self._layout, dtype=str(getattr(self, specs[0].name).dtype))
        load_initial(pg, who, config, shard_specs, fulls, src_rank=src, drawn=drawn)


def block_mesh_info(mesh, who: str) -> MeshInfo:
    if isinstance(mesh, MeshInfo):  # validated when it was made (the styles' hooks pass it)
        return mesh
    layout = mesh_layout(mesh) if hasattr(mesh, "mesh_dim_names") else None
    if layout is None:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"tpx.{who}: `mesh` must be a DeviceMesh built by tpx.init_mesh, with "
                         f"dimension names one of {list(LAYOUTS.values())}; got names {names}")
    return check_mesh(mesh, layout, who)


def check_divides(who: str, what: str, size: int, parts: int, how: str) -> None:
    if size % parts != 0:
        raise ValueError(f"tpx.{who}: {what} = {size} must divide by {parts} ({how}); pad or "
                         f"choose a size that is a multiple of {parts}")


def gather_block_dim(t: Tensor, info: MeshInfo, dim: int, dims: Sequence[str]) -> Tensor:
    """The blocks of ``t`` along ``dim`` gathered over the mesh dims ``dims`` (no autograd)."""
    return mappings.gather_over_names(t, dim, [info.group_name(d) for d in dims])
