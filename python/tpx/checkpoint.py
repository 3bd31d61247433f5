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
from typing import Dict, Iterator, List, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .autograd import gather_dim
from .nn.multidim import BlockSpec, _block_specs

__all__ = ["full_state_dict", "load_full_state_dict", "load_hf_checkpoint", "save", "load",
           "sharded_state_dict"]


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

    def local(self) -> Tensor:
        return getattr(self.module, self.name)

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


def _sharded_params(model: nn.Module) -> Iterator[_Sharded]:
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
        return getattr(self.module, self.spec.name)

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


def _mesh_params(model: nn.Module) -> Iterator[_MeshSharded]:
    """Every parameter of the multi-dimensional layers in ``model``, in module order."""
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "_param_splits") or not hasattr(mod, "mesh_info"):
            continue
        pre = f"{prefix}." if prefix else ""
        for spec in _block_specs(mod):
            yield _MeshSharded(pre + spec.name, mod, spec)


_DCP_MESHES: Dict[tuple, tuple] = {}


def _mesh_dtensor(sh: _MeshSharded) -> Tensor:
    """The block as a ``DTensor`` of the full shape over the layer's mesh: mesh dimension ``m``
    is ``Shard(d)`` when it splits dim ``d``, else ``Replicate()``. A dim split by several
    mesh dimensions needs them in its order, outermost first (DTensor shards left to right):
    when the mesh's own order differs (3-D weight rows, split by the output dimension then
    "input"), the DTensor lives on the same ranks and process groups with its dimensions
    permuted."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    info, spec = sh.info, sh.spec
    names = list(info.names)
    order = names
    for dims in spec.splits:
        if [names.index(d) for d in dims] != sorted(names.index(d) for d in dims):
            lead = [d for dims_ in spec.splits for d in dims_]
            order = lead + [n for n in names if n not in lead]
            break
    local = sh.local().detach()
    key = (info.ranks, tuple(order), local.device.type)
    world = dist.group.WORLD
    cached = _DCP_MESHES.get(key)
    if cached is not None and cached[0] is world:
        mesh = cached[1]
    else:
        perm = [names.index(n) for n in order]
        ranks = torch.tensor(info.ranks, dtype=torch.int).view(info.shape).permute(perm)
        mesh = DeviceMesh.from_group([info.groups[n] for n in order], local.device.type,
                                     mesh=ranks.contiguous(), mesh_dim_names=tuple(order))
        _DCP_MESHES[key] = (world, mesh)
    placements = []
    for n in order:
        dims = [d for d, split in enumerate(spec.splits) if n in split]
        placements.append(Shard(dims[0]) if dims else Replicate())
    shape = torch.Size(spec.full_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False,
                              shape=shape, stride=stride)


def _gather_full(sh: _Sharded) -> Tensor:
    """The full tensor (original orientation) assembled from every rank's pieces."""
    local = sh.local().detach()
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
    ``[out, in]``, bias ``[out]``, norm weight ``[H]``, embedding ``[V, D]``). Collective."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for sh in _sharded_params(model):
        state[sh.key] = _gather_full(sh)
    for ms in _mesh_params(model):
        state[ms.key] = ms.gather()
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
    for sh in _sharded_params(model):
        if sh.key not in local:
            continue
        _check_full_shape("load_full_state_dict", sh, local[sh.key])
        local[sh.key] = sh.slice_of(local[sh.key])
    for ms in _mesh_params(model):
        if ms.key not in local:
            continue
        ms.check_full_shape("load_full_state_dict", local[ms.key].shape)
        local[ms.key] = ms.slice_of(local[ms.key])
    model.load_state_dict(local, strict=strict)


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


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                       strict: bool = True) -> List[str]:
    """Loads a Hugging Face checkpoint (a ``.safetensors`` file, or a directory of them with or
    without ``model.safetensors.index.json``, as ``save_pretrained`` writes it) into a model
    sharded by tpx. The files are memory-mapped and each rank reads only its own slices of
    the sharded tensors (``safe_open(...).get_slice``): no rank ever holds a full copy of a
    sharded weight (a multi-dimensional layer reads its block). Keys are the model's
    ``state_dict()`` keys. Tied parameters absent from
    the files (GPT-2's ``lm_head.weight``) are filled through their tie.

    With ``strict=True`` a parameter or buffer of the model that the files do not hold (and
    that is not tied to one they hold) raises ``KeyError``; returns the keys of the files that
    the model has no use for. No communication: each rank reads on its own.
    """
    from safetensors import safe_open

    sharded = {sh.key: sh for sh in _sharded_params(model)}
    blocks = {ms.key: ms for ms in _mesh_params(model)}
    targets = dict(model.state_dict(keep_vars=True))
    loaded, unused = set(), []
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in targets:
                    unused.append(key)
                    continue
                dst = targets[key]
                if key in sharded:
                    sh = sharded[key]
                    sl, d = f.get_slice(key), sh.orig_dim()
                    full_shape = sl.get_shape()
                    if len(full_shape) <= d or full_shape[d] != sh.full_size():
                        raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {key} in {file} "
                                         f"has shape {tuple(full_shape)}; the model expects "
                                         f"{sh.full_size()} entries along dim {d}")
                    pieces = [sl[s:e] if d == 0 else sl[:, s:e]
                              for s, e in sh.rows[sh.rank]]
                    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
                    if sh.transposed:
                        value = value.t()
                elif key in blocks:
                    ms = blocks[key]
                    sl = f.get_slice(key)
                    ms.check_full_shape(f"load_hf_checkpoint ({file})", sl.get_shape())
                    value = sl[ms.index()]
                else:
                    value = f.get_tensor(key)
                if tuple(value.shape) != tuple(dst.shape):
                    raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {key} has shape "
                                     f"{tuple(value.shape)} in {file}; the model expects "
                                     f"{tuple(dst.shape)} on this rank")
                dst.copy_(value)
                loaded.add(id(dst))
    missing = [k for k, t in targets.items() if id(t) not in loaded]
    if strict and missing:
        raise KeyError(f"tpx.checkpoint.load_hf_checkpoint: {path!r} does not hold {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''}; pass strict=False to keep their "
                       "current values")
    return unused


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


