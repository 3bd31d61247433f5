"""Device meshes of the tensor-parallel layouts, and the checks a multi-dimensional layer runs
on the mesh it is given.

=========  ============  ==============================  ================================
layout     ranks         mesh dimension names            shape
=========  ============  ==============================  ================================
``1d``     P             ``("tp",)``                     ``(P,)``
``2d``     q*q           ``("row", "col")``              ``(q, q)``
``2.5d``   d*q*q         ``("depth", "row", "col")``     ``(d, q, q)``
``3d``     q*q*q         ``("input", "weight", "output")``  ``(q, q, q)``
=========  ============  ==============================  ================================

Which mesh dimension splits which tensor dimension is written in each layer's docstring
(:mod:`tpx.nn.multidim`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
except ImportError:  # pragma: no cover
    DeviceMesh = ()  # type: ignore[assignment,misc]
    init_device_mesh = None  # type: ignore[assignment]

from .run import run_cache

__all__ = ["LAYOUTS", "MeshInfo", "block_mesh", "check_mesh", "init_mesh", "mesh_layout"]

LAYOUTS: Dict[str, Tuple[str, ...]] = {
    "1d": ("tp",),
    "2d": ("row", "col"),
    "2.5d": ("depth", "row", "col"),
    "3d": ("input", "weight", "output"),
}


def _iroot(n: int, k: int) -> Optional[int]:
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c ** k == n:
            return c
    return None


def _fitting(layout: str, world: int, depth: Optional[int]) -> str:
    """A few world sizes near ``world`` that fit ``layout``, for the error message."""
    if layout == "2d":
        fits = [q * q for q in range(1, 6)]
    elif layout == "3d":
        fits = [q ** 3 for q in range(1, 5)]
    else:
        d = depth or 1
        fits = [d * q * q for q in range(1, 6)]
    return ", ".join(str(f) for f in fits)


def init_mesh(layout: str, *, depth: Optional[int] = None,
              device_type: Optional[str] = None) -> "DeviceMesh":
    """A :class:`~torch.distributed.device_mesh.DeviceMesh` over the default group whose
    dimension names say the tensor-parallel layout.

    Args:
        layout: ``"1d"`` (``("tp",)``, P ranks), ``"2d"`` (``("row", "col")``, q x q),
            ``"2.5d"`` (``("depth", "row", "col")``, depth x q x q) or ``"3d"``
            (``("input", "weight", "output")``, q x q x q). ``q`` is inferred from the world
            size.
        depth: the number of depth layers of ``"2.5d"`` (required there, not allowed
            elsewhere).
        device_type: ``"cpu"`` or ``"cuda"``; by default ``"cuda"`` when the default group's
            backend is NCCL, else ``"cpu"``.

    Raises:
        ValueError: an unknown layout, or a world size that does not fit it (the message
            names the world sizes that would).

    >>> mesh = tpx.init_mesh("2d")          # 4 ranks -> 2 x 2
    >>> mesh = tpx.init_mesh("2.5d", depth=2)  # 8 ranks -> 2 x 2 x 2
    """
    if layout not in LAYOUTS:
        raise ValueError(f"tpx.init_mesh: `layout` must be one of {list(LAYOUTS)}; got {layout!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tpx.init_mesh: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group() first (torchrun sets up the "
                           "environment for it).")
    if layout != "2.5d" and depth is not None:
        raise ValueError(f"tpx.init_mesh: `depth` is only for the '2.5d' layout; got "
                         f"depth={depth!r} with layout={layout!r}")
    world = dist.get_world_size()
    if layout == "1d":
        shape: Tuple[int, ...] = (world,)
    elif layout == "2d":
        q = _iroot(world, 2)
        if q is None:
            raise ValueError(f"tpx.init_mesh: the '2d' layout needs q*q ranks; the world size "
                             f"{world} is not a square (world sizes that fit: "
                             f"{_fitting(layout, world, depth)}, ...)")
        shape = (q, q)
    elif layout == "3d":
        q = _iroot(world, 3)
        if q is None:
            raise ValueError(f"tpx.init_mesh: the '3d' layout needs q*q*q ranks; the world size "
                             f"{world} is not a cube (world sizes that fit: "
                             f"{_fitting(layout, world, depth)}, ...)")
        shape = (q, q, q)
    else:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"tpx.init_mesh: the '2.5d' layout needs `depth`, a positive int "
                             f"(the number of depth layers); got depth={depth!r}")
        q = _iroot(world // depth, 2) if world % depth == 0 else None
        if q is None:
            raise ValueError(f"tpx.init_mesh: the '2.5d' layout with depth={depth} needs "
                             f"depth*q*q ranks; the world size {world} is not of that form "
                             f"(world sizes that fit: {_fitting(layout, world, depth)}, ...)")
        shape = (depth, q, q)
    if device_type is None:
        backend = str(dist.get_backend()).lower()
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, shape, mesh_dim_names=LAYOUTS[layout])


def mesh_layout(mesh: "DeviceMesh") -> Optional[str]:
    """The layout that ``mesh``'s dimension names designate, or None."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    for layout, want in LAYOUTS.items():
        if names == want:
            return layout
    return None


