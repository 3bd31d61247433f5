"""A sharded model written as a Hugging Face checkpoint directory, every rank writing its own
part into the same safetensors files: no rank gathers the model, each element is written once.

Every rank plans the same files from shared facts (the model's keys, full shapes and dtypes,
transformers' reverse layout conversions): the order of the tensors, the files they go to and
their byte offsets, hence the safetensors headers. Rank 0 creates the files (the header, then
the full length); each rank then writes, with ``pwrite`` at those offsets, the parts of each
tensor it owns: its shard's rows, the rows it holds that no lower rank holds (KV heads
replicated over ranks), a block of a multi-dimensional layer if its coordinates along the mesh
dimensions that replicate it are 0, a tensor kept whole on one rank chosen in turn. The
layouts transformers saves in (a fused experts tensor written as one tensor per expert) come
from its own reverse conversions run on placeholders of the model's tensors: each file tensor
is then a box of one model tensor, and a rank writes the part of the box it owns."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .full import fsdp_managed, mesh_params, sharded_params
from .hf import local_reads
from .lazy import SAFETENSORS_DTYPES, Cast, Cat, Lazy, Narrow, NotSliceable, Stack, Transpose, Unit
from ..comm.collectives import all_reduce
from ..comm.entry import collective_call
from ..comm.groups import resolve_group
from ..layout.dtensor_io import DTensor
from ..layout.sharding import raw_state_dict, unstated_layouts

_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items() if v is not None}
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


class Placeholder(Lazy):
    """A model tensor (its full shape) as the input of transformers' reverse conversions."""

    def __init__(self, key: str, shape: torch.Size, dtype: torch.dtype) -> None:
        self.key, self.shape, self.dtype = key, torch.Size(shape), dtype

    def read_into(self, region, out) -> None:  # pragma: no cover - never read
        raise NotImplementedError

    def sources(self):
        return [self]


Piece = Tuple[List[int], Placeholder, List[Optional[int]], List[int], List[int]]


def pieces_of(t: Lazy) -> List[Piece]:
    """The file tensor ``t`` as boxes of model tensors: ``(offset, model tensor, dims, start,
    size)`` each, the box ``start`` .. ``start + size`` of the model tensor placed at
    ``offset`` of ``t``, dim ``i`` of ``t`` being the model tensor's dim ``dims[i]`` (``None``:
    a dim of size 1 the model tensor does not have). Concatenated and stacked tensors are
    several pieces; anything else raises :class:`NotSliceable`."""
    if isinstance(t, Placeholder):
        return [([0] * t.ndim, t, list(range(t.ndim)), [0] * t.ndim, list(t.shape))]
    if isinstance(t, Cast):
        return pieces_of(t.x)
    if isinstance(t, (Cat, Stack)):
        out, at = [], 0
        for part in t.parts:
            for off, leaf, dims, start, size in pieces_of(part):
                if isinstance(t, Stack):
                    off, dims = off[:t.d] + [at] + off[t.d:], dims[:t.d] + [None] + dims[t.d:]
                else:
                    off = list(off)
                    off[t.d] += at
                out.append((off, leaf, dims, start, size))
            at += 1 if isinstance(t, Stack) else part.shape[t.d]
        return out
    inner = pieces_of(t.x) if isinstance(t, (Narrow, Transpose, Unit)) else None
    if inner is None or len(inner) != 1:
        raise NotSliceable(f"tpx: a file tensor made by {type(t).__name__} of model tensors")
    off, leaf, dims, start, size = inner[0]
    if isinstance(t, Narrow):
        d = dims[t.d]
        if d is None:
            raise NotSliceable("tpx: a narrow of a dim of size 1")
        start, size = list(start), list(size)
        start[d] += t.start
        size[d] = t.shape[t.d]
    elif isinstance(t, Transpose):
        dims = list(dims)
        dims[t.d0], dims[t.d1] = dims[t.d1], dims[t.d0]
    else:
        dims = [None if k is None else dims[k] for k in t.keep]
    return [([0] * t.ndim, leaf, dims, start, size)]


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"tpx.checkpoint.save_pretrained: max_shard_size={size!r}: give bytes "
                         "or a size such as '5GB'")
    unit = m.group(2)
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(unit[0] if unit != "B" else " "))


