"""Full <-> sharded state dicts of models sharded by tpx, 1-D or multi-dimensional.

``full_state_dict`` gathers every tpx layer's shards back into the tensors of the ORIGINAL
model (same keys, same shapes: it loads straight into the unsharded model);
``load_full_state_dict`` slices a full state dict into a sharded model. Both are collective:
every rank of each layer's group (or mesh) must call them.

Every 1-D tpx layer describes its parameters with ``_shards()``: (name, sharded dim, for each
rank the ``(start, end)`` ranges of the full tensor along that dim it holds, concatenated). A
layer made from a Hugging Face ``Conv1D`` (weight stored as ``[in, out]``) carries
``_transposed_weight = True``: its full weight is the transpose of the gathered one.

Every multi-dimensional layer (2-D, 2.5-D, 3-D: :mod:`tpx.nn.multidim`) describes its
parameters with ``_param_splits()``: one :class:`tpx.nn.multidim.BlockSpec` per parameter,
giving for each of the parameter's dims the mesh dimensions that split it, outermost first
(the block index and count follow from the rank's mesh coordinates), and the full shape. A
rank's parameter is one rectangular block of the full tensor, replicated over the mesh
dimensions that split none of its dims; gathering is one mesh all-gather per splitting mesh
dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
import glob
import json
import os
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .mappings import gather_dim
from .nn.multidim import BlockSpec, block_specs
from .nn.dtensor_io import DTensor
from .sharding import MeshSharding, local_of, raw_state_dict

__all__ = ["full_state_dict", "load_full_state_dict", "load_hf_checkpoint", "save", "load",
           "is_complete",
           "sharded_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
           "full_optimizer_state_dict", "load_full_optimizer_state_dict", "HFLoadResult"]


@dataclass
class _Sharded:
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


def sharded_params(model: nn.Module) -> Iterator[_Sharded]:
    """Every sharded parameter of the tpx layers in ``model``, in module order (the same on
    every rank)."""
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "_shards") or not hasattr(mod, "group"):
            continue
        pre = f"{prefix}." if prefix else ""
        for name, dim, rows in mod._shards():
            transposed = name == "weight" and getattr(mod, "_transposed_weight", False)
            yield _Sharded(pre + name, mod, name, dim, rows, transposed)


@dataclass
class _MeshSharded:
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


def mesh_params(model: nn.Module) -> Iterator[_MeshSharded]:
    """Every parameter of the multi-dimensional layers in ``model``, in module order."""
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "_param_splits") or not hasattr(mod, "mesh_info"):
            continue
        pre = f"{prefix}." if prefix else ""
        for spec in block_specs(mod):
            yield _MeshSharded(pre + spec.name, mod, spec)


def _mesh_dtensor(sh: _MeshSharded, local: Optional[Tensor] = None) -> Tensor:
    """The block (``local``: a tensor of the block's shape in its place, by default the
    parameter itself) as a ``DTensor`` of the full shape over the layer's mesh
    (:meth:`tpx.sharding.MeshSharding.dtensor`)."""
    return MeshSharding(sh.spec, sh.info).dtensor(sh.local() if local is None else local)


def _gather_full(sh: _Sharded, local: Optional[Tensor] = None) -> Tensor:
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
    if _fsdp_managed(model):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        return dict(get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=rank0_only)))
    with raw_state_dict():
        state = {k: v.detach() for k, v in model.state_dict().items()}
    for sh in sharded_params(model):
        state[sh.key] = _gather_full(sh)
    for ms in mesh_params(model):
        state[ms.key] = ms.gather()
    for key, value in state.items():
        if isinstance(value, DTensor):  # a replicated parameter of a tpx layer, a PyTorch style's
            state[key] = value.full_tensor()
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


def _check_full_shape(where: str, sh: _Sharded, full: Tensor) -> None:
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
        _check_full_shape("load_full_state_dict", sh, local[sh.key])
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
                local[key] = _as_stored(own[key], value)
        model.load_state_dict(local, strict=strict)


def _as_stored(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (this rank's part, in the parameter's local orientation) in the parameter's
    form: a ``DTensor`` with its placements when it is one."""
    if isinstance(param, DTensor) and not isinstance(local, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors checkpoints, read slice by slice.

def _safetensors_files(path: Union[str, os.PathLike]) -> List[str]:
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"tpx.checkpoint.load_hf_checkpoint: no .safetensors file in "
                                f"{path!r}")
    return files