@dataclass(frozen=True)
class MeshInfo:
    """What a multi-dimensional layer needs from its mesh: the layout, ``q`` (and ``depth``),
    this rank's coordinate per dimension name, and each dimension's process group."""

    layout: str
    q: int
    depth: int
    coord: Dict[str, int]
    groups: Dict[str, "dist.ProcessGroup"]
    #: the mesh's global ranks in mesh order (row-major over ``names``), and its shape
    ranks: Tuple[int, ...] = ()
    shape: Tuple[int, ...] = ()
    names: Tuple[str, ...] = ()
    device_type: str = "cpu"

    def group_name(self, dim: str) -> str:
        return self.groups[dim].group_name

    def coord_of(self, index: int) -> Dict[str, int]:
        """The coordinates of the mesh's ``index``-th rank (in mesh order)."""
        coord = {}
        for name, size in reversed(list(zip(self.names, self.shape))):
            coord[name] = index % size
            index //= size
        return {n: coord[n] for n in self.names}

    def __deepcopy__(self, memo) -> "MeshInfo":
        # Immutable, and process groups cannot be copied: a copied layer shares its mesh.
        return self


def check_mesh(mesh: object, layout: str, who: str) -> MeshInfo:
    """Validates that ``mesh`` is a DeviceMesh of ``layout`` (names and shape) containing this
    rank, without any collective, and returns its :class:`MeshInfo`.

    Raises ``TypeError`` for a non-mesh and ``ValueError`` naming the dims/sizes otherwise,
    and for a mesh whose ranks do not increase along each dimension (a transposed mesh is
    fine; one listing the ranks of a dimension in another order would misplace blocks)."""
    want = LAYOUTS[layout]
    if not (DeviceMesh and isinstance(mesh, DeviceMesh)):
        raise TypeError(f"tpx.{who}: `mesh` must be a torch DeviceMesh with dimension names "
                        f"{want} (build one with tpx.init_mesh({layout!r})); got "
                        f"{type(mesh).__name__}")
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    shape = tuple(mesh.shape)
    if names != want:
        got = mesh_layout(mesh)
        hint = f" (that is the {got!r} layout's mesh)" if got else ""
        raise ValueError(f"tpx.{who}: needs a {len(want)}-D mesh with dimension names {want}; "
                         f"got a {len(shape)}-D mesh of shape {shape} named {names or None}{hint}. "
                         f"Build one with tpx.init_mesh({layout!r}).")
    sizes = dict(zip(names, shape))
    if layout == "2d" or layout == "2.5d":
        ok = sizes["row"] == sizes["col"]
    elif layout == "3d":
        ok = sizes["input"] == sizes["weight"] == sizes["output"]
    else:
        ok = True
    if not ok:
        raise ValueError(f"tpx.{who}: the {layout!r} layout needs equal sizes along "
                         f"{[n for n in names if n != 'depth']}; got mesh shape {sizes}")
    # The collectives order blocks by the rank WITHIN each dim's process group, which is the
    # order of the global ranks; the layers place blocks by the mesh coordinate. The two agree
    # only when the ranks increase along every mesh dim (as in tpx.init_mesh's meshes and
    # their slices, transposed or not); otherwise the blocks would be silently misplaced.
    grid = mesh.mesh
    for axis, name in enumerate(names):
        if grid.shape[axis] > 1 and not bool((torch.diff(grid, dim=axis) > 0).all()):
            raise ValueError(f"tpx.{who}: the mesh's ranks must increase along each dimension "
                             f"(the collectives order the blocks by rank within each "
                             f"dimension's group); along {name!r} they do not: mesh "
                             f"{grid.tolist()}. Build the mesh with the ranks in increasing "
                             f"order along every dimension (e.g. tpx.init_mesh({layout!r})).")
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"tpx.{who}: this rank is not part of the mesh given")
    groups = {n: mesh.get_group(n) for n in names}
    q = sizes["col"] if layout in ("2d", "2.5d") else (sizes["input"] if layout == "3d"
                                                         else sizes["tp"])
    depth = sizes.get("depth", 1)
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return MeshInfo(layout, q, depth, dict(zip(names, coord)), groups, ranks, shape, names,
                    mesh.device_type)


def block_mesh(info: "MeshInfo", order, device_type: str):
    """The ``DeviceMesh`` of a layout's blocks with its dimensions in ``order`` (a permutation
    of ``info.names``): the same ranks and process groups as the layout's mesh, dimensions
    permuted (the mesh of a parameter ``DTensor`` whose placements need that order). Made once
    per run."""
    key = (info.ranks, tuple(order), device_type)
    world = dist.group.WORLD
    cached = _BLOCK_MESHES.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    names = list(info.names)
    perm = [names.index(n) for n in order]
    ranks = torch.tensor(info.ranks, dtype=torch.int).view(info.shape).permute(perm)
    mesh = DeviceMesh.from_group([info.groups[n] for n in order], device_type,
                                 mesh=ranks.contiguous(), mesh_dim_names=tuple(order))
    _BLOCK_MESHES[key] = (world, mesh)
    return mesh


_BLOCK_MESHES: dict = run_cache({})
