"""Multi-dimensional tensor parallelism: 2-D (SUMMA), 2.5-D and 3-D layers.

An activation ``[B, ..., H]`` is split in its first (batch) dimension and in its last
(hidden) dimension; nothing else is split. Per layout, with ``q`` the mesh side:

======  ====================================  ==============================  ===============
layout  mesh (``tpx.init_mesh``)              batch dim 0 split by            hidden dim -1
======  ====================================  ==============================  ===============
2d      ``("row", "col")``, q x q             "row" (q blocks)                "col" (q)
2.5d    ``("depth", "row", "col")``, d x q x q  "depth" then "row" (d*q blocks,  "col" (q)
                                                block ``depth*q + row``)
3d      ``("input", "weight", "output")``      "input" then the activation's   the activation's
        q x q x q                              other dim (q^2 blocks)          hidden mesh dim
======  ====================================  ==============================  ===============

Local shape: 2-D ``[B/q, ..., H/q]``, 2.5-D ``[B/(d q), ..., H/q]``, 3-D
``[B/q^2, ..., H/q]``.

3-D activations come in two flavours: the hidden dimension is split by "output" (the input
layout of :func:`split_input`, batch blocks ``input*q + weight``) or by "weight" (batch
blocks ``input*q + output``). A :class:`Linear3D` whose input is split by one of them returns
its output split by the other, so a pre-norm MLP block (``Linear3D`` with
``hidden_mesh_dim="output"``, then one with ``"weight"``) gives back the layout it was given,
as do attention's QKV and output projections. Norms take the same ``hidden_mesh_dim``.
``Linear3D`` has no default ``hidden_mesh_dim`` (the two flavours have the same local shape);
norms, embeddings and ``split_input`` default to ``"output"``, the residual stream's.

Layout checks. The local shape does not say which layout a tensor is in (3-D: which of the
two flavours; any layout: which mesh, when two meshes order the same ranks differently), so
every tensor made by ``split_input`` or a layer here records its layout (on the tensor, and
on the autograd node that made it). Each layer, ``split_input`` and ``gather_output`` compare
the layout recorded for their input, found directly or by walking back through the ops that
autograd recorded since (GELU, dropout, residual adds, views), with the one they read, and
raise ValueError naming the ``hidden_mesh_dim`` (or mesh) to use before any communication;
an input combining tensors of two layouts (a residual add of mismatched terms) raises too.
Not seen: a tensor made by other ops while autograd records nothing (``torch.no_grad()``,
inference mode, nothing requiring grad) carries no record and is taken as it is; under
``torch.compile`` nothing is recorded or checked.

Weights: ``A = W^T`` of ``nn.Linear``'s ``W [out, in]``. 2-D / 2.5-D rank ``(row i, col j)``
holds ``A_ij`` (in block ``i``, out block ``j``; ``W[out block j, in block i]``), replicated
over depth; bias block ``j``, replicated over "row" (and "depth"). 3-D rank with coordinates
``i`` ("input"), ``h`` (the input's hidden mesh dim), ``o`` (the other) holds ``W[out block
o*q + i of q^2, in block h of q]`` and bias block ``o`` of ``q``.

Each layer describes its parameters with ``_param_splits()`` (one :class:`BlockSpec` per
parameter: for each dim, the mesh dims splitting it, outermost first); the initial weights
(mesh rank ``src_rank``'s full tensors, each rank receiving its block) and
:mod:`tpx.checkpoint` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import autograd_multidim  # noqa: F401  (registers the autograd of the ops)
from .. import ops
from ..amp import autocast_casts, norm_input
from ..group import ShardSpec, check_same_on_ranks, load_initial
from ..mesh import LAYOUTS, MeshInfo, check_mesh, mesh_layout
from .linear import _full_linear_init
from ..sharding import KeepsParamSharding, describe_params

__all__ = ["Linear2D", "Linear2p5D", "Linear3D", "split_input", "gather_output"]

_HIDDEN_3D = ("output", "weight")


def _other_3d(hidden_mesh_dim: str) -> str:
    return "weight" if hidden_mesh_dim == "output" else "output"


def _check_hidden_dim(who: str, hidden_mesh_dim: str) -> str:
    if hidden_mesh_dim not in _HIDDEN_3D:
        raise ValueError(f"tpx.{who}: `hidden_mesh_dim` must be 'output' or 'weight' (the 3-D "
                         f"mesh dimension that splits the hidden features of the input); got "
                         f"{hidden_mesh_dim!r}")
    return hidden_mesh_dim


def _splits(info: MeshInfo, hidden_mesh_dim: Optional[str]) -> Tuple[List[str], List[str]]:
    """The mesh dims splitting (batch dim 0, hidden dim -1), outermost first."""
    if info.layout == "2d":
        return ["row"], ["col"]
    if info.layout == "2.5d":
        return ["depth", "row"], ["col"]
    if info.layout == "3d":
        h = hidden_mesh_dim or "output"
        return ["input", _other_3d(h)], [h]
    return [], []


def _block(info: MeshInfo, dims: Sequence[str], coord: Optional[Dict[str, int]] = None
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
            idx, count = _block(info, dims, coord)
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
                t = _gather_dim(t, info, d, dims)
        return t


def _block_specs(module: nn.Module) -> List[BlockSpec]:
    """The :class:`BlockSpec` of every parameter ``module`` holds (absent ones skipped)."""
    return [s for s in module._param_splits() if getattr(module, s.name, None) is not None]


_MESH_GROUPS: Dict[Tuple[int, ...], Tuple[object, "dist.ProcessGroup"]] = {}


def _mesh_group(info: MeshInfo) -> "dist.ProcessGroup":
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


class _MeshParams(KeepsParamSharding):
    """Construction of a multi-dimensional layer's parameters from full tensors of one rank.

    ``_begin`` validates the mesh and compares the layer's arguments across the mesh's ranks
    (one small collective, so that a mismatch raises the same error everywhere instead of
    hanging a later collective); ``_fill`` gives every rank its block of the full tensors of
    mesh rank ``src_rank`` (chunked scatters over a group of all the mesh's ranks, see
    :func:`tpx.group.load_initial`), or with ``src_rank=None`` its block of its own full
    tensors, with no communication of weights (the ranks' tensors must then agree: a checksum
    is compared)."""

    def _begin(self, mesh, who: str, args: dict, src_rank) -> MeshInfo:
        info = check_mesh(mesh, self._layout, who)
        pg = _mesh_group(info)
        check_same_on_ranks(pg, who, dict(args, layout=self._layout, mesh=info.ranks,
                                          src_rank=src_rank))
        _check_src_rank(who, src_rank, info)
        self.src_rank = src_rank
        return info

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
        describe_params(self)  # each parameter knows its layout (tpx.sharding)
        info = self.mesh_info
        pg = _mesh_group(info)
        specs = _block_specs(self)
        if not specs:
            return
        ranks = [dist.get_global_rank(pg, g) for g in range(pg.size())]
        coords = [info.coord_of(info.ranks.index(r)) for r in ranks]
        shard_specs = [ShardSpec(getattr(self, s.name),
                                 blocks=[s.ranges(info, c) for c in coords]) for s in specs]
        src = self.src_rank
        if src is not None:
            src = dist.get_group_rank(pg, info.ranks[src])

        def fulls():
            full = full_fn()
            return [full[s.name].detach() for s in specs]

        config = dict(config, layout=self._layout, dtype=str(getattr(self, specs[0].name).dtype))
        load_initial(pg, who, config, shard_specs, fulls, src_rank=src, drawn=drawn)


def _mesh_info(mesh, who: str) -> MeshInfo:
    if isinstance(mesh, MeshInfo):  # validated when it was made (the styles' hooks pass it)
        return mesh
    layout = mesh_layout(mesh) if hasattr(mesh, "mesh_dim_names") else None
    if layout is None:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"tpx.{who}: `mesh` must be a DeviceMesh built by tpx.init_mesh, with "
                         f"dimension names one of {list(LAYOUTS.values())}; got names {names}")
    return check_mesh(mesh, layout, who)


def _check_divides(who: str, what: str, size: int, parts: int, how: str) -> None:
    if size % parts != 0:
        raise ValueError(f"tpx.{who}: {what} = {size} must divide by {parts} ({how}); pad or "
                         f"choose a size that is a multiple of {parts}")


def _gather_dim(t: Tensor, info: MeshInfo, dim: int, dims: Sequence[str]) -> Tensor:
    for d in reversed(dims):  # innermost first
        stacked = ops.mesh_all_gather(t, info.group_name(d))  # [W, *t.shape]
        moved = stacked.movedim(0, dim)
        shape = list(t.shape)
        shape[dim] *= stacked.shape[0]
        t = moved.reshape(shape)
    return t


# Which layout an activation is in ------------------------------------------------------------
#
# Two layouts can give a local tensor the same shape (3-D: features split by "output" or by
# "weight"; any layout over two meshes whose ranks are ordered differently), so a layer cannot
# tell from the shape that it was handed the wrong one. Every tpx producer of a local
# activation (split_input, the Linear / norm / embedding layers) records the layout it
# produced, in two places:
#
# * on the tensor itself (attribute ``_tpx_layout``): seen when the tensor is passed on as is;
# * on the autograd node that made it (``grad_fn.metadata``): seen through any op autograd
#   records (GELU, dropout, residual adds, views), by walking the graph back from the input
#   to the nearest recorded nodes. Each node visited keeps what was found under it, so a
#   forward pass visits every node at most once.
#
# A consumer compares what it finds with the layout it reads and raises before any
# communication. What cannot be seen: a tensor made by other ops with autograd not recording
# (``torch.no_grad()``, inference mode, nothing requiring grad) carries no record, and is
# taken as it is. Under ``torch.compile`` nothing is recorded or checked (eager runs check).

_ATTR = "_tpx_layout"
_META = "tpx_layouts"


@dataclass(frozen=True)
class _Layout:
    """A local activation's layout: the mesh (layout name, its ranks in mesh order, its
    shape), the mesh dims splitting the batch and (``kind="act"``) the hidden features.
    ``kind="ids"``: token ids, batch split only; ``kind="full"``: a gathered (replicated)
    tensor, recorded only so that graph walks stop there."""

    mesh: Tuple[str, Tuple[int, ...], Tuple[int, ...]]
    batch: Tuple[str, ...]
    hidden: Tuple[str, ...]
    kind: str = "act"

    def describe(self) -> str:
        where = f"the {self.mesh[0]!r} mesh over ranks {list(self.mesh[1])}"
        if self.kind == "ids":
            return f"token ids of {where}, batch split by {self.batch}"
        if self.kind == "full":
            return f"a full tensor gathered over {where}"
        return (f"an activation of {where} with its batch split by {self.batch} and its "
                f"features by {self.hidden[0]!r}")


def _layout_of(info: MeshInfo, hidden_mesh_dim: Optional[str], kind: str = "act") -> _Layout:
    bdims, hdims = _splits(info, hidden_mesh_dim)
    mesh = (info.layout, tuple(info.ranks), tuple(info.shape))
    if kind == "act":
        return _Layout(mesh, tuple(bdims), tuple(hdims))
    return _Layout(mesh, tuple(bdims) if kind == "ids" else (), (), kind)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _mark(t: Tensor, layout: _Layout) -> Tensor:
    """Records that ``t`` (a tensor just made by a tpx layer) is in ``layout``."""
    if _compiling():
        return t
    setattr(t, _ATTR, layout)
    if t.grad_fn is not None:
        t.grad_fn.metadata[_META] = frozenset((layout,))
    return t


def _node_layouts(root) -> frozenset:
    """The layouts recorded at the nearest recorded nodes above autograd node ``root``."""
    if _META in root.metadata:
        return root.metadata[_META]
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        meta = node.metadata
        if _META in meta:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((n, False) for n in nexts if _META not in n.metadata)
        else:
            found: frozenset = frozenset()
            for n in nexts:
                found = found | n.metadata[_META]
            meta[_META] = found
    return root.metadata[_META]


def _layouts_of(t: Tensor) -> frozenset:
    """The layouts ``t`` is known to derive from (empty: unknown)."""
    if _compiling() or not isinstance(t, Tensor):
        return frozenset()
    layout = getattr(t, _ATTR, None)
    if layout is not None:
        return frozenset((layout,))
    if t.grad_fn is None:
        return frozenset()
    return _node_layouts(t.grad_fn)


def _alternation_hint(got: _Layout, want: _Layout, linear: bool) -> str:
    if got.mesh != want.mesh:
        return ("it was split over a different device mesh (another order of the ranks, or "
                "other ranks): split the inputs and build every layer over the same mesh")
    if want.mesh[0] == "3d" and got.kind == want.kind == "act":
        h = got.hidden[0]
        if linear:
            return (f"build this layer with hidden_mesh_dim={h!r}. Consecutive Linear3D "
                    f"layers alternate: a Linear3D(hidden_mesh_dim='output') returns its "
                    f"output with the features split by 'weight', which the next Linear3D "
                    f"reads with hidden_mesh_dim='weight' (and returns split by 'output')")
        return (f"build this layer with hidden_mesh_dim={h!r} (the mesh dim splitting the "
                f"features of its input: 'weight' after a Linear3D(hidden_mesh_dim="
                f"'output'), 'output' after a Linear3D(hidden_mesh_dim='weight'), "
                f"tpx.split_input and the norms and embeddings built with 'output')")
    if want.mesh[0] == "3d" and got.kind == want.kind == "ids":
        h = "output" if got.batch[1] == "weight" else "weight"
        return (f"split the ids with the hidden_mesh_dim of this layer, or build it with "
                f"hidden_mesh_dim={h!r}")
    return "pass it the tensor it reads"


def _check_layout(who: str, t: Tensor, want: _Layout, linear: bool = False) -> None:
    """Raises ValueError when ``t`` is known to be in a layout other than ``want``
    (``linear``: the reader is a Linear3D, whose message explains the alternation)."""
    found = {lay for lay in _layouts_of(t) if lay.kind != "full"}
    if not found or found == {want}:
        return
    if len(found) > 1:
        parts = "; ".join(sorted(lay.describe() for lay in found))
        raise ValueError(f"tpx.{who}: the input combines tensors in different layouts ({parts}), "
                         f"e.g. a residual add of the output of a Linear3D built with the wrong "
                         f"`hidden_mesh_dim`; every term must be in the layout this layer reads, "
                         f"{want.describe()}. Check the hidden_mesh_dim of the layers that made "
                         f"them (consecutive Linear3D layers alternate 'output' / 'weight').")
    got = found.pop()
    raise ValueError(f"tpx.{who}: the input is {got.describe()}, but this layer reads "
                     f"{want.describe()}: {_alternation_hint(got, want, linear)}.")


class _SplitInput(torch.autograd.Function):
    """R -> the layout's blocks; backward all-gathers the gradient blocks back to R."""

    @staticmethod
    def forward(ctx, x, info, bdims, hdims):
        ctx.info, ctx.bdims, ctx.hdims = info, bdims, hdims
        bi, bn = _block(info, bdims)
        hi, hn = _block(info, hdims)
        b, h = x.shape[0] // bn, x.shape[-1] // hn
        return x.narrow(0, bi * b, b).narrow(-1, hi * h, h).contiguous()

    @staticmethod
    def backward(ctx, grad):
        g = _gather_dim(grad.contiguous(), ctx.info, grad.dim() - 1, ctx.hdims)
        g = _gather_dim(g, ctx.info, 0, ctx.bdims)
        return g, None, None, None


