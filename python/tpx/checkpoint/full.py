"""What a sharded parameter is, for state dicts (:class:`Sharded`: a 1-D layer's parameter;
:class:`MeshSharded`: a multi-dimensional one), and full <-> sharded state dicts: every tpx
parameter gathered back to the tensor of the original model (same key, same shape), and a full
state dict sliced into a sharded model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..group import mesh_for_group
from ..mappings import gather_dim
from ..nn.multidim import BlockSpec, block_specs
from ..nn.dtensor_io import DTensor
from ..sharding import MeshSharding, local_of, raw_state_dict


@dataclass
class Sharded:
    key: str                      # key in the original model's state dict
    module: nn.Module
    name: str                     # parameter name in the tpx module
    dim: int                      # sharded dim of the local tensor
    rows: List[List[Tuple[int, int]]]  # per rank, ranges of the full tensor along dim
    transposed: bool              # the original tensor is the transpose of the local one

    @property
    def rank(self) -> int:
        return dist.get_rank(self.module.group)

    def param(self) -> Tensor:
        return getattr(self.module, self.name)

    def local(self) -> Tensor:
        return local_of(self.param())

    def full_size(self) -> int:
        return max(e for r in self.rows for _, e in r)

    def orig_dim(self) -> int:
        return 1 - self.dim if self.transposed else self.dim

    def slice_of(self, full: Tensor) -> Tensor:
        """This rank's local tensor cut from the ORIGINAL full tensor."""
        d = self.orig_dim()
        pieces = [full.narrow(d, s, e - s) for s, e in self.rows[self.rank]]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
        return out.t() if self.transposed else out


def sharded_params(model: nn.Module) -> Iterator[Sharded]:
    """Every sharded parameter of the tpx layers in ``model``, in module order (the same on
    every rank)."""
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "_shards") or not hasattr(mod, "group"):
            continue
        pre = f"{prefix}." if prefix else ""
        for name, dim, rows in mod._shards():
            transposed = name == "weight" and getattr(mod, "_transposed_weight", False)
            yield Sharded(pre + name, mod, name, dim, rows, transposed)


@dataclass
class MeshSharded:
    """A parameter of a multi-dimensional layer: this rank holds one block of the full
    tensor (``spec`` says which), in the original orientation."""

    key: str
    module: nn.Module
    spec: BlockSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def info(self):
        return self.module.mesh_info

    def local(self) -> Tensor:
        return local_of(getattr(self.module, self.spec.name))

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
        if not hasattr(mod, "_param_splits") or not hasattr(mod, "mesh_info"):
            continue
        pre = f"{prefix}." if prefix else ""
        for spec in block_specs(mod):
            yield MeshSharded(pre + spec.name, mod, spec)


def mesh_dtensor(sh: MeshSharded, local: Optional[Tensor] = None) -> Tensor:
    """The block (``local``: a tensor of the block's shape in its place, by default the
    parameter itself) as a ``DTensor`` of the full shape over the layer's mesh
    (:meth:`tpx.sharding.MeshSharding.dtensor`)."""
    return MeshSharding(sh.spec, sh.info).dtensor(sh.local() if local is None else local)


