"""Sharded checkpoints through ``torch.distributed.checkpoint``, resharded on load (any TP
size, 1-D or multi-dimensional); models that FSDP2 shards too go through torch's own state-dict
functions, in the same checkpoint format."""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .full import (
    OPTIM_KEY, chunked_dtensor, fsdp_managed, gather_full, mesh_dtensor, mesh_params,
    sharded_params)
from .optim import get_optimizer_state_dict, load_optimizer_part
from ..comm.entry import collective_call, every_rank
from ..layout.dtensor_io import DTensor
from ..layout.sharding import GroupSharding, collect_unstated, raw_state_dict
from ..comm.groups import shard_bounds
from ..layout.dtensor_io import Shard
from ..layout.param_dtensors import block_ranges, local_of, strided


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints through torch.distributed.checkpoint, resharded on load.

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
    if fsdp_managed(model):
        return _torch_model_state(model)
    with raw_state_dict():
        state = {k: v.detach() for k, v in model.state_dict().items()}
    for key, value in state.items():
        if isinstance(value, DTensor) and all(p.is_replicate() for p in value.placements):
            state[key] = value._local_tensor  # a replicated parameter: saved as before
    for sh in sharded_params(model):
        if sh.key not in state:
            continue
        if sh.layout.chunked:
            state[sh.key] = chunked_dtensor(sh, sh.local())
        else:
            state[sh.key] = gather_full(sh)
    for ms in mesh_params(model):
        if ms.key in state:
            state[ms.key] = mesh_dtensor(ms)
    return state