class _GatherOutput(torch.autograd.Function):
    """The layout's blocks -> R; backward keeps this rank's block of the replicated gradient."""

    @staticmethod
    def forward(ctx, y, info, bdims, hdims):
        ctx.info, ctx.bdims, ctx.hdims = info, bdims, hdims
        ctx.shape = y.shape
        g = _gather_dim(y.contiguous(), info, y.dim() - 1, hdims)
        return _gather_dim(g, info, 0, bdims)

    @staticmethod
    def backward(ctx, grad):
        bi, _ = _block(ctx.info, ctx.bdims)
        hi, _ = _block(ctx.info, ctx.hdims)
        b, h = ctx.shape[0], ctx.shape[-1]
        return grad.narrow(0, bi * b, b).narrow(-1, hi * h, h).contiguous(), None, None, None


def split_input(x: Tensor, mesh, *, hidden_mesh_dim: Optional[str] = None) -> Tensor:
    """This rank's block of a full (replicated) activation ``x [B, ..., H]`` in the input
    placement of the mesh's layout (differentiable: the backward all-gathers the gradient).

    * 2-D: ``[B, ..., H] -> [B/q, ..., H/q]``: block ``row`` of the batch, ``col`` of H.
    * 2.5-D: ``-> [B/(d q), ..., H/q]``: batch block ``depth*q + row``, H block ``col``.
    * 3-D (``hidden_mesh_dim="output"``, the default): ``-> [B/q^2, ..., H/q]``: batch block
      ``input*q + weight``, H block ``output`` (``"weight"`` swaps the two).
    * 1-D: ``x`` unchanged (1-D layers take a replicated input).
    * Token ids (an integer tensor ``[B, ...]``): only the batch is split, as above.

    The result records its layout: a layer built for another one (3-D: another
    ``hidden_mesh_dim``; any layout: another mesh) raises instead of computing on it.

    Raises ValueError when B or H does not divide by the number of blocks, or when ``x`` is
    already a block of an activation split over this mesh."""
    info = _mesh_info(mesh, "split_input")
    if info.layout == "3d":
        _check_hidden_dim("split_input", hidden_mesh_dim or "output")
    elif hidden_mesh_dim is not None:
        raise ValueError("tpx.split_input: `hidden_mesh_dim` is only for 3-D meshes")
    if info.layout == "1d":
        return x
    bdims, hdims = _splits(info, hidden_mesh_dim)
    mesh_sig = _layout_of(info, hidden_mesh_dim).mesh
    done = [lay for lay in _layouts_of(x) if lay.kind != "full" and lay.mesh == mesh_sig]
    if done:
        raise ValueError(f"tpx.split_input: `x` is already this rank's block "
                         f"({done[0].describe()}); split_input takes the full tensor "
                         f"[B, ..., H] (pass the block to the layers as it is)")
    if not x.is_floating_point() and not x.is_complex():
        # Token ids (an integer tensor) have no hidden dimension: batch split only.
        if x.dim() < 1:
            raise ValueError("tpx.split_input: ids must have a batch dimension")
        _check_divides("split_input", "x.shape[0] (batch)", x.shape[0],
                       _block(info, bdims)[1], f"split over mesh dims {bdims}")
        bi, bn = _block(info, bdims)
        b = x.shape[0] // bn
        return _mark(x.narrow(0, bi * b, b), _layout_of(info, hidden_mesh_dim, "ids"))
    if x.dim() < 2:
        raise ValueError(f"tpx.split_input: `x` must be [batch, ..., hidden]; got shape "
                         f"{tuple(x.shape)}")
    _check_divides("split_input", "x.shape[0] (batch)", x.shape[0], _block(info, bdims)[1],
                   f"split over mesh dims {bdims}")
    _check_divides("split_input", "x.shape[-1] (hidden)", x.shape[-1], _block(info, hdims)[1],
                   f"split over mesh dim {hdims}")
    return _mark(_SplitInput.apply(x, info, bdims, hdims), _layout_of(info, hidden_mesh_dim))