@torch.no_grad()
def sharded_state_dict(model: nn.Module) -> Dict[str, Tensor]:
    """The model's state as ``torch.distributed.checkpoint`` saves it, in the ORIGINAL model's
    keys and global shapes: a tensor sharded with ``shard_range`` becomes a ``DTensor`` with
    placement ``Shard(dim)`` over its layer's group (each rank writes only its block); a
    tensor with another layout (per-part fused projections, replicated KV heads) is gathered
    to its full value; a parameter of a multi-dimensional layer becomes a ``DTensor`` over its
    mesh, ``Shard(d)`` on each mesh dimension that splits dim ``d`` of the original tensor and
    ``Replicate()`` on the others (one copy of each block is written); everything else is the
    replicated tensor itself. Collective."""
    from torch.distributed.tensor import DTensor, Shard

    state = {k: v.detach() for k, v in model.state_dict().items()}
    for sh in _sharded_params(model):
        if sh.key not in state:
            continue
        if _is_chunked(sh):
            local = sh.local().detach()
            if sh.transposed:
                local = local.t()
            shape = list(local.shape)
            d = sh.orig_dim()
            shape[d] = sh.full_size()
            stride = torch.empty(shape, device="meta").stride()
            state[sh.key] = DTensor.from_local(local.contiguous(),
                                               _mesh(sh.module.group, local.device), [Shard(d)],
                                               run_check=False, shape=torch.Size(shape),
                                               stride=stride)
        else:
            state[sh.key] = _gather_full(sh)
    for ms in _mesh_params(model):
        if ms.key in state:
            state[ms.key] = _mesh_dtensor(ms)
    return state


def save(model: nn.Module, checkpoint_id: Union[str, os.PathLike]) -> None:
    """Saves ``model`` (sharded by tpx) with ``torch.distributed.checkpoint``: every rank writes
    its own blocks into the directory ``checkpoint_id``. The checkpoint holds the original
    model's keys and global shapes, so :func:`load` reads it back at ANY TP degree or layout
    (TP 2 -> TP 4, TP 2 -> TP 1, 2-D -> 1-D, 3-D -> one device, ...), and
    ``torch.distributed.checkpoint.load`` into the unsharded model reads it too. Collective
    over the default group."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state_dict(model), checkpoint_id=os.fspath(checkpoint_id))


@torch.no_grad()
def load(model: nn.Module, checkpoint_id: Union[str, os.PathLike]) -> None:
    """Loads a checkpoint written by :func:`save` (at any TP degree, or from an unsharded model
    saved with ``torch.distributed.checkpoint``) into ``model``, sharded by tpx at this run's
    TP degree, or over a 2-D / 2.5-D / 3-D mesh: each rank reads only the blocks it holds
    where the layout is ``shard_range`` or a multi-dimensional layer's. Collective over the
    default group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    state = sharded_state_dict(model)
    dcp.load(state, checkpoint_id=os.fspath(checkpoint_id))
    sharded = {sh.key: sh for sh in _sharded_params(model)}
    blocks = {ms.key: ms for ms in _mesh_params(model)}
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
            own[key].copy_(value)