# ---------------------------------------------------------------------------------------------
# What this rank owns of each model tensor.

def _segments(ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
    """``(global start, global end, local start)`` of each range held, in local order."""
    out, o = [], 0
    for s, e in ranges:
        out.append((s, e, o))
        o += e - s
    return out


def _clip(segs, local_keep: Optional[List[Tuple[int, int]]]):
    """The parts of ``segs`` whose local positions fall in ``local_keep`` (all: ``None``)."""
    if local_keep is None:
        return segs
    out = []
    for s, e, o in segs:
        for a, b in local_keep:
            lo, hi = max(a, o), min(b, o + e - s)
            if lo < hi:
                out.append((s + lo - o, s + hi - o, lo))
    return out


def owned_blocks(model: nn.Module, targets: Dict[str, torch.Tensor], keys: List[str],
                 pg: dist.ProcessGroup, layouts: bool = True):
    """For each model key this rank writes: ``(per-dim segments (global start, end, local
    start) it owns, the local tensor in the original orientation)``. Every element of every
    tensor is owned by exactly one rank of ``pg``. ``layouts``: as :func:`local_reads`."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    reads = local_reads(model, targets, layouts)
    tpx_1d = {sh.key: sh for sh in sharded_params(model)} if layouts else {}
    tpx_md = {ms.key: ms for ms in mesh_params(model)} if layouts else {}
    first = dist.get_global_rank(pg, 0)
    out = {}
    for i, key in enumerate(keys):
        _, ranges, view = reads[key]
        segs = [_segments(r) for r in ranges]
        t = targets[key]
        if key in tpx_1d:
            sh = tpx_1d[key]
            if sh.layout.group.size() == 1 and i % world != rank:
                continue  # a one-rank "group": every rank holds it whole
            owned = sh.layout.owned()
            if owned is not None:
                d = sh.orig_dim()
                segs[d] = _clip(segs[d], owned)
        elif key in tpx_md:
            lay = tpx_md[key].layout
            if any(lay.info.coord[n] for n in lay.replicated_over):
                continue
        elif isinstance(t, DTensor) and any(not p.is_replicate() for p in t.placements):
            coord = t.device_mesh.get_coordinate()
            if any(p.is_replicate() and coord[m] for m, p in enumerate(t.placements)):
                continue
            if first not in t.device_mesh.mesh.flatten().tolist():
                continue  # a copy on a mesh of other ranks (FSDP2's over each TP coordinate)
        elif i % world != rank:  # whole on every rank: written by one, in turn
            continue
        out[key] = (segs, view)
    return out


# ---------------------------------------------------------------------------------------------
# The files.

def _file_names(n: int) -> List[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_files(entries: List[Tuple[str, torch.Size, torch.dtype]], max_shard_size: int):
    """``[(file name, header bytes, {key: data offset})]``: the tensors in order, a new file
    when the next tensor would take the current one past ``max_shard_size`` (as
    transformers splits)."""
    groups: List[List[Tuple[str, torch.Size, torch.dtype]]] = [[]]
    size = 0
    for e in entries:
        n = math.prod(e[1]) * e[2].itemsize
        if groups[-1] and size + n > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += n
    out = []
    for name, group in zip(_file_names(len(groups)), groups):
        header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
        offsets, o = {}, 0
        # wider elements first, as safetensors lays a file out: every tensor's data starts
        # at a multiple of its element size (the header ends 8-byte aligned)
        for key, shape, dtype in sorted(group, key=lambda e: -e[2].itemsize):
            n = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [o, o + n]}
            offsets[key] = o
            o += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
        head = len(text).to_bytes(8, "little") + text
        out.append((name, head, {k: len(head) + v for k, v in offsets.items()}, len(head) + o))
    return out


class _Mapped:
    """A file written through a shared memory mapping: each part is one copy into the
    mapped file tensor (twice as fast as ``pwrite`` s on one host, where several processes
    writing one file contend for it)."""

    def __init__(self, path: str) -> None:
        import mmap

        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), 0)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)

    def write(self, base: int, ftensor: Lazy, region, block: torch.Tensor) -> int:
        n = math.prod(ftensor.shape) * ftensor.dtype.itemsize
        view = self.buf[base:base + n].view(ftensor.dtype).view(list(ftensor.shape))
        target = view[tuple(slice(a, b) for a, b in region)]
        target.copy_(block)
        return target.numel() * target.element_size()

    def close(self) -> None:
        del self.buf
        self.mm.close()


class _Positioned:
    """A file written with ``pwrite`` at byte offsets: only the bytes of each part reach the
    file system (ranks on several hosts sharing a network file system: a memory mapping
    would write back whole pages, a peer's bytes in them included)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, base: int, ftensor: Lazy, region, block: torch.Tensor) -> int:
        data = block.to(ftensor.dtype).contiguous()
        return _write_box(self.fd, base, list(ftensor.shape), region, data)

    def close(self) -> None:
        os.close(self.fd)


def _one_host(pg: dist.ProcessGroup) -> bool:
    """Whether every rank of ``pg`` runs on this host."""
    import socket

    from ..comm.collectives import all_gather_object

    names: List[Optional[str]] = [None] * dist.get_world_size(pg)
    all_gather_object(names, socket.gethostname(), pg)
    return len(set(names)) == 1


class SavedFiles(list):
    """The names of the files :func:`save_pretrained` wrote, with ``bytes_written``: the bytes
    of tensor data this rank wrote (over the group they add up to the files' data: each
    element once)."""

    bytes_written = 0


def _write_box(fd: int, base: int, shape: Sequence[int], region, data: torch.Tensor) -> int:
    """Writes ``data`` (contiguous, the box ``region`` of a row-major tensor of ``shape``
    starting at byte ``base`` of the file) in as few ``pwrite`` s as the box allows."""
    es = data.element_size()
    raw = memoryview(data.reshape(-1).view(torch.uint8).numpy())
    if not shape:
        os.pwrite(fd, raw, base)
        return len(raw)
    strides = [math.prod(shape[j + 1:]) for j in range(len(shape))]
    k = len(shape) - 1
    while k > 0 and tuple(region[k]) == (0, shape[k]):
        k -= 1
    run = math.prod(b - a for a, b in region[k:])
    if run == 0:
        return 0
    outer = itertools.product(*[range(a, b) for a, b in region[:k]])
    for i, idx in enumerate(outer):
        start = sum(x * strides[j] for j, x in enumerate(idx)) + region[k][0] * strides[k]
        os.pwrite(fd, raw[i * run * es:(i + 1) * run * es], base + start * es)
    return len(raw)


def sync_errors(pg: dist.ProcessGroup, error: Optional[BaseException], what: str,
                who: str = "tpx.checkpoint.save_pretrained", count: int = 0) -> int:
    """A barrier that carries failure: every rank raises if one failed. Returns the sum of
    ``count`` over the ranks."""
    flag = torch.tensor([1 if error is not None else 0, count], dtype=torch.int64)
    if dist.get_backend(pg) == "nccl":
        flag = flag.cuda()
    all_reduce(flag, pg)
    if error is not None:
        raise error
    if int(flag[0]):
        raise RuntimeError(f"{who}: another rank failed while {what}; "
                           "the directory is incomplete")
    return int(flag[1])


# ---------------------------------------------------------------------------------------------
# The call.

def _file_tensors(model: nn.Module, targets: Dict[str, torch.Tensor], shapes):
    """The tensors of the files as boxes of model tensors: transformers' reverse conversions
    (the layout ``save_pretrained`` writes) on placeholders; the tied copies and
    ``_keys_to_ignore_on_save`` left out as transformers leaves them out."""
    keep = dict(targets)
    ignore = getattr(model, "_keys_to_ignore_on_save", None) or ()
    for k in ignore:
        keep.pop(k, None)
    by_object: Dict[int, List[str]] = {}
    for k, t in keep.items():
        by_object.setdefault(id(t), []).append(k)
    try:
        from transformers.modeling_utils import _get_tied_weight_keys
        tied = set(_get_tied_weight_keys(model))
    except ImportError:
        tied = set()
    for names in by_object.values():
        if len(names) < 2:
            continue
        drop = [n for n in sorted(names) if any(re.search(p, n) for p in tied)]
        drop = drop[:len(names) - 1]
        rest = [n for n in names if n not in drop]
        if len(rest) > 1:
            raise ValueError(f"tpx.checkpoint.save_pretrained: {rest} are one tensor and the "
                             "model does not declare them tied (_tied_weights_keys); nothing "
                             "was written")
        for n in drop:
            keep.pop(n)
    holders = {k: Placeholder(k, shapes[k], targets[k].dtype) for k in keep
               if isinstance(targets[k], torch.Tensor)}
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return dict(holders)
    if not isinstance(model, PreTrainedModel):
        return dict(holders)
    try:
        files = revert_weight_conversion(model, dict(holders))
    except NotSliceable as e:
        raise ValueError(f"tpx.checkpoint.save_pretrained: a layout conversion transformers "
                         f"applies on save is not written slice by slice ({e}); nothing was "
                         "written. Save the full model instead: full = "
                         "tpx.checkpoint.full_state_dict(model, rank0_only=True), then on rank "
                         "0 model.save_pretrained(path, state_dict=full)") from None
    return {k: (v[0] if isinstance(v, list) else v) for k, v in files.items()}


def model_tensors(model: nn.Module, what: str):
    """``(the model's tensors by key, whether tpx's layers state their layouts)``: tpx's raw
    state dict; for a model FSDP2 shards too, its state dict, every tensor a ``DTensor`` over
    the mesh FSDP2 and tpx share (a parameter tpx splits in a layout no ``DTensor`` states
    raises, naming it, before anything is written)."""
    if not fsdp_managed(model):
        with raw_state_dict():
            return dict(model.state_dict(keep_vars=True)), True
    unstated = [f"{name}.{p}" if name else p for name, m in model.named_modules()
                for p, _ in unstated_layouts(m)]
    if unstated:
        raise ValueError(
            f"{what}: FSDP2 shards a model whose parameters {unstated[:4]} tpx splits in a "
            "layout no DTensor states (fused segments, rows held by several ranks); write it "
            "with tpx.checkpoint.save (DCP) or from tpx.checkpoint.full_state_dict(model, "
            "rank0_only=True). Nothing was written")
    return dict(model.state_dict(keep_vars=True)), False


@torch.no_grad()
@collective_call("save_pretrained (tpx.checkpoint.save_pretrained)", lambda *a, group=None, **k: resolve_group(group),
                 lambda model, save_directory, *a, **k: os.fspath(save_directory))
def save_pretrained(model: nn.Module, save_directory: Union[str, os.PathLike], *,
                    group=None, max_shard_size: Union[int, str] = "50GB") -> List[str]:
    """Writes ``model`` (sharded by tpx, or any mix of tpx's layers, ``DTensor`` s and plain
    tensors) as a Hugging Face checkpoint directory that transformers' ``from_pretrained``
    reads on one device and :func:`tpx.from_pretrained` at any TP degree: safetensors files of
    at most ``max_shard_size`` (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json``), the config and the generation config, in the layout
    transformers' own ``save_pretrained`` writes (per-expert tensors of a mixture of experts,
    tied copies left out).

    Every rank of ``group`` (default: the whole world; the ranks that hold one copy of the
    model) calls it (a rank that does not come within ``TPX_ENTRY_GRACE`` seconds is an error
    on the ranks that did, before anything is written); each writes the parts of the tensors it
    owns straight into the files, so no rank gathers a tensor and each element is written once (a rank's extra memory is at
    most one of its local tensors, laid out for the file). The directory is complete when the
    call returns on every rank; a failure on any rank raises on all. Returns the names of the
    files written (:class:`SavedFiles`). ``model.save_pretrained(path)`` of a Hugging Face model sharded by tpx calls
    this."""
    pg = resolve_group(group)
    max_bytes = _parse_size(max_shard_size)
    path = os.fspath(save_directory)
    targets, layouts = model_tensors(model, "tpx.checkpoint.save_pretrained")
    shapes = {k: v[0] for k, v in local_reads(model, targets, layouts).items()}
    files = _file_tensors(model, targets, shapes)

    def stale(f: str) -> bool:  # files of an earlier save that this one does not rewrite
        return bool(_SHARD.fullmatch(f)) or f == "model.safetensors.index.json"

    plan, written = write_files(model, targets, files, path, max_bytes, pg, stale=stale,
                                what="tpx.checkpoint.save_pretrained", layouts=layouts)
    error = None
    if dist.get_rank(pg) == 0:
        try:
            _write_metadata(model, path, plan, files)
        except Exception as e:  # noqa: BLE001
            error = e
    sync_errors(pg, error, "writing the index and the config")
    out = SavedFiles(p[0] for p in plan)
    out.bytes_written = written
    return out


def write_files(model: nn.Module, targets: Dict[str, torch.Tensor], files: Dict[str, Lazy],
                path: str, max_bytes: int, pg: dist.ProcessGroup, *, stale=None,
                single: Optional[str] = None, what: str = "tpx", layouts: bool = True):
    """Writes the file tensors ``files`` (each made of blocks of the model's tensors
    ``targets``, its raw state dict) into safetensors files under ``path``, every rank of
    ``pg`` writing the blocks it owns: rank 0 creates the directory, removes the files
    ``stale(name)`` names and creates the new ones; then each rank writes. ``single``: one
    file of that name, whatever its size. ``layouts``: as :func:`model_tensors` says. Returns
    ``(plan, bytes this rank wrote)``; a failure on any rank raises on all, and parts owned
    by no rank or by two raise before anything is written."""
    rank = dist.get_rank(pg)
    pieces = {}
    for name, t in files.items():
        try:
            pieces[name] = pieces_of(t)
        except NotSliceable as e:
            raise ValueError(f"{what}: {name} of the files is not made of blocks of the "
                             f"model's tensors ({e}); nothing was written") from None
    try:
        from transformers.core_model_loading import dot_natural_key as order
    except ImportError:
        order = None
    names = sorted(files, key=order) if order else sorted(files)
    entries = [(n, files[n].shape, files[n].dtype) for n in names]
    plan = plan_files(entries, math.inf if single else max_bytes)
    if single:
        plan = [(single,) + tuple(plan[0][1:])]
    where = {k: (fname, offsets[k]) for fname, _, offsets, _ in plan for k in offsets}

    one_host = _one_host(pg)
    leaves = list(dict.fromkeys(p[1].key for ps in pieces.values() for p in ps))

    def each_part(opener):
        """Every part this rank owns, handed to ``opener(file path)``'s ``write``."""
        count = 0
        fds: Dict[str, object] = {}
        try:
            for name in names:
                fname, base = where[name]
                for off, leaf, dims, start, size in pieces[name]:
                    mine = blocks.get(leaf.key)
                    if mine is None:
                        continue
                    if fname not in fds:
                        fds[fname] = opener(os.path.join(path, fname))
                    count += _write_owned(fds[fname], base, files[name], off, dims, start,
                                          size, *mine)
        finally:
            for fd in fds.values():
                fd.close()
        return count

    # Who writes what, counted before anything is written: every element exactly once.
    error, owned = None, 0
    try:
        blocks = owned_blocks(model, targets, leaves, pg, layouts)
        owned = each_part(lambda _: _Counted())
    except Exception as e:  # noqa: BLE001 - raised on every rank by sync_errors
        error = e
    total = sync_errors(pg, error, "finding its part", what, count=owned)
    data = sum(p[3] - len(p[1]) for p in plan)
    if total != data:
        raise RuntimeError(f"{what}: the ranks own {total} bytes of tensor data where the "
                           f"files hold {data} (the layout of a tensor over the ranks is not "
                           "one tpx reads); nothing was written")

    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            new = {p[0] for p in plan}
            for f in os.listdir(path):
                if stale is not None and f not in new and stale(f):
                    os.remove(os.path.join(path, f))
            for fname, head, _, size in plan:
                with open(os.path.join(path, fname), "wb") as f:
                    f.write(head)
                    f.truncate(size)
        except Exception as e:  # noqa: BLE001
            error = e
    sync_errors(pg, error, "creating the files", what)

    written = 0
    try:
        written = each_part(_Mapped if one_host else _Positioned)
    except Exception as e:  # noqa: BLE001
        error = e
    sync_errors(pg, error, "writing its part", what)
    return plan, written


class _Counted:
    """A file nothing is written to: counts the bytes of the parts."""

    def write(self, base: int, ftensor: Lazy, region, block: torch.Tensor) -> int:
        return math.prod(b - a for a, b in region) * ftensor.dtype.itemsize

    def close(self) -> None:
        pass


def _write_owned(out, base, ftensor, off, dims, start, size, segs, view) -> int:
    """Writes the parts of one piece of a file tensor (the box ``start`` .. ``start + size``
    of a model tensor at ``off`` of the file tensor, dims mapped by ``dims``) that lie in this
    rank's owned segments of that model tensor."""
    written = 0
    nd = len(start)
    for combo in itertools.product(*segs):
        lo = [max(combo[d][0], start[d]) for d in range(nd)]
        hi = [min(combo[d][1], start[d] + size[d]) for d in range(nd)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        block = view
        for d in range(nd):
            s, _, o = combo[d]
            block = block.narrow(d, o + lo[d] - s, hi[d] - lo[d])
        # into the file tensor's dims: dropped dims (size 1) squeezed, the rest permuted,
        # new dims of size 1 added
        present = [d for d in dims if d is not None]
        for d in sorted(set(range(nd)) - set(present), reverse=True):
            block = block.squeeze(d)
        order = sorted(present)
        block = block.permute([order.index(d) for d in present]) if present else block
        for i, d in enumerate(dims):
            if d is None:
                block = block.unsqueeze(i)
        region = [(o, o + 1) if d is None else (o + lo[d] - start[d], o + hi[d] - start[d])
                  for o, d in zip(off, dims)]
        written += out.write(base, ftensor, region, block)
    return written


def _write_metadata(model: nn.Module, path: str, plan, files) -> None:
    if len(plan) > 1:
        index = {"metadata": {"total_size": sum(p[3] - len(p[1]) for p in plan)},
                 "weight_map": {k: p[0] for p in plan for k in p[2]}}
        params = sum(math.prod(t.shape) for t in files.values())
        index["metadata"]["total_parameters"] = params
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        dtypes = [t.dtype for t in files.values() if t.dtype.is_floating_point]
        if dtypes:
            config.dtype = str(dtypes[0]).split(".")[1]
        config.architectures = [type(model).__name__]
        config.save_pretrained(path)
    gen = getattr(model, "generation_config", None)
    can = getattr(model, "can_generate", None)
    if gen is not None and callable(can) and can():
        gen.save_pretrained(path)
