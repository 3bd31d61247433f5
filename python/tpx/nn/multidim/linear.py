"""``Linear2D`` (SUMMA), ``Linear2p5D`` and ``Linear3D``."""

from __future__ import annotations

from typing import List, Optional

from torch import Tensor, nn

from ... import ops
from ...comm.guard import guarded
from ...ops.amp import autocast_casts
from ...mesh import check_mesh
from ...layout.param_dtensors import local_of, local_params, read_for_input_grad, watch_params
from ..linear import full_linear_init
from .blocks import BlockSpec, MeshParams, check_divides, check_hidden_dim, other_3d
from .layout import check_layout, layout_of, mark_layout
from ..sources import check_source

__all__ = ["Linear2D", "Linear2p5D", "Linear3D"]


def check_positive(who: str, **sizes) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"tpx.{who}: `{name}` must be a positive int; got {v!r}")


class _MultiDimLinear(MeshParams, nn.Module):
    _layout = ""

    def __init__(self, in_features: int, out_features: int, mesh, bias: bool = True,
                 device=None, dtype=None, *, src_rank: Optional[int] = 0, **kw) -> None:
        super().__init__()
        who = type(self).__name__
        self._check_kw(who, kw)
        self._begin(mesh, who, dict(in_features=in_features, out_features=out_features,
                                    bias=bool(bias), **kw), src_rank)
        check_positive(who, in_features=in_features, out_features=out_features)
        self._configure(in_features, out_features, mesh, **kw)
        self._alloc(("weight", "bias") if bias else ("weight",), device, dtype)

        def full():
            w, b = full_linear_init(in_features, out_features, bias, device, dtype)
            return {"weight": w, "bias": b}

        self._fill(who, self._layer_config(), full, drawn=True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh, *, src_rank: Optional[int] = 0, **kw):
        """This rank's blocks of rank ``src_rank``'s ``nn.Linear`` (every rank of the mesh
        passes one of the same sizes; only the source's values are read, and every rank
        receives its blocks of them). ``src_rank=None``: each rank copies its blocks of its
        own layer, with no communication of weights (ranks whose layers differ get a warning). A
        collective over the mesh's ranks."""
        check_source(cls, "from_linear", linear, nn.Linear)
        cls._check_kw(cls.__name__, kw)
        return cls._converted(
            mesh, src_rank, dict(in_features=linear.in_features,
                                 out_features=linear.out_features, bias=linear.bias is not None,
                                 dtype=str(linear.weight.dtype), **kw),
            lambda self: self._configure(linear.in_features, linear.out_features, mesh, **kw),
            {"weight": linear.weight, "bias": linear.bias})

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
        local_in = local_of(self.weight).shape[1]
        if x.dim() < 2 or x.shape[-1] != local_in:
            raise ValueError(f"tpx.{who}: input must be this rank's block [batch, ..., "
                             f"{local_in}] ({self.in_features} input features "
                             f"split {self.in_features // local_in} ways); got "
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
        check_divides(who, "in_features", in_features, q, f"q = {q} blocks along 'row'")
        check_divides(who, "out_features", out_features, q, f"q = {q} blocks along 'col'")
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.mesh_info = info
        self._groups = (info.group_name("row"), info.group_name("col"),
                        info.group_name("depth") if self._layout == "2.5d" else None)
        self._in_layout = self._out_layout = layout_of(info, None)

    def _weight_splits(self):
        return ("col",), ("row",)

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        check_layout(type(self).__name__, x, self._in_layout)
        weight, bias = local_params(self.weight, self.bias)
        y = watch_params(ops.linear_2d(x, weight, bias, *self._groups), self.weight,
                         read=read_for_input_grad(x, self.weight))
        return mark_layout(y, self._out_layout)


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
        check_hidden_dim(who, kw["hidden_mesh_dim"])

    def _configure(self, in_features, out_features, mesh, hidden_mesh_dim: Optional[str] = None,
                   chunks: Optional[int] = None) -> None:
        who = type(self).__name__
        info = check_mesh(mesh, "3d", who)
        h = check_hidden_dim(who, hidden_mesh_dim)
        o = other_3d(h)
        if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"tpx.{who}: `chunks` must be None or an int >= 1; got {chunks!r}")
        q = info.q
        check_divides(who, "in_features", in_features, q, f"q = {q} blocks along {h!r}")
        check_divides(who, "out_features", out_features, q * q,
                       f"q^2 = {q * q} blocks along ({o!r}, 'input')")
        self.in_features, self.out_features, self.q = in_features, out_features, q
        self.mesh_info = info
        self.hidden_mesh_dim, self.output_mesh_dim, self.chunks = h, o, chunks
        self._groups = (info.group_name("input"), info.group_name(o), info.group_name(h))
        self._in_layout, self._out_layout = layout_of(info, h), layout_of(info, o)

    def _weight_splits(self):
        return (self.output_mesh_dim, "input"), (self.hidden_mesh_dim,)

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        check_layout(type(self).__name__, x, self._in_layout, linear=True)
        weight, bias = local_params(self.weight, self.bias)
        y = ops.linear_3d(x, weight, bias, *self._groups, self.chunks)[0]
        y = watch_params(y, self.weight, read=read_for_input_grad(x, self.weight))
        return mark_layout(y, self._out_layout)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", hidden_mesh_dim={self.hidden_mesh_dim!r}"
