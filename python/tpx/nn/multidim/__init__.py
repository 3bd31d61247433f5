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

Files: ``blocks.py`` (how parameters are split: :class:`BlockSpec`, initial weights),
``layout.py`` (layout records and checks, :func:`split_input`, :func:`gather_output`),
``linear.py``, ``norm.py``, ``embedding.py`` (the layers).

Each layer describes its parameters with ``_param_splits()`` (one :class:`BlockSpec` per
parameter: for each dim, the mesh dims splitting it, outermost first); the initial weights
(mesh rank ``src_rank``'s full tensors, each rank receiving its block) and
:mod:`tpx.checkpoint` use it.
"""

from .blocks import BlockSpec, block_of, block_specs, mesh_splits
from .embedding import Embedding2D, Embedding2p5D, Embedding3D
from .layout import gather_output, split_input
from .linear import Linear2D, Linear2p5D, Linear3D
from .norm import LayerNorm2D, LayerNorm2p5D, LayerNorm3D, RMSNorm2D, RMSNorm2p5D, RMSNorm3D

__all__ = ["Linear2D", "Linear2p5D", "Linear3D", "split_input", "gather_output",
           "LayerNorm2D", "LayerNorm2p5D", "LayerNorm3D", "RMSNorm2D", "RMSNorm2p5D",
           "RMSNorm3D", "Embedding2D", "Embedding2p5D", "Embedding3D", "BlockSpec"]
