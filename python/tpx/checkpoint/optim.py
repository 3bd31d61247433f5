"""Optimizer state of sharded models: every state tensor of a parameter's local shape takes
the parameter's layout, exported full or sharded and loaded back resharded."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .full import (
    OPTIM_KEY, MeshSharded, Sharded, as_stored, chunked_dtensor, fsdp_managed, gather_full,
    mesh_dtensor, mesh_params, sharded_params)
from ..layout.dtensor_io import DTensor
from ..layout.param_dtensors import local_of
from ..layout.sharding import unstated_layouts


# ---------------------------------------------------------------------------------------------
# Optimizer state: every state tensor of a parameter's local shape takes the parameter's layout.

class _ParamLayout:
    """How one parameter of a model sharded by tpx, and every optimizer state tensor of the
    parameter's local shape, lies over the ranks. ``kind``: ``"shard"`` (1-D layer,
    ``shard_range`` rows: a ``DTensor`` ``Shard(d)`` over the layer's group), ``"mesh"`` (a
    block of a multi-dimensional layer: a ``DTensor`` over its mesh), ``"gather"`` (another
    1-D layout: fused per-part projections, replicated KV heads; exchanged as the full
    tensor) or ``"replicate"`` (every rank holds all of it). ``full_shape`` is the global
    shape in the original model's orientation."""

    def __init__(self, fqn: str, param: Tensor, sh: Optional[Sharded] = None,
                 ms: Optional[MeshSharded] = None) -> None:
        self.fqn, self.param, self.sh, self.ms = fqn, param, sh, ms
        self.local = local_of(param)  # what this rank stores
        if ms is not None:
            self.kind, self.full_shape = "mesh", tuple(ms.spec.full_shape)
        elif sh is not None:
            self.kind = "shard" if sh.layout.chunked else "gather"
            shape = list(self.local.shape)
            shape[sh.dim] = sh.full_size()
            self.full_shape = tuple(shape[::-1] if sh.transposed else shape)
        else:
            self.kind, self.full_shape = "replicate", tuple(param.shape)

    def saved(self, local: Tensor) -> Tensor:
        """``local`` (a tensor of the parameter's local shape) as
        ``torch.distributed.checkpoint`` saves it: a ``DTensor`` of the global shape
        (``"shard"``, ``"mesh"``: no communication), else the full tensor (``"gather"``
        all-gathers over the layer's group)."""
        if self.kind == "shard":
            return chunked_dtensor(self.sh, local)
        if self.kind == "mesh":
            return mesh_dtensor(self.ms, local)
        if self.kind == "gather":
            return gather_full(self.sh, local)
        return local.detach()

    def full(self, local: Tensor) -> Tensor:
        """The full tensor (original orientation). Collective over the layer's group or mesh
        unless replicated."""
        if self.kind == "mesh":
            return self.ms.spec.gather(local.detach(), self.ms.info)
        if self.sh is not None:
            return gather_full(self.sh, local)
        return local.detach()

    def slice(self, full: Tensor) -> Tensor:
        """This rank's part of the full tensor, in the parameter's local orientation."""
        if self.kind == "mesh":
            return self.ms.slice_of(full)
        if self.sh is not None:
            return self.sh.slice_of(full)
        return full

    def dest(self, dtype: torch.dtype) -> Tensor:
        """An empty tensor of :meth:`saved`'s form for ``torch.distributed.checkpoint.load``."""
        if self.kind in ("shard", "mesh"):
            return self.saved(torch.empty(self.local.shape, dtype=dtype,
                                          device=self.param.device))
        return torch.empty(self.full_shape, dtype=dtype, device=self.param.device)

    def local_of(self, value: Tensor) -> Tensor:
        """``value`` (full tensor, or ``DTensor`` of the global shape) cut to this rank's part,
        in the local orientation, in fresh memory. A ``DTensor`` in another layout than this
        parameter's is gathered first (collective over its mesh)."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            if self.kind in ("shard", "mesh"):
                ref = self.saved(self.local)
                if (tuple(value.placements) == tuple(ref.placements)
                        and value.device_mesh.mesh.tolist() == ref.device_mesh.mesh.tolist()):
                    local = value.to_local()
                    if self.kind == "shard" and self.sh.transposed:
                        local = local.t()
                    return local.clone(memory_format=torch.contiguous_format)
            value = value.full_tensor()
        return self.slice(value).clone(memory_format=torch.contiguous_format)


class ParamSet:
    """The parameters of ``model`` with their names and layouts: ``fqn`` is the first name
    ``model.named_parameters()`` gives (the name PyTorch's distributed state dicts use);
    every other name of a tied parameter resolves to it too."""

    def __init__(self, model: nn.Module) -> None:
        sharded: Dict[int, Sharded] = {}
        for sh in sharded_params(model):
            if sh.param() is not None:
                sharded.setdefault(id(sh.param()), sh)
        meshed: Dict[int, MeshSharded] = {}
        for ms in mesh_params(model):
            if ms.local() is not None:
                meshed.setdefault(id(getattr(ms.module, ms.name)), ms)
        self.by_id: Dict[int, _ParamLayout] = {}
        for fqn, p in model.named_parameters():
            self.by_id[id(p)] = _ParamLayout(fqn, p, sharded.get(id(p)), meshed.get(id(p)))
        self.by_name: Dict[str, _ParamLayout] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.by_name[name] = self.by_id[id(p)]

    def of(self, where: str, p: Tensor) -> _ParamLayout:
        lay = self.by_id.get(id(p))
        if lay is None:
            raise ValueError(f"tpx.checkpoint.{where}: the optimizer holds a parameter of shape "
                             f"{tuple(p.shape)} that is not a parameter of the model; build the "
                             "optimizer from model.parameters() as they are after "
                             "parallelize_module (a 1-D parallelize_module keeps the parameter "
                             "objects, so an optimizer built before it works too)")
        return lay


def _options(where: str, options) -> Tuple[bool, bool, bool]:
    """(full_state_dict, cpu_offload, strict) of a ``StateDictOptions``."""
    if options is None:
        return False, False, True
    for name in ("broadcast_from_rank0", "flatten_optimizer_state_dict"):
        if getattr(options, name, False):
            raise ValueError(f"tpx.checkpoint.{where}: StateDictOptions({name}=True) is not "
                             "supported for models sharded by tpx; leave it False")
    return (bool(getattr(options, "full_state_dict", False)),
            bool(getattr(options, "cpu_offload", False)), bool(getattr(options, "strict", True)))


def _export(where: str, lay: _ParamLayout, name: str, value: Any, full: bool) -> Any:
    """One optimizer state entry of ``lay``'s parameter as a state dict holds it."""
    if isinstance(value, DTensor) and isinstance(lay.param, DTensor):
        value = local_of(value)  # the state of a DTensor parameter: its local part
    if not isinstance(value, Tensor) or value.dim() == 0 or lay.kind == "replicate":
        return value
    if tuple(value.shape) != tuple(lay.local.shape):
        raise ValueError(f"tpx.checkpoint.{where}: optimizer state {name!r} of parameter "
                         f"{lay.fqn!r} has shape {tuple(value.shape)}, neither a scalar nor the "
                         f"parameter's local shape {tuple(lay.local.shape)}; tpx cannot tell how "
                         "it is sharded (use an optimizer whose state is per element, such as "
                         "Adam, AdamW or SGD)")
    return lay.full(value) if full else lay.saved(value)


def _positions(where: str, params: ParamSet, optimizer) -> List[Tuple[int, Tensor]]:
    """(id in ``optimizer.state_dict()``, parameter) in the optimizer's order: a parameter's
    id is its first position over the param groups, as ``torch.optim.Optimizer`` numbers
    them."""
    out, seen, pos = [], {}, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            params.of(where, p)
            seen.setdefault(id(p), pos)
            out.append((seen[id(p)], p))
            pos += 1
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


@torch.no_grad()
def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                             options=None) -> Dict[str, Any]:
    """The state of ``optimizer`` (over ``model``, sharded by tpx) keyed by the ORIGINAL
    model's parameter names, as ``torch.distributed.checkpoint.state_dict.
    get_optimizer_state_dict`` gives it for an unsharded model:
    ``{"state": {fqn: {"step": ..., "exp_avg": ..., ...}}, "param_groups": [{"lr": ...,
    "params": [fqn, ...]}, ...]}``. A tied parameter appears once, under its first name;
    a parameter without state (frozen, or before the first step) has no entry in ``state``.

    Each state tensor of the parameter's local shape takes the parameter's placement: by
    default a ``DTensor`` of the global shape (S(d) over the layer's group for a 1-D layer;
    S(d) / R over the mesh dimensions of a multi-dimensional layer) or, for 1-D layouts
    other than ``shard_range``, the full tensor (R); scalar state (``step``) and the state
    of replicated parameters stay as they are (R). ``options``
    (``torch.distributed.checkpoint.state_dict.StateDictOptions``): ``full_state_dict=True``
    gives every tensor in full (R, on every rank: the state dict of the unsharded model's
    optimizer), ``cpu_offload=True`` moves tensors to the CPU (with ``full_state_dict``, only
    global rank 0 gets the state dict, the others ``{}``). Collective over every group the
    model's parameters are sharded over: every rank calls it."""
    if fsdp_managed(model):  # FSDP2 shards the parameters too: torch's own function
        from torch.distributed.checkpoint.state_dict import \
            get_optimizer_state_dict as torch_get

        for prefix, m in model.named_modules():
            for name, lay in unstated_layouts(m):
                # FSDP2's DTensor of its state states the data-parallel split of this rank's
                # TP part only: under the full name it would be one TP rank's part
                raise ValueError(
                    f"tpx.checkpoint.get_optimizer_state_dict: {prefix}.{name} is "
                    "split over the TP group in a layout no DTensor states and FSDP2 shards it "
                    "too, so its optimizer state cannot be given under its full name; save the "
                    "optimizer with tpx.checkpoint.save(model, path, optimizer=optimizer) "
                    "(sharded, loaded by tpx.checkpoint.load at any layout)")
        return torch_get(model, optimizer, options=options)
    full, cpu_offload, _ = _options("get_optimizer_state_dict", options)
    params = ParamSet(model)
    _positions("get_optimizer_state_dict", params, optimizer)
    state: Dict[str, Dict[str, Any]] = {}
    groups: List[Dict[str, Any]] = []
    for group in optimizer.param_groups:
        fqns = []
        for p in group["params"]:
            lay = params.of("get_optimizer_state_dict", p)
            fqns.append(lay.fqn)
            entry = optimizer.state.get(p)
            if lay.fqn in state or not entry:
                continue
            state[lay.fqn] = {k: _export("get_optimizer_state_dict", lay, k, v, full)
                              for k, v in entry.items()}
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = fqns
        groups.append(packed)
    out = {"state": state, "param_groups": groups}
    if cpu_offload:
        if full and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        out = _to_cpu(out)
    return out