def gather_output(y: Tensor, mesh, *, hidden_mesh_dim: Optional[str] = None) -> Tensor:
    """The full tensor ``[B, ..., H]`` (R) from every rank's block ``y`` in the mesh's layout
    (the inverse of :func:`split_input`, same placements). Differentiable: the backward keeps
    this rank's block of the replicated gradient. 1-D: ``y`` unchanged.

    3-D: ``hidden_mesh_dim`` is the mesh dim splitting ``y``'s last dimension (e.g.
    ``layer.output_mesh_dim``: ``"weight"`` for the output of a
    ``Linear3D(hidden_mesh_dim="output")``). When it is not given, the layout recorded by the
    tpx layer that made ``y`` is used (directly, or through the ops autograd recorded since);
    a ``y`` whose layout is unknown (made under ``torch.no_grad()`` by other ops) raises
    ValueError asking for it. A ``hidden_mesh_dim``, or a mesh, that differs from the recorded
    one raises ValueError."""
    info = _mesh_info(mesh, "gather_output")
    if info.layout == "3d":
        if hidden_mesh_dim is not None:
            _check_hidden_dim("gather_output", hidden_mesh_dim)
    elif hidden_mesh_dim is not None:
        raise ValueError("tpx.gather_output: `hidden_mesh_dim` is only for 3-D meshes")
    if info.layout == "1d":
        return y
    if not isinstance(y, Tensor) or y.dim() < 2:
        shape = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
        raise ValueError(f"tpx.gather_output: `y` must be [batch, ..., hidden]; got {shape}")
    if info.layout == "3d" and hidden_mesh_dim is None:
        found = [lay for lay in _layouts_of(y) if lay.kind == "act"]
        if not found and not _compiling():
            raise ValueError("tpx.gather_output: pass `hidden_mesh_dim` for a 3-D activation "
                             "whose layout is not recorded (made by other ops under "
                             "torch.no_grad()): the mesh dim splitting its features, 'weight' "
                             "for the output of a Linear3D(hidden_mesh_dim='output') (its "
                             "`output_mesh_dim`), 'output' for tpx.split_input's layout and the "
                             "output of a Linear3D(hidden_mesh_dim='weight')")
        hidden_mesh_dim = (found[0].hidden[0] if len(found) == 1
                           and found[0].hidden[0] in _HIDDEN_3D else "output")
    _check_layout("gather_output", y, _layout_of(info, hidden_mesh_dim))
    bdims, hdims = _splits(info, hidden_mesh_dim)
    return _mark(_GatherOutput.apply(y, info, bdims, hdims), _layout_of(info, None, "full"))