@collective_call("tpx.checkpoint.save", lambda *a, **k: None,
                 lambda model, checkpoint_id, **k: os.fspath(checkpoint_id))
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
    original model; scalar state (``step``) once. Collective over the default group: every rank
    calls it, and a rank that does not come within ``TPX_ENTRY_GRACE`` seconds is an error on
    the others before anything is written.

    The directory appears whole or not at all: the ranks write into ``<checkpoint_id>.partial``
    and rank 0 renames it to ``checkpoint_id`` once every rank's blocks and the metadata are on
    disk (a checkpoint saved over an existing one replaces it at that moment). A run killed
    while saving leaves at most the ``.partial`` directory, which :func:`load` refuses and the
    next save replaces; :func:`is_complete` tells the two apart. The directory must be on a
    file system every rank sees (as ``torch.distributed.checkpoint``'s file writer assumes)."""
    import torch.distributed.checkpoint as dcp

    fsdp = fsdp_managed(model)
    if fsdp:
        _, state, _, _ = _fsdp_state(model, optimizer, "save")
    else:
        state = sharded_state_dict(model)
        if optimizer is not None:
            _no_optim_key("save", state)
            state[OPTIM_KEY] = get_optimizer_state_dict(model, optimizer)
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
    anything is modified. Collective over the default group (every rank calls it, as
    :func:`save`)."""
    metadata = _read_metadata("load", checkpoint_id)  # not a checkpoint: raised on entry
    with every_rank("tpx.checkpoint.load", detail=os.fspath(checkpoint_id)):
        _load(model, checkpoint_id, metadata, optimizer)


def _load(model: nn.Module, checkpoint_id, metadata, optimizer) -> None:
    """:func:`load` once the checkpoint is found and every rank has entered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    if fsdp_managed(model):
        _load_fsdp(model, checkpoint_id, metadata, optimizer)
        return
    state = sharded_state_dict(model)
    _check_model_keys(checkpoint_id, metadata, state)
    optim_state = None
    if optimizer is not None:
        optim_state = load_optimizer_part("load", model, optimizer, checkpoint_id, metadata)
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

def _torch_model_state(model: nn.Module) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return dict(get_model_state_dict(model))


def _no_optim_key(where: str, state: Dict[str, Any]) -> None:
    if any(k == OPTIM_KEY or k.startswith(OPTIM_KEY + ".") for k in state):
        raise ValueError(f"tpx.checkpoint.{where}: the model has state under {OPTIM_KEY!r}, the "
                         "key the optimizer state is saved under; rename that submodule or save "
                         "the optimizer separately with get_optimizer_state_dict")


def _fsdp_state(model: nn.Module, optimizer, where: str):
    """torch's state dicts of a model FSDP2 shards too (the optimizer's under ``"optim"``):
    ``(state, savable, blocks, unstated)``. In ``savable`` each ``DTensor`` that
    ``torch.distributed.checkpoint`` cannot place is a ``ShardedTensor`` of this rank's blocks
    of the full tensor (copies): a strided layout (fused segments split separately), and a
    parameter tpx splits in a layout no ``DTensor`` states, whose FSDP2 ``DTensor`` states
    only the data-parallel split of this rank's TP part (and its optimizer state alike).
    ``blocks``: ``(path, views)`` to read a load back into ``state``'s tensors; ``unstated``:
    the model keys of the latter. Collective."""
    with collect_unstated() as found:
        state = _torch_model_state(model)
    lays = dict(found)
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import \
            get_optimizer_state_dict as torch_optimizer_state

        _no_optim_key(where, state)
        state[OPTIM_KEY] = torch_optimizer_state(model, optimizer)
    blocks: List[Tuple[tuple, list]] = []
    return state, _savable(state, lays, (), blocks, where == "load"), blocks, set(lays)


def _savable(state: Any, lays: Dict[str, GroupSharding], path: tuple, blocks: list,
             loading: bool) -> Any:
    """``state`` with each ``DTensor`` torch's checkpoint cannot place made a ``ShardedTensor``
    (see :func:`_fsdp_state`). To save, a row held by several ranks is written once (by the
    lowest of them); to load, every rank reads every row it holds."""
    if isinstance(state, dict):
        # the same order on every rank: a ShardedTensor is made collectively
        return {key: _savable(state[key], lays, path + (key,), blocks, loading)
                for key in sorted(state, key=str)}
    if not isinstance(state, DTensor):
        return state
    key = path[0] if len(path) == 1 else (
        path[2] if len(path) == 4 and path[:2] == (OPTIM_KEY, "state") else None)
    if key in lays and state.dim() > 0:
        lay = lays[key]
        shape = list(lay.full_shape)
        shape = shape[::-1] if lay.transposed else shape
        if loading and lay.owned() is not None:
            # rows held by several ranks were written once, and each holder reads them: the
            # whole tensor is read (a ShardedTensor's blocks cannot overlap across ranks)
            blocks.append((path, ("whole", _unstated_blocks(state, lay, every_held=True))))
            return state._local_tensor.new_empty(shape)
        views = _unstated_blocks(state, lay)
        blocks.append((path, views))
        return sharded_blocks(views, shape)
    if strided(state):
        blocks.append((path, None))
        return savable(state)
    return state


def _unstated_blocks(dt: DTensor, lay: GroupSharding, every_held: bool = False) -> list:
    """``(view, global offsets, sizes)`` of the rows this rank counts (a row held by several
    ranks on the lowest of them; with ``every_held``, every row it holds) of the full tensor,
    in the original orientation, for FSDP2's ``DTensor`` ``dt`` (``Shard(0)`` of this rank's
    TP part over the data-parallel mesh) of a parameter split as ``lay`` over the TP group."""
    if tuple(dt.placements) != (Shard(0),) or dt.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"tpx.checkpoint: a parameter split over the TP group as {lay.rows[lay.rank]} "
            f"whose FSDP2 DTensor has placements {dt.placements}; only fully_shard's default "
            "Shard(0) over a 1-D data-parallel mesh is supported")
    local, tp_rows = dt._local_tensor, lay.local_shape[0]
    world, k = dt.device_mesh.size(), dt.device_mesh.get_local_rank()
    a0, a1 = shard_bounds(tp_rows, k, world)  # FSDP2's rows of dim 0 of this rank's TP part
    owned = None if every_held else lay.owned()  # ([] where another rank holds every row)
    counted = [(0, lay.local_shape[lay.dim])] if owned is None else owned
    out, offset = [], 0
    for s, e in lay.rows[lay.rank]:  # the TP part along lay.dim: these global rows in order
        for w0, w1 in counted:
            lo, hi = max(offset, w0), min(offset + e - s, w1)
            if lay.dim == 0:
                lo, hi = max(lo, a0), min(hi, a1)
            if hi <= lo:
                continue
            start = [0] * local.dim()
            if lay.dim == 0:
                view = local.narrow(0, lo - a0, hi - lo)
            else:
                view = local.narrow(lay.dim, lo, hi - lo)
                start[0] = a0
            start[lay.dim] = s + lo - offset
            out.append((view, start, list(view.shape)))
        offset += e - s
    if lay.transposed:
        out = [(v.t(), st[::-1], sz[::-1]) for v, st, sz in out]
    return out