def _to_optimizer_format(where: str, params: ParamSet, optimizer, optim_state_dict,
                         strict: bool) -> Dict[str, Any]:
    """An FQN-keyed optimizer state dict (full tensors or ``DTensor``s of the global shape)
    as ``optimizer.load_state_dict`` takes it: integer ids, this rank's parts. Every check
    runs before any tensor is converted."""
    state_in = optim_state_dict.get("state") if isinstance(optim_state_dict, dict) else None
    groups_in = (optim_state_dict.get("param_groups") if isinstance(optim_state_dict, dict)
                 else None)
    if not isinstance(state_in, dict) or not isinstance(groups_in, list):
        raise ValueError(f"tpx.checkpoint.{where}: `optim_state_dict` must be "
                         "{'state': {name: {...}}, 'param_groups': [...]} keyed by parameter "
                         "names, as get_optimizer_state_dict returns it; for a state dict of "
                         "torch.optim.Optimizer.state_dict() (integer ids) use "
                         "load_full_optimizer_state_dict")
    order = _positions(where, params, optimizer)
    ids = {id(p): i for i, p in reversed(order)}
    entries = []
    for fqn, entry in state_in.items():
        lay = params.by_name.get(fqn)
        if lay is None:
            if strict:
                raise ValueError(f"tpx.checkpoint.{where}: the optimizer state holds "
                                 f"{fqn!r}, which is not a parameter of the model; load into "
                                 "the model it was saved from, or pass "
                                 "StateDictOptions(strict=False) to skip it")
            continue
        for name, value in entry.items():
            if (isinstance(value, Tensor) and value.dim() > 0
                    and tuple(value.shape) != lay.full_shape):
                raise ValueError(f"tpx.checkpoint.{where}: optimizer state {name!r} of "
                                 f"parameter {fqn!r} has shape {tuple(value.shape)}; the "
                                 f"model's parameter has global shape {lay.full_shape}")
        if id(lay.param) in ids:
            entries.append((lay, entry))
    saved_group: Dict[int, int] = {}
    for i, g in enumerate(groups_in):
        for fqn in g.get("params", []):
            lay = params.by_name.get(fqn)
            if lay is not None:
                saved_group[id(lay.param)] = i
            elif strict:
                raise ValueError(f"tpx.checkpoint.{where}: param_groups[{i}] names {fqn!r}, "
                                 "which is not a parameter of the model; load into the model it "
                                 "was saved from, or pass StateDictOptions(strict=False)")
    groups, pos = [], 0
    for n, group in enumerate(optimizer.param_groups):
        src = set()
        for p in group["params"]:
            if id(p) in saved_group:
                src.add(saved_group[id(p)])
        if len(src) > 1:
            raise ValueError(f"tpx.checkpoint.{where}: param group {n} of the optimizer holds "
                             f"parameters of the saved param groups {sorted(src)}; build the "
                             "optimizer with the param groups it was saved with")
        base = groups_in[src.pop()] if src else group
        new = {k: v for k, v in base.items() if k not in ("params", "param_names")}
        new["params"] = [i for i, _ in order[pos:pos + len(group["params"])]]
        pos += len(group["params"])
        groups.append(new)
    state: Dict[int, Dict[str, Any]] = {}
    for lay, entry in entries:
        local = {}
        for name, value in entry.items():
            if isinstance(value, Tensor):
                if lay.kind == "replicate" or value.dim() == 0:
                    from torch.distributed.tensor import DTensor

                    if isinstance(value, DTensor):
                        value = value.full_tensor()
                    value = value.detach().clone()
                else:
                    value = lay.local_of(value)
                if value.dim() > 0:
                    value = as_stored(lay.param, value)
            local[name] = value
        state[ids[id(lay.param)]] = local
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                             optim_state_dict: Dict[str, Any], *, options=None) -> None:
    """Loads an optimizer state dict keyed by parameter names into ``optimizer`` (over
    ``model``, sharded by tpx at any TP degree or layout): the one
    :func:`get_optimizer_state_dict` gives at any TP degree (``DTensor``s, or full tensors
    with ``full_state_dict=True``), or the one PyTorch's ``get_optimizer_state_dict`` gives
    for the unsharded model. Each state tensor of the parameter's global shape is cut to this
    rank's part (a ``DTensor`` in another layout is gathered first); param groups are matched
    by the names of their parameters and their hyper-parameters restored. ``options``:
    ``StateDictOptions(strict=False)`` skips names the model does not have. Shapes that
    disagree raise ``ValueError`` naming the parameter, before anything is modified.
    Collective where a ``DTensor`` is resharded."""
    _, _, strict = _options("set_optimizer_state_dict", options)
    params = ParamSet(model)
    optimizer.load_state_dict(_to_optimizer_format("set_optimizer_state_dict", params, optimizer,
                                                   optim_state_dict, strict))