class HFLoadResult(list):
    """What :func:`load_hf_checkpoint` did not use: the list itself holds the keys of the files
    that the model has no use for (``unexpected_keys``); ``missing_keys`` are the model's
    parameters and buffers that the files did not hold, left at their current values."""

    def __init__(self, unexpected_keys: List[str], missing_keys: List[str]) -> None:
        super().__init__(unexpected_keys)
        self.missing_keys = list(missing_keys)

    @property
    def unexpected_keys(self) -> List[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"HFLoadResult(missing_keys={self.missing_keys}, unexpected_keys={list(self)})"


def _hf_key_mapping(model: nn.Module):
    """``rename(file_key, model_keys) -> (model_key, conversion)``: the name a checkpoint key has
    in ``model`` by transformers' own loading rules, the ones ``from_pretrained`` applies: the
    checkpoint conversion mapping of the model's classes (GPT-NeoX: ``embed_out.`` ->
    ``lm_head.``), the legacy renamings, the base-model prefix added or dropped.
    ``conversion`` names the transformers conversion when the tensor is transformed on load
    (merged, split, permuted), not only renamed. Identity for a model that is not a
    transformers ``PreTrainedModel``, or a transformers without these rules."""
    def same(key, targets):
        return key, None

    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:
        return same
    if not isinstance(model, PreTrainedModel):
        return same
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key, targets):
        if key in targets:
            return key, None
        return rename_source_key(key, renamings, converters, prefix, targets)

    return rename


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                       strict: bool = True) -> HFLoadResult:
    """Loads a Hugging Face checkpoint (a ``.safetensors`` file, or a directory of them with or
    without ``model.safetensors.index.json``, as ``save_pretrained`` writes it) into a model
    sharded by tpx. The files are memory-mapped and each rank reads only its own slices of
    the sharded tensors (``safe_open(...).get_slice``): no rank ever holds a full copy of a
    sharded weight (a multi-dimensional layer reads its block).

    The files' keys become the model's ``state_dict()`` keys by transformers' own loading
    rules (what ``from_pretrained`` applies): the checkpoint conversion mapping of the model's
    classes (GPT-NeoX's ``save_pretrained`` writes ``embed_out.weight`` for the model's
    ``lm_head.weight``), the legacy renamings, the base-model prefix added or dropped. A key
    that transformers transforms on load (tensors merged or split) raises ``ValueError``: load
    such a model with ``from_pretrained``, then shard it. Tied parameters absent from the
    files (GPT-2's ``lm_head.weight``) are filled through their tie.

    ``strict=True``: a parameter or buffer of the model that the files do not hold (nor one
    tied to it) raises ``ValueError`` before anything is loaded. ``strict=False``: those keep
    their current values and a warning names them. Returns an :class:`HFLoadResult`: the list
    of the files' keys the model has no use for, with ``.missing_keys`` (the model's keys left
    untouched). No communication: each rank reads on its own.
    """
    from safetensors import safe_open

    sharded = {sh.key: sh for sh in sharded_params(model)}
    blocks = {ms.key: ms for ms in mesh_params(model)}
    with raw_state_dict():
        targets = dict(model.state_dict(keep_vars=True))
    rename = _hf_key_mapping(model)
    # Every file key's name in the model first: nothing changes before the checks below.
    reads: Dict[str, List[Tuple[str, str]]] = {}
    unused: List[str] = []
    found = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for file_key in f.keys():
                key, conversion = rename(file_key, targets)
                if key not in targets:
                    unused.append(file_key)
                    continue
                if conversion is not None:
                    raise ValueError(
                        f"tpx.checkpoint.load_hf_checkpoint: {file_key} in {file} becomes "
                        f"{key} through a conversion that transformers applies on load "
                        f"({conversion!r}: the tensor is transformed, not only renamed), which "
                        "tpx does not read slice by slice; load the model with "
                        "from_pretrained, then shard it with tpx.parallelize_module")
                reads.setdefault(file, []).append((file_key, key))
                found.add(id(targets[key]))
    missing = [k for k, t in targets.items() if id(t) not in found]
    where = os.fspath(path)
    more = " ..." if len(missing) > 8 else ""
    if missing and strict:
        raise ValueError(
            f"tpx.checkpoint.load_hf_checkpoint: {where!r} does not hold {missing[:8]}{more} "
            f"(nor keys that transformers maps to them); nothing was loaded. Load a checkpoint "
            f"of this model, or pass strict=False to load the rest and leave these at their "
            f"current values")
    if missing:
        warnings.warn(
            f"tpx.checkpoint.load_hf_checkpoint(strict=False): {len(missing)} parameters or "
            f"buffers of the model are not in {where!r} and keep their current values: "
            f"{missing[:8]}{more}" + (f"; keys of the files not used: {unused[:8]}"
                                      f"{' ...' if len(unused) > 8 else ''}" if unused else ""),
            stacklevel=2)
    for file, keys in reads.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for file_key, key in keys:
                dst = targets[key]
                if key in sharded:
                    sh = sharded[key]
                    sl, d = f.get_slice(file_key), sh.orig_dim()
                    full_shape = sl.get_shape()
                    if len(full_shape) <= d or full_shape[d] != sh.full_size():
                        raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {file_key} in "
                                         f"{file} has shape {tuple(full_shape)}; the model "
                                         f"expects {sh.full_size()} entries along dim {d}")
                    pieces = [sl[s:e] if d == 0 else sl[:, s:e]
                              for s, e in sh.rows[sh.rank]]
                    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
                    if sh.transposed:
                        value = value.t()
                elif key in blocks:
                    ms = blocks[key]
                    sl = f.get_slice(file_key)
                    ms.check_full_shape(f"load_hf_checkpoint ({file})", sl.get_shape())
                    value = sl[ms.index()]
                else:
                    value = f.get_tensor(file_key)
                dst = local_of(dst)
                if tuple(value.shape) != tuple(dst.shape):
                    raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {file_key} has shape "
                                     f"{tuple(value.shape)} in {file}; the model expects "
                                     f"{tuple(dst.shape)} for {key} on this rank")
                dst.copy_(value)
    return HFLoadResult(unused, missing)


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints through torch.distributed.checkpoint, resharded on load.