def _check_positive(who: str, **sizes) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"tpx.{who}: `{name}` must be a positive int; got {v!r}")


class _MultiDimLinear(_MeshParams, nn.Module):
    _layout = ""

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True,
                 device=None, dtype=None, *, src_rank: Optional[int] = 0, **kw) -> None:
        super().__init__()
        who = type(self).__name__
        self._check_kw(who, kw)
        self._begin(mesh, who, dict(in_features=in_features, out_features=out_features,
                                    bias=bool(bias), **kw), src_rank)
        _check_positive(who, in_features=in_features, out_features=out_features)
        self._configure(in_features, out_features, mesh, **kw)
        self._alloc(("weight", "bias") if bias else ("weight",), device, dtype)

        def full():
            w, b = _full_linear_init(in_features, out_features, bias, device, dtype)
            return {"weight": w, "bias": b}

        self._fill(who, self._layer_config(), full, drawn=True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh, *, src_rank: Optional[int] = 0, **kw):
        """This rank's blocks of rank ``src_rank``'s ``nn.Linear`` (every rank of the mesh
        passes one of the same sizes; only the source's values are read, and every rank
        receives its blocks of them). ``src_rank=None``: each rank copies its blocks of its
        own layer, with no communication of weights (the layers must be equal on every rank,
        which is checked). A collective over the mesh's ranks."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"tpx.{cls.__name__}.from_linear: expected an nn.Linear; got "
                            f"{type(linear).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        who = type(self).__name__
        cls._check_kw(who, kw)
        has_bias = linear.bias is not None
        self._begin(mesh, who, dict(in_features=linear.in_features,
                                    out_features=linear.out_features, bias=has_bias,
                                    dtype=str(linear.weight.dtype), **kw), src_rank)
        self._configure(linear.in_features, linear.out_features, mesh, **kw)
        self._alloc(("weight", "bias") if has_bias else ("weight",), linear.weight.device,
                    linear.weight.dtype)
        self._fill(who, self._layer_config(),
                   lambda: {"weight": linear.weight, "bias": linear.bias}, drawn=False)
        return self

    def _configure(self, in_features, out_features, mesh, **kw) -> None:
        raise NotImplementedError

    @classmethod
    def _check_kw(cls, who: str, kw: dict) -> None:
        """Checks of the layout's own arguments made before anything else (no collective)."""

    def _layer_config(self) -> dict:
        return dict(in_features=self.in_features, out_features=self.out_features,
                    bias=self.bias is not None, q=self.q,
                    hidden_mesh_dim=getattr(self, "hidden_mesh_dim", None),
                    chunks=getattr(self, "chunks", None))

    def _param_splits(self) -> List[BlockSpec]:
        """Per parameter, the mesh dims splitting each of its dims (see :class:`BlockSpec`)."""
        rows, cols = self._weight_splits()
        return [BlockSpec("weight", (rows, cols), (self.out_features, self.in_features)),
                BlockSpec("bias", (rows[:1],), (self.out_features,))]

    def _check_input(self, x: Tensor) -> None:
        who = type(self).__name__
        if not isinstance(x, Tensor):
            raise TypeError(f"tpx.{who}: input must be a Tensor; got {type(x).__name__}")
        if x.dim() < 2 or x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"tpx.{who}: input must be this rank's block [batch, ..., "
                             f"{self.weight.shape[1]}] ({self.in_features} input features "
                             f"split {self.in_features // self.weight.shape[1]} ways); got "
                             f"shape {tuple(x.shape)}. Use tpx.split_input(x, mesh).")
        if x.dtype != self.weight.dtype and not autocast_casts(x, self.weight):
            raise ValueError(f"tpx.{who}: input dtype {x.dtype} differs from the weight dtype "
                             f"{self.weight.dtype}; cast the input, or the module with "
                             f".to(dtype), or run the forward under torch.autocast")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, layout={self._layout}, q={self.q}")


class Linear2D(_MultiDimLinear):
    """``nn.Linear`` over a 2-D ``("row", "col")`` mesh of q x q ranks (SUMMA).

    Placement, rank ``(row i, col j)``: input ``X_ij [B/q, ..., in/q]`` (batch block ``i``,
    feature block ``j``) -> output ``Y_ij [B/q, ..., out/q]`` (batch block ``i``, out block
    ``j``); ``weight = W[out block j, in block i]`` (``A_ij`` of ``A = W^T``), ``bias`` block
    ``j`` replicated over "row". Forward: q pipelined steps, each broadcasting ``X_il`` along
    the mesh row and ``A_lj`` along the mesh column (:func:`tpx.ops.linear_2d`).

    ``in_features`` and ``out_features`` must divide by q, the batch by q.

    Initial weights: ``nn.Linear``'s distribution over the FULL matrix, then sliced. By
    default (``src_rank=0``) mesh rank ``src_rank`` (the global rank for a mesh from
    ``tpx.init_mesh``) draws it (``from_linear``: reads its own ``nn.Linear``) and every
    rank receives its blocks in steps of bounded size (``TPX_INIT_CHUNK_BYTES``), so the
    layer equals rank ``src_rank``'s ``nn.Linear`` whatever the other ranks' seeds, and
    replicated blocks are equal on every replica. ``src_rank=None``: every rank draws (or
    reads) the full matrix and keeps its blocks, with no communication of weights; the ranks
    must then be seeded alike, which is checked with a checksum. The arguments are compared
    across the mesh's ranks first (a mismatch raises the same ``ValueError`` on every rank).
    Building the layer is a collective over the mesh's ranks.
    """

    _layout = "2d"

    def _configure(self, in_features, out_features, mesh) -> None:
        who = type(self).__name__
        info = check_mesh(mesh, self._layout, who)
        q = info.q
        _check_divides(who, "in_features", in_features, q, f"q = {q} blocks along 'row'")
        _check_divides(who, "out_features", out_features, q, f"q = {q} blocks along 'col'")
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.mesh_info = info
        self._groups = (info.group_name("row"), info.group_name("col"),
                        info.group_name("depth") if self._layout == "2.5d" else None)
        self._in_layout = self._out_layout = _layout_of(info, None)

    def _weight_splits(self):
        return ("col",), ("row",)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        _check_layout(type(self).__name__, x, self._in_layout)
        return _mark(ops.linear_2d(x, self.weight, self.bias, *self._groups), self._out_layout)