@torch.no_grad()
def full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                              rank0_only: bool = False) -> Dict[str, Any]:
    """``optimizer.state_dict()`` with every state tensor in full (R): the state dict of the
    same optimizer over the UNSHARDED model, which
    ``torch.optim.Adam(unsharded.parameters()).load_state_dict(...)`` accepts (integer ids
    follow the optimizer's parameter order, the order of the unsharded model's
    ``parameters()`` when the optimizer was built from ``model.parameters()``, before or
    after ``parallelize_module``). On every rank, or only on global rank 0 with
    ``rank0_only=True`` (the others return ``{}`` but must still call). Collective."""
    params = ParamSet(model)
    order = _positions("full_optimizer_state_dict", params, optimizer)
    groups, pos = [], 0
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [i for i, _ in order[pos:pos + len(group["params"])]]
        pos += len(group["params"])
        groups.append(packed)
    state: Dict[int, Dict[str, Any]] = {}
    for i, p in order:
        entry = optimizer.state.get(p)
        if i in state or not entry:
            continue
        lay = params.of("full_optimizer_state_dict", p)
        state[i] = {k: _export("full_optimizer_state_dict", lay, k, v, True)
                    for k, v in entry.items()}
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_full_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: Dict[str, Any]) -> None:
    """Loads the state dict of an optimizer over the UNSHARDED model
    (``torch.optim.Optimizer.state_dict()``: integer ids, full tensors, R) into ``optimizer``
    over ``model`` sharded by tpx: each state tensor of a parameter's full shape is cut to
    this rank's part; ids map to parameters by position, as
    ``torch.optim.Optimizer.load_state_dict`` maps them. Group sizes or shapes that
    disagree raise ``ValueError`` (naming the parameter) before anything is modified. No
    communication."""
    where = "load_full_optimizer_state_dict"
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)):
        raise ValueError(f"tpx.checkpoint.{where}: `state_dict` must be "
                         "torch.optim.Optimizer.state_dict()'s {'state': {id: {...}}, "
                         "'param_groups': [...]}; for one keyed by parameter names use "
                         "set_optimizer_state_dict")
    params = ParamSet(model)
    order = _positions(where, params, optimizer)
    saved_groups = state_dict["param_groups"]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in saved_groups]
    if mine != theirs:
        raise ValueError(f"tpx.checkpoint.{where}: the state dict has param groups of "
                         f"{theirs} parameters, the optimizer {mine}; build the optimizer "
                         "with the same param groups, in the same order, as the one saved")
    id_map = {}
    flat_saved = [i for g in saved_groups for i in g["params"]]
    for saved_id, (_, p) in zip(flat_saved, order):
        id_map[saved_id] = p
    local_state: Dict[Any, Dict[str, Any]] = {}
    checked = []
    for saved_id, entry in state_dict["state"].items():
        p = id_map.get(saved_id)
        if p is None:
            raise ValueError(f"tpx.checkpoint.{where}: state id {saved_id!r} belongs to no "
                             "param group of the state dict")
        lay = params.of(where, p)
        for name, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and tuple(value.shape) != lay.full_shape:
                raise ValueError(f"tpx.checkpoint.{where}: optimizer state {name!r} of "
                                 f"parameter {lay.fqn!r} (id {saved_id}) has shape "
                                 f"{tuple(value.shape)}; the model's parameter has global shape "
                                 f"{lay.full_shape}")
        checked.append((saved_id, lay, entry))
    for saved_id, lay, entry in checked:
        local_state[saved_id] = {  # fresh memory: the optimizer steps it in place
            k: (v if not isinstance(v, Tensor) else as_stored(lay.param, lay.local_of(v))
                if v.dim() > 0 else v.detach().clone()) for k, v in entry.items()}
    optimizer.load_state_dict({"state": local_state, "param_groups": saved_groups})