def _is_chunked(sh: _Sharded) -> bool:
    """Whether each rank holds ``shard_range`` of the full tensor: a DTensor ``Shard`` layout."""
    world, full = len(sh.rows), sh.full_size()
    per = -(-full // world)
    for r, ranges in enumerate(sh.rows):
        start = min(r * per, full)
        if ranges != [(start, min(start + per, full))]:
            return False
    return True


def _mesh(pg: dist.ProcessGroup, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(pg, device.type)


def _chunked_dtensor(sh: _Sharded, local: Tensor) -> Tensor:
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
    return DTensor.from_local(local.contiguous(), _mesh(sh.module.group, local.device),
                              [Shard(d)], run_check=False, shape=torch.Size(shape),
                              stride=stride)


@torch.no_grad()
def sharded_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The model's state as ``torch.distributed.checkpoint`` saves it, in the ORIGINAL model's
    keys and global shapes: a tensor sharded with ``shard_range`` becomes a ``DTensor`` with
    placement ``Shard(dim)`` over its layer's group (each rank writes only its block); a
    tensor with another layout (per-part fused projections, replicated KV heads) is gathered
    to its full value; a parameter of a multi-dimensional layer becomes a ``DTensor`` over its
    mesh, ``Shard(d)`` on each mesh dimension that splits dim ``d`` of the original tensor and
    ``Replicate()`` on the others (one copy of each block is written); everything else is the
    replicated tensor itself. A model that FSDP2 shards too: torch's
    ``get_model_state_dict`` (every parameter a ``DTensor`` over the 2-D mesh). Collective."""
    if _fsdp_managed(model):
        return _torch_model_state(model)
    with raw_state_dict():
        state = {k: v.detach() for k, v in model.state_dict().items()}
    for key, value in state.items():
        if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
            state[key] = value._local_tensor  # a replicated parameter: saved as before
    for sh in sharded_params(model):
        if sh.key not in state:
            continue
        if _is_chunked(sh):
            state[sh.key] = _chunked_dtensor(sh, sh.local())
        else:
            state[sh.key] = _gather_full(sh)
    for ms in mesh_params(model):
        if ms.key in state:
            state[ms.key] = _mesh_dtensor(ms)
    return state


_OPTIM = "optim"  # the key of the optimizer state in a checkpoint written by :func:`save`


def save(model: nn.Module, checkpoint_id: Union[str, os.PathLike], *,
         optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Saves ``model`` (sharded by tpx) with ``torch.distributed.checkpoint``: every rank writes
    its own blocks into the directory ``checkpoint_id``. The checkpoint holds the original
    model's keys and global shapes, so :func:`load` reads it back at ANY TP degree or layout
    (TP 2 -> TP 4, TP 2 -> TP 1, 2-D -> 1-D, 3-D -> one device, ...), and
    ``torch.distributed.checkpoint.load`` into the unsharded model reads it too.

    With ``optimizer``, its state is saved too, under the key ``"optim"`` in the layout of
    :func:`get_optimizer_state_dict` (the one of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``): each state tensor
    of a parameter's shape (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's ``momentum_buffer``)
    with the parameter's global shape and placement, keyed by the parameter's name in the
    original model; scalar state (``step``) once. Collective over the default group.

    The directory appears whole or not at all: the ranks write into ``<checkpoint_id>.partial``
    and rank 0 renames it to ``checkpoint_id`` once every rank's blocks and the metadata are on
    disk (a checkpoint saved over an existing one replaces it at that moment). A run killed
    while saving leaves at most the ``.partial`` directory, which :func:`load` refuses and the
    next save replaces; :func:`is_complete` tells the two apart. The directory must be on a
    file system every rank sees (as ``torch.distributed.checkpoint``'s file writer assumes)."""
    import torch.distributed.checkpoint as dcp

    fsdp = _fsdp_managed(model)
    state = _torch_model_state(model) if fsdp else sharded_state_dict(model)
    if optimizer is not None:
        if any(k == _OPTIM or k.startswith(_OPTIM + ".") for k in state):
            raise ValueError(f"tpx.checkpoint.save: the model has state under {_OPTIM!r}, the key "
                             "the optimizer state is saved under; rename that submodule or "
                             "save the optimizer separately with get_optimizer_state_dict")
        state[_OPTIM] = get_optimizer_state_dict(model, optimizer)
    final = os.path.normpath(os.fspath(checkpoint_id))
    staging = final + _PARTIAL
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(staging):
        shutil.rmtree(staging)  # what a killed save left
    dist.barrier()
    dcp.save(state, checkpoint_id=staging)
    dist.barrier()  # every rank's files and the metadata are written
    if rank == 0:
        replaced = final + ".replaced"
        if os.path.exists(final):
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
    dist.barrier()


_PARTIAL = ".partial"


def is_complete(checkpoint_id: Union[str, os.PathLike]) -> bool:
    """Whether ``checkpoint_id`` is a checkpoint :func:`save` finished (a directory with its
    metadata, not the ``.partial`` directory of a save that was interrupted). No
    communication."""
    path = os.path.normpath(os.fspath(checkpoint_id))
    return (not path.endswith(_PARTIAL) and os.path.isdir(path)
            and os.path.isfile(os.path.join(path, ".metadata")))


def _read_metadata(where: str, checkpoint_id: Union[str, os.PathLike]):
    import torch.distributed.checkpoint as dcp

    path = os.fspath(checkpoint_id)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tpx.checkpoint.{where}: no checkpoint directory at {path!r}")
    if not is_complete(path):
        raise FileNotFoundError(f"tpx.checkpoint.{where}: {path!r} is not a complete checkpoint "
                                "(the save that wrote it was interrupted, or it is not a "
                                "checkpoint directory); load an earlier one")
    return dcp.FileSystemReader(path).read_metadata()


def _check_model_keys(checkpoint_id, metadata, state: Dict[str, Any]) -> None:
    """Every tensor of ``state`` is in the checkpoint, with its global shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held = metadata.state_dict_metadata
    for key, value in state.items():
        if not isinstance(value, Tensor):
            continue
        md = held.get(key)
        if md is None:
            raise ValueError(f"tpx.checkpoint.load: {os.fspath(checkpoint_id)!r} does not hold "
                             f"{key!r} (a parameter or buffer of the model); load into the model "
                             "the checkpoint was saved from")
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(value.shape):
            shape = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "a non-tensor"
            raise ValueError(f"tpx.checkpoint.load: {key} has shape {shape} in "
                             f"{os.fspath(checkpoint_id)!r}; the model expects "
                             f"{tuple(value.shape)} (global shape)")


@torch.no_grad()
def load(model: nn.Module, checkpoint_id: Union[str, os.PathLike], *,
         optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a checkpoint written by :func:`save` (at any TP degree, or from an unsharded model
    saved with ``torch.distributed.checkpoint``) into ``model``, sharded by tpx at this run's
    TP degree, or over a 2-D / 2.5-D / 3-D mesh: each rank reads only the blocks it holds
    where the layout is ``shard_range`` or a multi-dimensional layer's.

    With ``optimizer`` (built over ``model``'s parameters, before or after
    ``parallelize_module``), the optimizer state saved by ``save(..., optimizer=...)`` is
    loaded too, each state tensor resharded to this run's layout, and the param groups'
    hyper-parameters restored: the next ``optimizer.step()`` is the one the saved run would
    have taken. Shapes are checked against the checkpoint (``ValueError`` naming the
    parameter) and a checkpoint without optimizer state raises ``ValueError``, before
    anything is modified. Collective over the default group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    metadata = _read_metadata("load", checkpoint_id)
    if _fsdp_managed(model):
        _load_fsdp(model, checkpoint_id, metadata, optimizer)
        return
    state = sharded_state_dict(model)
    _check_model_keys(checkpoint_id, metadata, state)
    optim_state = None
    if optimizer is not None:
        optim_state = _load_optimizer_part("load", model, optimizer, checkpoint_id, metadata)
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_id))
    sharded = {sh.key: sh for sh in sharded_params(model)}
    blocks = {ms.key: ms for ms in mesh_params(model)}
    with raw_state_dict():
        own = model.state_dict(keep_vars=True)
    for key, value in state.items():
        if key in blocks:
            blocks[key].local().copy_(value.to_local())
        elif key in sharded:
            sh = sharded[key]
            if isinstance(value, DTensor):
                local = value.to_local()
                sh.local().copy_(local.t() if sh.transposed else local)
            else:
                sh.local().copy_(sh.slice_of(value))
        elif key in own:
            if isinstance(own[key], DTensor) and not isinstance(value, DTensor):
                local_of(own[key]).copy_(value)
            else:
                own[key].copy_(value)
    if optim_state is not None:
        optimizer.load_state_dict(optim_state)


# ---------------------------------------------------------------------------------------------
# Models whose parameters FSDP2 shards too (tpx's TP on one mesh dimension, fully_shard on
# another): every parameter is a DTensor over the 2-D mesh, which torch's own state-dict
# functions state in the original names and global shapes; save and load go through them, in
# the same checkpoint format (model keys at the top, the optimizer under "optim").

def _fsdp_managed(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _torch_model_state(model: nn.Module) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))


def _load_fsdp(model: nn.Module, checkpoint_id, metadata, optimizer) -> None:
    """:func:`load` into a model FSDP2 shards too: the checkpoint is read into torch's state
    dicts of this run's layout (any layout the checkpoint was saved from), then set with
    torch's ``set_state_dict``. Shapes and the optimizer part are checked first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    state = _torch_model_state(model)
    _check_model_keys(checkpoint_id, metadata, state)
    if optimizer is not None:
        held = metadata.planner_data or {}
        if not any(isinstance(p, tuple) and len(p) > 1 and p[0] == _OPTIM
                   for p in held.values()):
            raise ValueError(f"tpx.checkpoint.load: {os.fspath(checkpoint_id)!r} holds no "
                             "optimizer state (it was saved without `optimizer`); call load "
                             "without optimizer=, or save with tpx.checkpoint.save(model, "
                             "checkpoint_id, optimizer=optimizer)")
        state[_OPTIM] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_id))
    optim = state.pop(_OPTIM, None)
    set_model_state_dict(model, state)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim)


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

    def __init__(self, fqn: str, param: Tensor, sh: Optional[_Sharded] = None,
                 ms: Optional[_MeshSharded] = None) -> None:
        self.fqn, self.param, self.sh, self.ms = fqn, param, sh, ms
        self.local = local_of(param)  # what this rank stores
        if ms is not None:
            self.kind, self.full_shape = "mesh", tuple(ms.spec.full_shape)
        elif sh is not None:
            self.kind = "shard" if _is_chunked(sh) else "gather"
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
            return _chunked_dtensor(self.sh, local)
        if self.kind == "mesh":
            return _mesh_dtensor(self.ms, local)
        if self.kind == "gather":
            return _gather_full(self.sh, local)
        return local.detach()

    def full(self, local: Tensor) -> Tensor:
        """The full tensor (original orientation). Collective over the layer's group or mesh
        unless replicated."""
        if self.kind == "mesh":
            return self.ms.spec.gather(local.detach(), self.ms.info)
        if self.sh is not None:
            return _gather_full(self.sh, local)
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