class Linear2p5D(Linear2D):
    """``nn.Linear`` over a 2.5-D ``("depth", "row", "col")`` mesh of d x q x q ranks.

    Placement, rank ``(depth k, row i, col j)``: input ``[B/(d q), ..., in/q]`` (batch block
    ``k*q + i``, feature block ``j``) -> output ``[B/(d q), ..., out/q]`` (batch block
    ``k*q + i``, out block ``j``); weight and bias blocks as :class:`Linear2D`, replicated
    over depth (their gradients are summed over depth). Each depth layer runs 2-D SUMMA on its
    own rows. Initial weights and ``src_rank`` as :class:`Linear2D` (every depth layer gets
    the same blocks).
    """

    _layout = "2.5d"


class Linear3D(_MultiDimLinear):
    """``nn.Linear`` over a 3-D ``("input", "weight", "output")`` mesh of q x q x q ranks.

    ``hidden_mesh_dim`` (required, keyword: ``"output"`` or ``"weight"``) is the mesh dimension
    that splits the input's features; call the other one ``o``. Rank (``input`` i, ``o``,
    ``hidden_mesh_dim`` h): input ``[B/q^2, ..., in/q]`` (batch block ``i*q + o``, feature
    block ``h``) -> output ``[B/q^2, ..., out/q]`` (batch block ``i*q + h``, out block ``o``),
    i.e. the output's features are split by ``o`` (``self.output_mesh_dim``): consecutive
    layers alternate, a ``Linear3D(hidden_mesh_dim="output")`` (reading ``split_input``'s
    layout, the residual stream) then a ``Linear3D(hidden_mesh_dim="weight")`` (which returns
    the residual stream's layout again). There is no default, since the two input layouts
    have the same local shape: a missing ``hidden_mesh_dim`` raises ValueError (before any
    communication), and so does, at the call, an input recorded in the other layout or on
    another mesh (the output of a tpx layer or of ``split_input``, passed on directly or
    through ops autograd records; see :mod:`tpx.nn.multidim`).
    ``weight = W[out block o*q + i of q^2, in block h]``; ``bias`` block ``o``, replicated
    over "input" and h. Forward: all-gather the input over ``o`` and the weight over "input",
    GEMM, reduce-scatter over h, chunked (``chunks``, as the 1-D ops).

    ``in_features`` must divide by q, ``out_features`` by q^2, the batch by q^2. Initial
    weights and ``src_rank`` as :class:`Linear2D`.
    """

    _layout = "3d"

    @classmethod
    def _check_kw(cls, who: str, kw: dict) -> None:
        if kw.get("hidden_mesh_dim") is None:
            raise ValueError(
                f"tpx.{who}: pass `hidden_mesh_dim`, the 3-D mesh dim splitting the features "
                f"of this layer's INPUT: 'output' for an input in tpx.split_input's layout "
                f"(the residual stream: the output of the norms and embeddings, read by "
                f"attention's QKV and the MLP's up projection), 'weight' for the output of a "
                f"Linear3D(hidden_mesh_dim='output') (read by attention's output projection and "
                f"the MLP's down projection). Consecutive Linear3D layers alternate: each "
                f"returns its output split by the other dim. There is no default: both layouts "
                f"have the same local shape, and the wrong one gives wrong numbers.")
        _check_hidden_dim(who, kw["hidden_mesh_dim"])

    def _configure(self, in_features, out_features, mesh, hidden_mesh_dim: Optional[str] = None,
                   chunks: Optional[int] = None) -> None:
        who = type(self).__name__
        info = check_mesh(mesh, "3d", who)
        h = _check_hidden_dim(who, hidden_mesh_dim)
        o = _other_3d(h)
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"tpx.{who}: `chunks` must be None or an int >= 1; got {chunks!r}")
        q = info.q
        _check_divides(who, "in_features", in_features, q, f"q = {q} blocks along {h!r}")
        _check_divides(who, "out_features", out_features, q * q,
                       f"q^2 = {q * q} blocks along ({o!r}, 'input')")
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.mesh_info = info
        self.hidden_mesh_dim, self.output_mesh_dim, self.chunks = h, o, chunks
        self._groups = (info.group_name("input"), info.group_name(o), info.group_name(h))
        self._in_layout, self._out_layout = _layout_of(info, h), _layout_of(info, o)

    def _weight_splits(self):
        return (self.output_mesh_dim, "input"), (self.hidden_mesh_dim,)

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        _check_layout(type(self).__name__, x, self._in_layout, linear=True)
        y = ops.linear_3d(x, self.weight, self.bias, *self._groups, self.chunks)[0]
        return _mark(y, self._out_layout)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hidden_mesh_dim={self.hidden_mesh_dim!r}"


# Norms ------------------------------------------------------------------------------------------


def _norm_groups(info: MeshInfo, hidden_mesh_dim: Optional[str]) -> Tuple[str, List[str]]:
    """(the group that splits the hidden features, the groups that split the batch)."""
    bdims, hdims = _splits(info, hidden_mesh_dim)
    return info.group_name(hdims[0]), [info.group_name(d) for d in bdims]


def _sum_over(t: Tensor, groups: Sequence[str]) -> Tensor:
    for g in groups:
        t = torch.ops.tpx.mesh_all_reduce(t, g)
    return t


