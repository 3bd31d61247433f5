"""``Embedding2D`` / ``Embedding2p5D`` / ``Embedding3D``."""

from __future__ import annotations

from typing import List, Optional

import torch
from ... import mappings
from ...comm.guard import guarded
from ...layout.param_dtensors import local_params
from torch import Tensor, nn

from ...mesh import check_mesh
from .blocks import BlockSpec, MeshParams, check_divides, check_hidden_dim, mesh_splits
from .layout import check_layout, layout_of, mark_layout
from ..sources import check_source

# Embedding ------------------------------------------------------------------------------------


class Embedding2D(MeshParams, nn.Module):
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
        no communication; ranks whose modules differ get a warning)."""
        check_source(cls, "from_embedding", embedding, nn.Embedding)
        unsupported = [a for a in ("max_norm", "sparse") if getattr(embedding, a)]
        if embedding.scale_grad_by_freq:
            unsupported.append("scale_grad_by_freq")
        if unsupported:
            raise ValueError(f"tpx.{cls.__name__}.from_embedding: {unsupported} not supported")
        return cls._converted(
            mesh, src_rank, dict(num_embeddings=embedding.num_embeddings,
                                 embedding_dim=embedding.embedding_dim,
                                 padding_idx=embedding.padding_idx,
                                 hidden_mesh_dim=hidden_mesh_dim,
                                 dtype=str(embedding.weight.dtype)),
            lambda self: self._configure(embedding, mesh, hidden_mesh_dim),
            {"weight": embedding.weight})

    def _configure(self, emb: nn.Embedding, mesh, hidden_mesh_dim) -> None:
        who = type(self).__name__
        info = check_mesh(mesh, self._layout, who)
        if self._layout == "3d":
            hidden_mesh_dim = check_hidden_dim(who, hidden_mesh_dim or "output")
        elif hidden_mesh_dim is not None:
            raise ValueError(f"tpx.{who}: `hidden_mesh_dim` is only for the 3-D layers")
        bdims, hdims = mesh_splits(info, hidden_mesh_dim)
        q, d = info.q, emb.embedding_dim
        check_divides(who, "embedding_dim", d, q, f"split over mesh dim {hdims}")
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, d
        self.padding_idx = emb.padding_idx
        self.hidden_mesh_dim = hidden_mesh_dim
        self.mesh_info = info
        self._hdims = tuple(hdims)
        self._batch_groups = [info.group_name(b) for b in bdims]
        self._ids_layout = layout_of(info, hidden_mesh_dim, "ids")
        self._out_layout = layout_of(info, hidden_mesh_dim)

    def _param_splits(self) -> List[BlockSpec]:
        """The table's rows are whole, its columns split (see :class:`BlockSpec`)."""
        return [BlockSpec("weight", ((), self._hdims),
                          (self.num_embeddings, self.embedding_dim))]

    def _layer_config(self) -> dict:
        return dict(num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
                    padding_idx=self.padding_idx, hidden_mesh_dim=self.hidden_mesh_dim)

    @guarded
    def forward(self, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.is_floating_point():
            raise TypeError(f"tpx.{type(self).__name__}: `ids` must be an integer Tensor")
        check_layout(type(self).__name__, ids, self._ids_layout)
        w, = local_params(self.weight)
        w = mappings.all_reduce_grad_over(w, self._batch_groups) if w.requires_grad else w
        return mark_layout(nn.functional.embedding(ids, w, self.padding_idx), self._out_layout)


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


__all__ = ["Embedding2D", "Embedding2p5D", "Embedding3D"]