class _Params:
    """The parameters of ``model`` with their names and layouts: ``fqn`` is the first name
    ``model.named_parameters()`` gives (the name PyTorch's distributed state dicts use);
    every other name of a tied parameter resolves to it too."""

    def __init__(self, model: nn.Module) -> None:
        sharded: Dict[int, _Sharded] = {}
        for sh in sharded_params(model):
            if sh.param() is not None:
                sharded.setdefault(id(sh.param()), sh)
        meshed: Dict[int, _MeshSharded] = {}
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


def _positions(where: str, params: _Params, optimizer) -> List[Tuple[int, Tensor]]:
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
    if _fsdp_managed(model):  # FSDP2 shards the parameters too: torch's own function
        from torch.distributed.checkpoint.state_dict import \
            get_optimizer_state_dict as torch_get

        return torch_get(model, optimizer, options=options)
    full, cpu_offload, _ = _options("get_optimizer_state_dict", options)
    params = _Params(model)
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


def _to_optimizer_format(where: str, params: _Params, optimizer, optim_state_dict,
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
                    value = _as_stored(lay.param, value)
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
    params = _Params(model)
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
    params = _Params(model)
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
    params = _Params(model)
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
            k: (v if not isinstance(v, Tensor) else _as_stored(lay.param, lay.local_of(v))
                if v.dim() > 0 else v.detach().clone()) for k, v in entry.items()}
    optimizer.load_state_dict({"state": local_state, "param_groups": saved_groups})


def _load_optimizer_part(where: str, model: nn.Module, optimizer, checkpoint_id, metadata):
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
            if isinstance(p, tuple) and len(p) > 1 and p[0] == _OPTIM}
    if not keys:
        raise ValueError(f"tpx.checkpoint.{where}: {path!r} holds no optimizer state (it was "
                         "saved without `optimizer`); call load without optimizer=, or save with "
                         "tpx.checkpoint.save(model, checkpoint_id, optimizer=optimizer)")
    params = _Params(model)
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
    saved = nested[_OPTIM]
    saved.setdefault("state", {})
    saved.setdefault("param_groups", [])
    return _to_optimizer_format(where, params, optimizer, saved, True)