class _LayerNormFn(torch.autograd.Function):
    """LayerNorm of rows whose features are split over ``hidden_group``.

    Forward: each rank's row mean and sum of squared deviations travel in ONE all-gather and
    are merged exactly (Chan et al.'s parallel variance), so the variance is as accurate as a
    two-pass one. Backward: the two row means the input gradient needs travel in ONE
    all-reduce; the weight and bias gradients are summed over the batch-splitting groups."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, features, hidden_group, batch_groups):
        xf = x.float()
        h = x.shape[-1]
        mean_r = xf.mean(-1)
        m2_r = (xf - mean_r.unsqueeze(-1)).square().sum(-1)
        stats = ops.mesh_all_gather(torch.stack([mean_r, m2_r], -1), hidden_group)
        mean = stats[..., 0].mean(0)
        m2 = stats[..., 1].sum(0) + h * (stats[..., 0] - mean).square().sum(0)
        rstd = torch.rsqrt(m2 / features + eps)
        xhat = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        y = xhat
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.args = (features, hidden_group, batch_groups, bias is not None)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, weight = ctx.saved_tensors
        features, hidden_group, batch_groups, has_bias = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dyf = dy.float()
        grad_x = grad_w = grad_b = None
        if need_x:
            g = dyf * weight.float() if weight is not None else dyf
            sums = torch.stack([g.sum(-1), (g * xhat).sum(-1)], -1)
            means = ops.mesh_all_reduce(sums, hidden_group) / features
            grad_x = (rstd.unsqueeze(-1) * (g - means[..., :1] - xhat * means[..., 1:])
                      ).to(dy.dtype)
        rows = dyf.reshape(-1, dyf.shape[-1])
        parts = []
        if need_w:
            parts.append((rows * xhat.reshape(rows.shape)).sum(0))
        if need_b and has_bias:
            parts.append(rows.sum(0))
        if parts:
            summed = _sum_over(torch.stack(parts), batch_groups)
            if need_w:
                grad_w = summed[0].to(weight.dtype)
            if need_b and has_bias:
                grad_b = summed[-1].to(dy.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm of rows whose features are split over ``hidden_group``: the row sum of squares
    in ONE all-reduce forward, the row sum of ``grad * weight * x`` in ONE backward; the
    weight gradient is summed over the batch-splitting groups."""

    @staticmethod
    def forward(ctx, x, weight, eps, features, hidden_group, batch_groups):
        xf = x.float()
        ss = ops.mesh_all_reduce(xf.square().sum(-1, keepdim=True), hidden_group)
        rstd = torch.rsqrt(ss / features + eps)
        xn = xf * rstd
        ctx.save_for_backward(xf, rstd, weight)
        ctx.args = (features, hidden_group, batch_groups)
        if weight is None:
            return xn.to(x.dtype)
        # As Hugging Face's LlamaRMSNorm: normalise in fp32, cast, then scale.
        return weight * xn.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xf, rstd, weight = ctx.saved_tensors
        features, hidden_group, batch_groups = ctx.args
        need_x, need_w = ctx.needs_input_grad[:2]
        dyf = dy.float()
        grad_x = grad_w = None
        if need_x:
            g = dyf * weight.float() if weight is not None else dyf
            s = ops.mesh_all_reduce((g * xf).sum(-1, keepdim=True), hidden_group)
            grad_x = (rstd * (g - xf * rstd.square() * s / features)).to(dy.dtype)
        if need_w and weight is not None:
            rows = (dyf * xf * rstd).reshape(-1, xf.shape[-1])
            grad_w = _sum_over(rows.sum(0), batch_groups).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None


def _normalized_size(who: str, normalized_shape) -> int:
    if isinstance(normalized_shape, int):
        return normalized_shape
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"tpx.{who}: only a normalized_shape of one dimension (the hidden "
                         f"features) is supported; got {shape}")
    return int(shape[0])


class _MultiDimNorm(_MeshParams, nn.Module):
    _layout = ""

    def _configure(self, features: int, mesh, hidden_mesh_dim: Optional[str]) -> None:
        who = type(self).__name__
        _check_positive(who, normalized_shape=features)
        info = check_mesh(mesh, self._layout, who)
        if self._layout == "3d":
            hidden_mesh_dim = _check_hidden_dim(who, hidden_mesh_dim or "output")
        elif hidden_mesh_dim is not None:
            raise ValueError(f"tpx.{who}: `hidden_mesh_dim` is only for the 3-D layers")
        bdims, hdims = _splits(info, hidden_mesh_dim)
        q = info.q
        _check_divides(who, "normalized_shape", features, q, f"split over mesh dim {hdims}")
        self.normalized_shape = (features,)
        self.hidden_mesh_dim = hidden_mesh_dim
        self.mesh_info = info
        hi, _ = _block(info, hdims)
        self._range = (hi * features // q, (hi + 1) * features // q)
        self._hdims = tuple(hdims)
        self._groups = _norm_groups(info, hidden_mesh_dim)
        self._in_layout = _layout_of(info, hidden_mesh_dim)

    def _param_splits(self) -> List[BlockSpec]:
        """Per parameter, the mesh dims splitting it (see :class:`BlockSpec`)."""
        full = self.normalized_shape
        return [BlockSpec("weight", (self._hdims,), full), BlockSpec("bias", (self._hdims,), full)]

    def _layer_config(self) -> dict:
        return dict(normalized_shape=self.normalized_shape[0], eps=self.eps,
                    elementwise_affine=self.elementwise_affine,
                    weight=self.weight is not None, bias=getattr(self, "bias", None) is not None,
                    hidden_mesh_dim=self.hidden_mesh_dim)

    def _check_input(self, x: Tensor) -> None:
        local = self._range[1] - self._range[0]
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != local:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"tpx.{type(self).__name__}: input must be this rank's block "
                             f"[..., {local}] of {self.normalized_shape[0]} features; got "
                             f"{shape}. Use tpx.split_input(x, mesh).")