def gather_full(sh: Sharded, local: Optional[Tensor] = None) -> Tensor:
    """The full tensor (original orientation) assembled from every rank's pieces (``local``:
    a tensor of the parameter's local shape in its place, by default the parameter)."""
    local = (sh.local() if local is None else local).detach()
    sizes = [sum(e - s for s, e in r) for r in sh.rows]
    rank = sh.rank
    gathered = gather_dim(local, sh.dim, sizes, sum(sizes[:rank]), sh.module.group)
    shape = list(local.shape)
    shape[sh.dim] = sh.full_size()
    flat = [r for ranges in sh.rows for r in ranges]
    if all(a[1] == b[0] for a, b in zip(flat, flat[1:])) and flat[0][0] == 0:
        full = gathered  # ranks hold consecutive blocks: the gather is the full tensor
    else:
        full = local.new_empty(shape)
        offset = 0
        for ranges in sh.rows:
            for s, e in ranges:
                full.narrow(sh.dim, s, e - s).copy_(gathered.narrow(sh.dim, offset, e - s))
                offset += e - s
    return full.t() if sh.transposed else full


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Dict[str, Tensor]:
    """The unsharded state dict of a model sharded by tpx, with the original model's keys and
    shapes (on every rank, or only on the group's rank 0 with ``rank0_only=True``: the
    others return ``{}`` but must still call). The parameters of the multi-dimensional
    layers are all-gathered over the mesh dimensions that split them (``nn.Linear`` weight
    ``[out, in]``, bias ``[out]``, norm weight ``[H]``, embedding ``[V, D]``). A model that
    FSDP2 shards too gets torch's full state dict (``rank0_only``: on global rank 0, on the
    CPU). Collective."""
    if fsdp_managed(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        return dict(get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=rank0_only)))
    with raw_state_dict():
        state = {k: v.detach() for k, v in model.state_dict().items()}
    for sh in sharded_params(model):
        state[sh.key] = gather_full(sh)
    for ms in mesh_params(model):
        state[ms.key] = ms.gather()
    for key, value in state.items():
        if isinstance(value, DTensor):  # a replicated parameter of a tpx layer, a PyTorch style's
            state[key] = value.full_tensor()
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


def check_full_shape(where: str, sh: Sharded, full: Tensor) -> None:
    d = sh.orig_dim()
    if full.dim() != sh.local().dim() or full.shape[d] != sh.full_size():
        raise ValueError(f"tpx.checkpoint.{where}: {sh.key} has shape {tuple(full.shape)}; the "
                         f"model expects {sh.full_size()} entries along dim {d}")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Dict[str, Tensor],
                         strict: bool = True) -> None:
    """Loads a full (unsharded) state dict into a model sharded by tpx: each tpx layer keeps
    its slice (a multi-dimensional layer its block), every other tensor is loaded whole. No
    communication."""
    local = dict(state_dict)
    for sh in sharded_params(model):
        if sh.key not in local:
            continue
        check_full_shape("load_full_state_dict", sh, local[sh.key])
        local[sh.key] = sh.slice_of(local[sh.key])
    for ms in mesh_params(model):
        if ms.key not in local:
            continue
        ms.check_full_shape("load_full_state_dict", local[ms.key].shape)
        local[ms.key] = ms.slice_of(local[ms.key])
    with raw_state_dict():
        own = model.state_dict(keep_vars=True)
        for key, value in local.items():
            if key in own and isinstance(value, Tensor):
                local[key] = as_stored(own[key], value)
        model.load_state_dict(local, strict=strict)


def as_stored(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (this rank's part, in the parameter's local orientation) in the parameter's
    form: a ``DTensor`` with its placements when it is one."""
    if isinstance(param, DTensor) and not isinstance(local, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


def is_chunked(sh: Sharded) -> bool:
    """Whether each rank holds ``shard_range`` of the full tensor: a DTensor ``Shard`` layout."""
    world, full = len(sh.rows), sh.full_size()
    per = -(-full // world)
    for r, ranges in enumerate(sh.rows):
        start = min(r * per, full)
        if ranges != [(start, min(start + per, full))]:
            return False
    return True


def chunked_dtensor(sh: Sharded, local: Tensor) -> Tensor:
    """``local`` (this rank's ``shard_range`` block, local orientation) as a ``DTensor`` of
    the full shape in the original orientation, ``Shard(dim)`` over the layer's group. No
    communication."""
    from torch.distributed.tensor import DTensor, Shard

    local = local.detach()
    if sh.transposed:
        local = local.t()
    shape = list(local.shape)
    d = sh.orig_dim()
    shape[d] = sh.full_size()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh_for_group(sh.module.group, local.device.type),
                              [Shard(d)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


OPTIM_KEY = "optim"  # the key of the optimizer state in a checkpoint written by :func:`save`


def fsdp_managed(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