def load_optimizer_part(where: str, model: nn.Module, optimizer, checkpoint_id, metadata):
    """Reads the optimizer state of a checkpoint written by ``save(..., optimizer=...)`` into
    buffers of this run's layout and returns it as ``optimizer.load_state_dict`` takes it.
    The optimizer and the model are not touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(checkpoint_id)
    mappings = metadata.planner_data or {}
    keys = {k: p for k, p in mappings.items()
            if isinstance(p, tuple) and len(p) > 1 and p[0] == OPTIM_KEY}
    if not keys:
        raise ValueError(f"tpx.checkpoint.{where}: {path!r} holds no optimizer state (it was "
                         "saved without `optimizer`); call load without optimizer=, or save with "
                         "tpx.checkpoint.save(model, checkpoint_id, optimizer=optimizer)")
    params = ParamSet(model)
    _positions(where, params, optimizer)
    dest: Dict[str, Any] = {}
    for key, p in keys.items():
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            dest[key] = None  # a pickled object (hyper-parameters, non-tensor state)
            continue
        size, dtype = tuple(md.size), md.properties.dtype
        if p[1] == "state" and len(p) == 4:
            lay = params.by_name.get(p[2])
            if lay is None:
                raise ValueError(f"tpx.checkpoint.{where}: {path!r} holds optimizer state for "
                                 f"{p[2]!r}, which is not a parameter of the model; load into "
                                 "the model the checkpoint was saved from")
            if len(size) > 0 and size != lay.full_shape:
                raise ValueError(f"tpx.checkpoint.{where}: optimizer state {p[3]!r} of "
                                 f"parameter {p[2]!r} has shape {size} in {path!r}; the "
                                 f"model's parameter has global shape {lay.full_shape}")
            if len(size) > 0 and lay.kind != "replicate":
                dest[key] = lay.dest(dtype)
                continue
        dest[key] = torch.empty(size, dtype=dtype)
    # Flat keys as stored; the pickled objects are put back into ``dest`` itself.
    dcp.load(dest, checkpoint_id=path,
             planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    nested: Dict[str, Any] = {}
    for key, p in keys.items():
        set_element(nested, p, dest[key])
    saved = nested[OPTIM_KEY]
    saved.setdefault("state", {})
    saved.setdefault("param_groups", [])
    return _to_optimizer_format(where, params, optimizer, saved, True)