def _read_back(loaded: Dict[str, Any], state: Dict[str, Any], blocks: list) -> None:
    """Copies what a load read into each ``ShardedTensor`` of ``loaded`` (made by
    :func:`_fsdp_state`) into the tensor of ``state`` it stands for."""
    for path, views in blocks:
        got, own = loaded, state
        for key in path:
            got, own = got[key], own[key]
        if views is None:
            read_back(got, own)
        elif isinstance(views, tuple):  # ("whole", views): the whole tensor was read
            for view, start, size in views[1]:
                view.copy_(got[tuple(slice(a, a + n) for a, n in zip(start, size))])
        else:
            read_back_blocks(got, views)


def _load_fsdp(model: nn.Module, checkpoint_id, metadata, optimizer) -> None:
    """:func:`load` into a model FSDP2 shards too: the checkpoint is read into torch's state
    dicts of this run's layout (any layout the checkpoint was saved from), then set with
    torch's ``set_state_dict``. Shapes and the optimizer part are checked first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if optimizer is not None:
        held = metadata.planner_data or {}
        if not any(isinstance(p, tuple) and len(p) > 1 and p[0] == OPTIM_KEY
                   for p in held.values()):
            raise ValueError(f"tpx.checkpoint.load: {os.fspath(checkpoint_id)!r} holds no "
                             "optimizer state (it was saved without `optimizer`); call load "
                             "without optimizer=, or save with tpx.checkpoint.save(model, "
                             "checkpoint_id, optimizer=optimizer)")
    state, loading, blocks, unstated = _fsdp_state(model, optimizer, "load")
    _check_model_keys(checkpoint_id, metadata,
                      {k: v for k, v in loading.items() if k != OPTIM_KEY})
    dcp.load(loading, checkpoint_id=os.fspath(checkpoint_id))
    _read_back(loading, state, blocks)
    optim = state.pop(OPTIM_KEY, None)
    # the parameters in layouts no DTensor states were read into their storage in place
    set_model_state_dict(model, {k: v for k, v in state.items() if k not in unstated},
                         options=StateDictOptions(strict=not unstated))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim)


# ---------------------------------------------------------------------------------------------
# Strided DTensors (fused segments split separately) saved as the blocks they hold.


def _blocks(dt: "DTensor"):
    """``(view, global offsets, sizes)`` of each contiguous block of the full tensor that the
    local tensor of the strided ``DTensor`` ``dt`` holds, in one fixed order."""
    import itertools

    local = dt._local_tensor
    ranges = block_ranges(dt.placements, dt.device_mesh, dt.device_mesh.get_coordinate(),
                           tuple(dt.shape))
    offsets = [[0] + list(itertools.accumulate(e - s for s, e in rs))[:-1] for rs in ranges]
    out = []
    for combo in itertools.product(*[range(len(rs)) for rs in ranges]):
        view, start, size = local, [], []
        for d, i in enumerate(combo):
            s, e = ranges[d][i]
            view = view.narrow(d, offsets[d][i], e - s)
            start.append(s)
            size.append(e - s)
        if all(size):
            out.append((view, start, size))
    return out


def savable(dt: "DTensor"):
    """A strided ``DTensor`` as a ``ShardedTensor`` of its blocks (copies, contiguous), the form
    ``torch.distributed.checkpoint`` saves as the blocks they are and loads resharded to any
    layout; :func:`read_back` puts what a load wrote into it back into ``dt``. Collective over
    the default group."""
    return sharded_blocks(_blocks(dt), dt.shape)


def read_back(st, dt: "DTensor") -> None:
    """Copies the blocks of ``st`` (made by :func:`savable` from ``dt``) into ``dt``'s local
    tensor."""
    read_back_blocks(st, _blocks(dt))


def sharded_blocks(blocks, shape):
    """A ``ShardedTensor`` of global ``shape`` whose local shards are copies of ``blocks``
    (``(view, global offsets, sizes)``, the views in their own order). Collective over the
    default group."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import Shard as Block, ShardedTensor
    from torch.distributed._shard.sharding_spec import ShardMetadata

    out = []
    for view, start, size in blocks:
        placement = f"rank:{dist.get_rank()}/{view.device}"
        out.append(Block(view.contiguous(), ShardMetadata(list(start), list(size), placement)))
    return ShardedTensor._init_from_local_shards(out, list(shape))


def read_back_blocks(st, blocks) -> None:
    """Copies the local shards of ``st`` (made by :func:`sharded_blocks` from ``blocks``) into
    the views of ``blocks``."""
    for (view, _, _), block in zip(blocks, st.local_shards()):
        view.copy_(block.tensor)