class LayerNorm2D(_MultiDimNorm):
    """``nn.LayerNorm`` over the last dimension of a 2-D activation (placement as
    :class:`Linear2D`'s input: ``[B/q, ..., H/q]``, H split by "col"). ``weight`` and ``bias``
    hold block "col" of H, replicated over "row" (their gradients summed over it). The row
    statistics travel in one collective over "col".

    ``src_rank`` (default 0): the mesh rank whose parameters every rank takes its block of
    (``from_layernorm``: rank ``src_rank``'s module; the constructor's are ones and zeros);
    ``None``: each rank slices its own, no communication of weights (checked equal). Building
    the layer is a collective over the mesh's ranks."""

    _layout = "2d"

    def __init__(self, normalized_shape, mesh, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, hidden_mesh_dim: Optional[str] = None, src_rank: Optional[int] = 0) -> None:
        super().__init__()
        who = type(self).__name__
        self._begin(mesh, who, dict(normalized_shape=_shape_arg(normalized_shape), eps=eps,
                                    elementwise_affine=elementwise_affine, bias=bias,
                                    hidden_mesh_dim=hidden_mesh_dim,
                                    dtype=str(dtype)), src_rank)
        features = _normalized_size(who, normalized_shape)
        self._configure(features, mesh, hidden_mesh_dim)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        names = (("weight", "bias") if bias else ("weight",)) if elementwise_affine else ()
        self._alloc(names, device, dtype)

        def full():
            kw = dict(device=device, dtype=dtype)
            return {"weight": torch.ones(features, **kw), "bias": torch.zeros(features, **kw)}

        self._fill(who, self._layer_config(), full, drawn=False)

    @classmethod
    def from_layernorm(cls, layernorm: nn.LayerNorm, mesh, *,
                       hidden_mesh_dim: Optional[str] = None, src_rank: Optional[int] = 0):
        """This rank's block of rank ``src_rank``'s ``nn.LayerNorm`` (``None``: of its own,
        no communication; the modules must then be equal, which is checked)."""
        if not isinstance(layernorm, nn.LayerNorm):
            raise TypeError(f"tpx.{cls.__name__}.from_layernorm: expected an nn.LayerNorm; "
                            f"got {type(layernorm).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        who = cls.__name__
        ln = layernorm
        self._begin(mesh, who, dict(normalized_shape=tuple(ln.normalized_shape), eps=ln.eps,
                                    weight=ln.weight is not None, bias=ln.bias is not None,
                                    hidden_mesh_dim=hidden_mesh_dim,
                                    dtype=str(_param_dtype(ln))), src_rank)
        self._configure(_normalized_size(who, ln.normalized_shape), mesh, hidden_mesh_dim)
        self.eps = ln.eps
        self.elementwise_affine = ln.elementwise_affine
        names = [n for n in ("weight", "bias") if getattr(ln, n) is not None]
        self._alloc(names, *_param_device_dtype(ln))
        self._fill(who, self._layer_config(), lambda: {"weight": ln.weight, "bias": ln.bias},
                   drawn=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        _check_layout(type(self).__name__, x, self._in_layout)
        x = norm_input(x)  # fp32 where torch's autocast lists layer_norm as fp32 (tpx.amp)
        hidden, batch = self._groups
        y = _LayerNormFn.apply(x, self.weight, self.bias, self.eps, self.normalized_shape[0],
                               hidden, batch)
        return _mark(y, self._in_layout)


def _shape_arg(normalized_shape):
    """``normalized_shape`` in a form that compares across ranks."""
    if isinstance(normalized_shape, int):
        return normalized_shape
    try:
        return tuple(normalized_shape)
    except TypeError:
        return repr(normalized_shape)


def _param_device_dtype(module: nn.Module):
    for p in module.parameters():
        return p.device, p.dtype
    return None, None


def _param_dtype(module: nn.Module):
    return _param_device_dtype(module)[1]


class LayerNorm2p5D(LayerNorm2D):
    """``nn.LayerNorm`` on a 2.5-D activation (``[B/(d q), ..., H/q]``, H split by "col");
    parameters hold block "col" of H, gradients summed over "depth" and "row"."""

    _layout = "2.5d"


class LayerNorm3D(LayerNorm2D):
    """``nn.LayerNorm`` on a 3-D activation whose H is split by ``hidden_mesh_dim``
    (``"output"`` by default: the residual stream; ``"weight"`` for the output of a
    ``Linear3D(hidden_mesh_dim="output")``); parameters hold that block of H, gradients
    summed over "input" and the other activation dim. An input recorded in the other layout
    raises ValueError (see :mod:`tpx.nn.multidim`)."""

    _layout = "3d"


class RMSNorm2D(_MultiDimNorm):
    """``nn.RMSNorm`` (or Hugging Face's ``LlamaRMSNorm``: ``weight`` and
    ``variance_epsilon``) on a 2-D activation ``[B/q, ..., H/q]``; ``weight`` holds block
    "col" of H, replicated over "row", its gradient summed over "row". The row sum of squares
    travels in one all-reduce over "col". ``eps=None`` is ``torch.finfo(x.dtype).eps`` as in
    torch. ``src_rank`` as in :class:`LayerNorm2D`."""

    _layout = "2d"

    def __init__(self, normalized_shape, mesh, eps: Optional[float] = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 hidden_mesh_dim: Optional[str] = None, src_rank: Optional[int] = 0) -> None:
        super().__init__()
        who = type(self).__name__
        self._begin(mesh, who, dict(normalized_shape=_shape_arg(normalized_shape), eps=eps,
                                    elementwise_affine=elementwise_affine,
                                    hidden_mesh_dim=hidden_mesh_dim, dtype=str(dtype)),
                    src_rank)
        features = _normalized_size(who, normalized_shape)
        self._configure(features, mesh, hidden_mesh_dim)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self._alloc(("weight",) if elementwise_affine else (), device, dtype)
        self._fill(who, self._layer_config(),
                   lambda: {"weight": torch.ones(features, device=device, dtype=dtype)},
                   drawn=False)

    def _param_splits(self) -> List[BlockSpec]:
        return super()._param_splits()[:1]

    @classmethod
    def from_rmsnorm(cls, module: nn.Module, mesh, *, hidden_mesh_dim: Optional[str] = None,
                     src_rank: Optional[int] = 0):
        """This rank's block of rank ``src_rank``'s ``nn.RMSNorm`` or of a module shaped like
        Hugging Face's ``LlamaRMSNorm`` (a 1-D ``weight`` and ``variance_epsilon``; a float
        ``eps`` is accepted in its place). The module must compute ``x * rsqrt(mean(x^2) +
        eps) * weight`` over the last dimension. ``src_rank=None``: of its own module, no
        communication (the modules must then be equal, which is checked)."""
        if isinstance(module, getattr(nn, "RMSNorm", ())):
            features = _normalized_size(cls.__name__, module.normalized_shape)
            eps, weight = module.eps, module.weight
        elif isinstance(getattr(module, "weight", None), Tensor) and module.weight.dim() == 1 \
                and isinstance(getattr(module, "variance_epsilon", getattr(module, "eps", None)),
                               float):
            features, weight = module.weight.shape[0], module.weight
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        else:
            raise TypeError(f"tpx.{cls.__name__}.from_rmsnorm: expected nn.RMSNorm or a module "
                            f"with a 1-D `weight` and a float `variance_epsilon` (Hugging Face) "
                            f"or `eps`; got {type(module).__name__}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        who = cls.__name__
        self._begin(mesh, who, dict(normalized_shape=features, eps=eps,
                                    weight=weight is not None, hidden_mesh_dim=hidden_mesh_dim,
                                    dtype=str(None if weight is None else weight.dtype)),
                    src_rank)
        self._configure(features, mesh, hidden_mesh_dim)
        self.eps = eps
        self.elementwise_affine = weight is not None
        if weight is None:
            self._alloc((), None, None)
        else:
            self._alloc(("weight",), weight.device, weight.dtype)
        self._fill(who, self._layer_config(), lambda: {"weight": weight}, drawn=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        _check_layout(type(self).__name__, x, self._in_layout)
        x = norm_input(x)  # fp32 where torch's autocast lists rms_norm as fp32 (tpx.amp)
        hidden, batch = self._groups
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = _RMSNormFn.apply(x, self.weight, eps, self.normalized_shape[0], hidden, batch)
        return _mark(y, self._in_layout)

class RMSNorm2p5D(RMSNorm2D):
    """:class:`RMSNorm2D` on a 2.5-D activation (``[B/(d q), ..., H/q]``); the weight
    gradient is summed over "depth" and "row"."""

    _layout = "2.5d"


class RMSNorm3D(RMSNorm2D):
    """:class:`RMSNorm2D` on a 3-D activation whose H is split by ``hidden_mesh_dim``
    (``"output"`` by default, or ``"weight"``, as :class:`LayerNorm3D`); an input recorded in
    the other layout raises ValueError."""

    _layout = "3d"


__all__ += ["LayerNorm2D", "LayerNorm2p5D", "LayerNorm3D", "RMSNorm2D", "RMSNorm2p5D",
            "RMSNorm3D"]


# Embedding ------------------------------------------------------------------------------------


class _SumGradOver(torch.autograd.Function):
    """Identity forward on a parameter replicated over the batch-splitting groups; backward
    sums its gradient over them (each rank saw only its batch block)."""

    @staticmethod
    def forward(ctx, w, groups):
        ctx.groups = groups
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _sum_over(grad.contiguous(), ctx.groups), None


class Embedding2D(_MeshParams, nn.Module):
    """``nn.Embedding`` producing a 2-D activation: ids ``[B/q, ...]`` (batch block "row",
    replicated over "col"; ``tpx.split_input(ids, mesh)``) -> ``[B/q, ..., D/q]`` (D block
    "col"). The table holds all rows and block "col" of the columns (``[V, D/q]``), replicated
    over "row": the lookup needs no communication; the gradient is summed over "row".

    Initialised like ``nn.Embedding`` over the full table, then sliced: by default
    (``src_rank=0``) mesh rank ``src_rank`` draws the table and every rank receives its
    columns, so the layer equals rank 0's ``nn.Embedding`` whatever the other ranks' seeds;
    ``src_rank=None``: every rank draws and keeps its columns, no communication of weights
    (ranks seeded alike, checked). Building the layer is a collective over the mesh's ranks."""

    _layout = "2d"

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh,
                 padding_idx: Optional[int] = None, device=None, dtype=None, *,
                 hidden_mesh_dim: Optional[str] = None, src_rank: Optional[int] = 0) -> None:
        super().__init__()
        who = type(self).__name__
        self._begin(mesh, who, dict(num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                                    padding_idx=padding_idx, hidden_mesh_dim=hidden_mesh_dim,
                                    dtype=str(dtype)), src_rank)
        # Validates the sizes and normalises padding_idx as nn.Embedding does, without a draw.
        shape = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device="meta")
        self._configure(shape, mesh, hidden_mesh_dim)
        self._alloc(("weight",), device, dtype)

        def full():
            emb = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device,
                               dtype=dtype)
            return {"weight": emb.weight}

        self._fill(who, self._layer_config(), full, drawn=True)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, mesh, *,
                       hidden_mesh_dim: Optional[str] = None, src_rank: Optional[int] = 0):
        """This rank's columns of rank ``src_rank``'s ``nn.Embedding`` (``None``: of its own,
        no communication; the tables must then be equal, which is checked)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"tpx.{cls.__name__}.from_embedding: expected an nn.Embedding; got "
                            f"{type(embedding).__name__}")
        unsupported = [a for a in ("max_norm", "sparse") if getattr(embedding, a)]
        if embedding.scale_grad_by_freq:
            unsupported.append("scale_grad_by_freq")
        if unsupported:
            raise ValueError(f"tpx.{cls.__name__}.from_embedding: {unsupported} not supported")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        who = cls.__name__
        self._begin(mesh, who, dict(num_embeddings=embedding.num_embeddings,
                                    embedding_dim=embedding.embedding_dim,
                                    padding_idx=embedding.padding_idx,
                                    hidden_mesh_dim=hidden_mesh_dim,
                                    dtype=str(embedding.weight.dtype)), src_rank)
        self._configure(embedding, mesh, hidden_mesh_dim)
        self._alloc(("weight",), embedding.weight.device, embedding.weight.dtype)
        self._fill(who, self._layer_config(), lambda: {"weight": embedding.weight}, drawn=False)
        return self

    def _configure(self, emb: nn.Embedding, mesh, hidden_mesh_dim) -> None:
        who = type(self).__name__
        info = check_mesh(mesh, self._layout, who)
        if self._layout == "3d":
            hidden_mesh_dim = _check_hidden_dim(who, hidden_mesh_dim or "output")
        elif hidden_mesh_dim is not None:
            raise ValueError(f"tpx.{who}: `hidden_mesh_dim` is only for the 3-D layers")
        bdims, hdims = _splits(info, hidden_mesh_dim)
        q, d = info.q, emb.embedding_dim
        _check_divides(who, "embedding_dim", d, q, f"split over mesh dim {hdims}")
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, d
        self.padding_idx = emb.padding_idx
        self.hidden_mesh_dim = hidden_mesh_dim
        self.mesh_info = info
        self._hdims = tuple(hdims)
        self._batch_groups = [info.group_name(b) for b in bdims]
        self._ids_layout = _layout_of(info, hidden_mesh_dim, "ids")
        self._out_layout = _layout_of(info, hidden_mesh_dim)

    def _param_splits(self) -> List[BlockSpec]:
        """The table's rows are whole, its columns split (see :class:`BlockSpec`)."""
        return [BlockSpec("weight", ((), self._hdims),
                          (self.num_embeddings, self.embedding_dim))]

    def _layer_config(self) -> dict:
        return dict(num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
                    padding_idx=self.padding_idx, hidden_mesh_dim=self.hidden_mesh_dim)

    def forward(self, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.is_floating_point():
            raise TypeError(f"tpx.{type(self).__name__}: `ids` must be an integer Tensor")
        _check_layout(type(self).__name__, ids, self._ids_layout)
        w = _SumGradOver.apply(self.weight, self._batch_groups) if self.weight.requires_grad \
            else self.weight
        return _mark(nn.functional.embedding(ids, w, self.padding_idx), self._out_layout)


class Embedding2p5D(Embedding2D):
    """:class:`Embedding2D` for the 2.5-D layout: ids ``[B/(d q), ...]`` (batch block
    ``depth*q + row``) -> ``[B/(d q), ..., D/q]``; gradient summed over "depth" and "row"."""

    _layout = "2.5d"


class Embedding3D(Embedding2D):
    """:class:`Embedding2D` for the 3-D layout: ids ``[B/q^2, ...]`` -> ``[B/q^2, ..., D/q]``
    with D split by ``hidden_mesh_dim`` (default "output", the input layout of
    :class:`Linear3D`); gradient summed over "input" and the other activation dim. The ids
    must be split with the same ``hidden_mesh_dim`` (``tpx.split_input(ids, mesh,
    hidden_mesh_dim=...)``): ids recorded with the other one raise ValueError."""

    _layout = "3d"


__all__ += ["Embedding2D", "Embedding2p5D", "Embedding3D"]
