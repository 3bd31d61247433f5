"""Which layout an activation of the multi-dimensional layers is in (recorded on tensors
and autograd nodes, checked by every consumer), and the edges of a model: :func:`split_input`
and :func:`gather_output`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from ... import mappings
from ...comm.guard import guarded
from torch import Tensor

from ...mesh import MeshInfo
from .blocks import (
    HIDDEN_3D, block_of, check_divides, check_hidden_dim, block_mesh_info,
    mesh_splits)

__all__ = ["split_input", "gather_output"]


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


def layout_of(info: MeshInfo, hidden_mesh_dim: Optional[str], kind: str = "act") -> _Layout:
    bdims, hdims = mesh_splits(info, hidden_mesh_dim)
    mesh = (info.layout, tuple(info.ranks), tuple(info.shape))
    if kind == "act":
        return _Layout(mesh, tuple(bdims), tuple(hdims))
    return _Layout(mesh, tuple(bdims) if kind == "ids" else (), (), kind)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def mark_layout(t: Tensor, layout: _Layout) -> Tensor:
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


def check_layout(who: str, t: Tensor, want: _Layout, linear: bool = False) -> None:
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


@guarded
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
    info = block_mesh_info(mesh, "split_input")
    if info.layout == "3d":
        check_hidden_dim("split_input", hidden_mesh_dim or "output")
    elif hidden_mesh_dim is not None:
        raise ValueError("tpx.split_input: `hidden_mesh_dim` is only for 3-D meshes")
    if info.layout == "1d":
        return x
    bdims, hdims = mesh_splits(info, hidden_mesh_dim)
    mesh_sig = layout_of(info, hidden_mesh_dim).mesh
    done = [lay for lay in _layouts_of(x) if lay.kind != "full" and lay.mesh == mesh_sig]
    if done:
        raise ValueError(f"tpx.split_input: `x` is already this rank's block "
                         f"({done[0].describe()}); split_input takes the full tensor "
                         f"[B, ..., H] (pass the block to the layers as it is)")
    if not x.is_floating_point() and not x.is_complex():
        # Token ids (an integer tensor) have no hidden dimension: batch split only.
        if x.dim() < 1:
            raise ValueError("tpx.split_input: ids must have a batch dimension")
        check_divides("split_input", "x.shape[0] (batch)", x.shape[0],
                       block_of(info, bdims)[1], f"split over mesh dims {bdims}")
        bi, bn = block_of(info, bdims)
        b = x.shape[0] // bn
        return mark_layout(x.narrow(0, bi * b, b), layout_of(info, hidden_mesh_dim, "ids"))
    if x.dim() < 2:
        raise ValueError(f"tpx.split_input: `x` must be [batch, ..., hidden]; got shape "
                         f"{tuple(x.shape)}")
    check_divides("split_input", "x.shape[0] (batch)", x.shape[0], block_of(info, bdims)[1],
                   f"split over mesh dims {bdims}")
    check_divides("split_input", "x.shape[-1] (hidden)", x.shape[-1], block_of(info, hdims)[1],
                   f"split over mesh dim {hdims}")
    blocks = (block_of(info, bdims), block_of(info, hdims))
    names = [info.group_name(d) for d in bdims], [info.group_name(d) for d in hdims]
    return mark_layout(mappings.split_blocks(x, blocks, *names), layout_of(info, hidden_mesh_dim))


@guarded
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
    info = block_mesh_info(mesh, "gather_output")
    if info.layout == "3d":
        if hidden_mesh_dim is not None:
            check_hidden_dim("gather_output", hidden_mesh_dim)
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
                           and found[0].hidden[0] in HIDDEN_3D else "output")
    check_layout("gather_output", y, layout_of(info, hidden_mesh_dim))
    bdims, hdims = mesh_splits(info, hidden_mesh_dim)
    blocks = (block_of(info, bdims), block_of(info, hdims))
    names = [info.group_name(d) for d in bdims], [info.group_name(d) for d in hdims]
    return mark_layout(mappings.gather_blocks(y, blocks, *names), layout_of(info, None, "full"))
