"""Full <-> sharded state dicts: every tpx parameter (:mod:`tpx.layout.sharded` says what it
is) gathered back to the tensor of the original model (same key, same shape), and a full state
dict sliced into a sharded model."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.entry import collective_call
from ..comm.groups import mesh_for_group
from ..layout.dtensor_io import DTensor
from ..layout.sharding import collect_unstated, raw_state_dict, unstated_layouts
from ..layout.param_dtensors import local_of
from ..layout.sharded import MeshSharded, Sharded, mesh_params, sharded_params  # noqa: F401


def mesh_dtensor(sh: MeshSharded, local: Optional[Tensor] = None) -> Tensor:
    """The block (``local``: a tensor of the block's shape in its place, by default the
    parameter itself) as a ``DTensor`` of the full shape over the layer's mesh
    (:meth:`tpx.layout.sharding.MeshSharding.dtensor`)."""
    return sh.layout.dtensor(sh.local() if local is None else local)


def gather_full(sh: Sharded, local: Optional[Tensor] = None) -> Tensor:
    """The full tensor (original orientation) assembled from every rank's pieces (``local``:
    a tensor of the parameter's local shape in its place, by default the parameter)."""
    return sh.layout.gather(sh.local() if local is None else local)


def model_ranks(model: nn.Module) -> list:
    """The global ranks over which ``model``'s parameters are split or replicated: those of
    its ``DTensor`` s' meshes and of its tpx layers' groups (this rank alone for a model
    no group holds)."""
    ranks = set()
    for p in model.parameters():
        if isinstance(p, DTensor):
            ranks.update(int(r) for r in p.device_mesh.mesh.flatten().tolist())
    for m in model.modules():
        group = getattr(m, "group", None)
        if isinstance(group, dist.ProcessGroup):
            ranks.update(dist.get_process_group_ranks(group))
    return sorted(ranks)


@torch.no_grad()
@collective_call("tpx.checkpoint.full_state_dict", lambda model, *a, **k: model_ranks(model))
def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Dict[str, Tensor]:
    """The unsharded state dict of a model sharded by tpx, with the original model's keys and
    shapes (on every rank, or only on the group's rank 0 with ``rank0_only=True``: the
    others return ``{}`` but must still call). The parameters of the multi-dimensional
    layers are all-gathered over the mesh dimensions that split them (``nn.Linear`` weight
    ``[out, in]``, bias ``[out]``, norm weight ``[H]``, embedding ``[V, D]``). A model that
    FSDP2 shards too gets torch's full state dict (``rank0_only``: on global rank 0, on the
    CPU). Collective: every rank the model is split over calls it (one that does not come
    within ``TPX_ENTRY_GRACE`` seconds is an error on the others)."""
    if fsdp_managed(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        # a layout no DTensor states is gathered by every rank below: torch's full state dict
        # stays on every rank until then
        gather_here = any(next(unstated_layouts(m), None) for m in model.modules())
        with collect_unstated() as unstated:
            state = dict(get_model_state_dict(model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=rank0_only and not gather_here)))
        # FSDP2 gathered its own split of a parameter tpx split in a layout no DTensor states
        # (fused segments): this rank's TP part, gathered here over the TP group
        for key, lay in unstated:
            state[key] = lay.gather(state[key])
        if unstated and rank0_only:
            if dist.get_rank() != 0:
                return {}
            state = {k: v.cpu() for k, v in state.items()}
        return state
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
