"""What a sharded parameter of a tpx layer is, under its key in the original model's state
dict: :class:`Sharded` (a 1-D layer's parameter, its layout a
:class:`~tpx.layout.sharding.GroupSharding`) and :class:`MeshSharded` (a multi-dimensional
layer's, a :class:`~tpx.layout.sharding.MeshSharding`), listed in module order (the same on
every rank) by :func:`sharded_params` and :func:`mesh_params`. Read by the checkpoints, the
replica checks and the plan check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Tuple

from torch import Tensor, nn

from .param_dtensors import local_of
from .sharding import GroupSharding, MeshSharding, group_layouts, mesh_layouts

if TYPE_CHECKING:
    from ..nn.multidim import BlockSpec

__all__ = ["Sharded", "MeshSharded", "sharded_params", "mesh_params"]


@dataclass
class Sharded:
    """A parameter of a 1-D layer under its key in the original model's state dict, with its
    layout (:class:`tpx.layout.sharding.GroupSharding`, the one description of it)."""

    key: str                      # key in the original model's state dict
    module: nn.Module
    name: str                     # parameter name in the tpx module
    layout: GroupSharding

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def dim(self) -> int:         # sharded dim of the local tensor
        return self.layout.dim

    @property
    def rows(self) -> Tuple[Tuple[Tuple[int, int], ...], ...]:  # per rank, ranges along dim
        return self.layout.rows

    @property
    def transposed(self) -> bool:  # the original tensor is the transpose of the local one
        return self.layout.transposed

    def param(self) -> Tensor:
        return getattr(self.module, self.name)

    def local(self) -> Tensor:
        return local_of(self.param())

    def full_size(self) -> int:
        return self.layout.full_size()

    def orig_dim(self) -> int:
        return self.layout.orig_dim()

    def slice_of(self, full: Tensor) -> Tensor:
        """This rank's local tensor cut from the ORIGINAL full tensor."""
        return self.layout.slice_of(full)


def sharded_params(model: nn.Module) -> Iterator[Sharded]:
    """Every sharded parameter of the tpx layers in ``model``, in module order (the same on
    every rank); then the same parameters under the keys of modules above them that hold
    them too (BERT's LM head bias, ``cls.predictions.bias``, is its decoder's)."""
    seen, layer_of = set(), {}
    for prefix, mod in model.named_modules():
        pre = f"{prefix}." if prefix else ""
        for name, layout in group_layouts(mod):
            seen.add(pre + name)
            layer_of.setdefault(id(getattr(mod, name)), (mod, name, layout))
            yield Sharded(pre + name, mod, name, layout)
    if not layer_of:
        return
    for key, p in model.named_parameters(remove_duplicate=False):
        if key not in seen and id(p) in layer_of:
            yield Sharded(key, *layer_of[id(p)])


@dataclass
class MeshSharded:
    """A parameter of a multi-dimensional layer under its key in the original model's state
    dict: this rank holds one block of the full tensor, in the original orientation (its
    layout, :class:`tpx.layout.sharding.MeshSharding`, says which)."""

    key: str
    module: nn.Module
    layout: MeshSharding

    @property
    def name(self) -> str:
        return self.layout.spec.name

    @property
    def spec(self) -> BlockSpec:
        return self.layout.spec

    @property
    def info(self):
        return self.layout.info

    def local(self) -> Tensor:
        return local_of(getattr(self.module, self.name))

    def gather(self) -> Tensor:
        return self.spec.gather(self.local(), self.info)

    def slice_of(self, full: Tensor) -> Tensor:
        return self.spec.slice_of(full, self.info)

    def index(self) -> Tuple[slice, ...]:
        return tuple(slice(s, e) for s, e in self.spec.ranges(self.info))

    def check_full_shape(self, where: str, shape) -> None:
        if tuple(shape) != tuple(self.spec.full_shape):
            raise ValueError(f"tpx.checkpoint.{where}: {self.key} has shape {tuple(shape)}; the "
                             f"model expects {tuple(self.spec.full_shape)}")


def mesh_params(model: nn.Module) -> Iterator[MeshSharded]:
    """Every parameter of the multi-dimensional layers in ``model``, in module order."""
    for prefix, mod in model.named_modules():
        pre = f"{prefix}." if prefix else ""
        for name, layout in mesh_layouts(mod):
            yield MeshSharded(pre + name, mod, layout)
