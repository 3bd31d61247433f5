"""``LayerNorm`` and ``RMSNorm`` over the 2-D, 2.5-D and 3-D layouts: statistics of a row
reduced over the mesh dim that splits the features."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from ... import ops
from ...comm.guard import guarded
from ...ops.amp import norm_input
from ...mesh import MeshInfo, check_mesh
from ...layout.param_dtensors import local_params, watch_params
from .blocks import BlockSpec, MeshParams, block_of, check_divides, check_hidden_dim, mesh_splits
from .layout import check_layout, layout_of, mark_layout
from .linear import check_positive
from ..sources import check_source

# Norms ------------------------------------------------------------------------------------------


def _norm_groups(info: MeshInfo, hidden_mesh_dim: Optional[str]) -> Tuple[str, List[str]]:
    """(the group that splits the hidden features, the groups that split the batch)."""
    bdims, hdims = mesh_splits(info, hidden_mesh_dim)
    return info.group_name(hdims[0]), [info.group_name(d) for d in bdims]


def _normalized_size(who: str, normalized_shape) -> int:
    if isinstance(normalized_shape, int):
        return normalized_shape
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"tpx.{who}: only a normalized_shape of one dimension (the hidden "
                         f"features) is supported; got {shape}")
    return int(shape[0])


class _MultiDimNorm(MeshParams, nn.Module):
    _layout = ""

    def _configure(self, features: int, mesh, hidden_mesh_dim: Optional[str]) -> None:
        who = type(self).__name__
        check_positive(who, normalized_shape=features)
        info = check_mesh(mesh, self._layout, who)
        if self._layout == "3d":
            hidden_mesh_dim = check_hidden_dim(who, hidden_mesh_dim or "output")
        elif hidden_mesh_dim is not None:
            raise ValueError(f"tpx.{who}: `hidden_mesh_dim` is only for the 3-D layers")
        bdims, hdims = mesh_splits(info, hidden_mesh_dim)
        q = info.q
        check_divides(who, "normalized_shape", features, q, f"split over mesh dim {hdims}")
        self.normalized_shape = (features,)
        self.hidden_mesh_dim = hidden_mesh_dim
        self.mesh_info = info
        hi, _ = block_of(info, hdims)
        self._range = (hi * features // q, (hi + 1) * features // q)
        self._hdims = tuple(hdims)
        self._groups = _norm_groups(info, hidden_mesh_dim)
        self._in_layout = layout_of(info, hidden_mesh_dim)

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
        no communication; ranks whose modules differ get a warning)."""
        check_source(cls, "from_layernorm", layernorm, nn.LayerNorm)
        ln = layernorm

        def configure(self):
            self._configure(_normalized_size(cls.__name__, ln.normalized_shape), mesh,
                            hidden_mesh_dim)
            self.eps = ln.eps
            self.elementwise_affine = ln.elementwise_affine

        return cls._converted(
            mesh, src_rank, dict(normalized_shape=tuple(ln.normalized_shape), eps=ln.eps,
                                 weight=ln.weight is not None, bias=ln.bias is not None,
                                 hidden_mesh_dim=hidden_mesh_dim, dtype=str(_param_dtype(ln))),
            configure, {"weight": ln.weight, "bias": ln.bias})

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        check_layout(type(self).__name__, x, self._in_layout)
        x = norm_input(x)  # fp32 where torch's autocast lists layer_norm as fp32 (tpx.ops.amp)
        hidden, batch = self._groups
        weight, bias = local_params(self.weight, self.bias)
        y = ops.mesh_layer_norm(x, weight, bias, self.eps, self.normalized_shape[0], hidden,
                                batch)
        # torch's layer norm keeps its weight and bias for any of its gradients
        y = watch_params(y, self.weight, self.bias)
        return mark_layout(y, self._in_layout)


def _shape_arg(normalized_shape):
    """``normalized_shape`` in a form that compares across ranks."""
    if isinstance(normalized_shape, int):
        return normalized_shape
    try:
        return tuple(normalized_shape)
    except TypeError:
        return repr(normalized_shape)


def _param_dtype(module: nn.Module):
    for p in module.parameters():
        return p.dtype
    return None


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
        communication (ranks whose modules differ get a warning)."""
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
        def configure(self):
            self._configure(features, mesh, hidden_mesh_dim)
            self.eps = eps
            self.elementwise_affine = weight is not None

        return cls._converted(
            mesh, src_rank, dict(normalized_shape=features, eps=eps, weight=weight is not None,
                                 hidden_mesh_dim=hidden_mesh_dim,
                                 dtype=str(None if weight is None else weight.dtype)),
            configure, {"weight": weight})

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        self._check_input(x)
        check_layout(type(self).__name__, x, self._in_layout)
        x = norm_input(x)  # fp32 where torch's autocast lists rms_norm as fp32 (tpx.ops.amp)
        hidden, batch = self._groups
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight, = local_params(self.weight)
        y = ops.mesh_rms_norm(x, weight, eps, self.normalized_shape[0], hidden, batch)
        y = watch_params(y, self.weight, read=x.requires_grad)  # read for x's gradient
        return mark_layout(y, self._in_layout)

class RMSNorm2p5D(RMSNorm2D):
    """:class:`RMSNorm2D` on a 2.5-D activation (``[B/(d q), ..., H/q]``); the weight
    gradient is summed over "depth" and "row"."""

    _layout = "2.5d"


class RMSNorm3D(RMSNorm2D):
    """:class:`RMSNorm2D` on a 3-D activation whose H is split by ``hidden_mesh_dim``
    (``"output"`` by default, or ``"weight"``, as :class:`LayerNorm3D`); an input recorded in
    the other layout raises ValueError."""

    _layout = "3d"


__all__ = ["LayerNorm2D", "LayerNorm2p5D", "LayerNorm3D", "RMSNorm2D", "RMSNorm2p5D",
            "RMSNorm3D"]
