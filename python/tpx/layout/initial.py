"""Initial weights from one rank: every rank receives its shard (or block) of the source
rank's full tensors, in steps of bounded size, and the module's arguments are compared across
ranks on the way (:func:`load_initial`)."""

from __future__ import annotations

import warnings

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collectives
from ..config import init_chunk_bytes
from ..comm.agree import check_same_on_ranks, tensor_checksum

__all__ = ["ShardSpec", "broadcast_", "check_src_rank", "comm_device", "init_chunk_bytes",
           "load_initial", "scatter_blocks", "scatter_shard", "shard_in_place"]



def check_src_rank(what: str, src_rank: Any, world: int) -> None:
    """``src_rank`` is ``None`` or a rank of the group (``0 <= src_rank < world``)."""
    if src_rank is None:
        return
    if not isinstance(src_rank, int) or isinstance(src_rank, bool) or not 0 <= src_rank < world:
        raise ValueError(
            f"tpx.{what}: `src_rank` must be None or a rank of the group, an int in "
            f"[0, {world}); got {src_rank!r}. It names the rank (within the TP group) whose "
            "initial weights every rank takes.")


def comm_device(pg: dist.ProcessGroup, device: torch.device) -> torch.device:
    """The device of the buffers that carry ``device`` tensors over ``pg`` (a CUDA staging
    buffer for CPU tensors on an NCCL-only group)."""
    try:
        pg._get_backend(device)
        return device
    except RuntimeError:
        if device.type == "cpu" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        raise RuntimeError(
            f"tpx: the process group has no backend for {device.type} tensors; initialise it "
            "with a backend for them (e.g. backend='cpu:gloo,cuda:nccl') or build the module "
            "on the group's device") from None


def _shard_shape(shape: Sequence[int], ranges, dim: int) -> List[int]:
    out = list(shape)
    out[dim] = sum(e - s for s, e in ranges)
    return out


def _copy_rows(full: torch.Tensor, ranges, dim: int, a: int, b: int,
               dst: torch.Tensor) -> None:
    """``dst`` <- rows ``[a, b)`` of the shard that holds ``ranges`` of ``full`` along ``dim``
    (the shard is the ranges concatenated along ``dim``)."""
    if dim == 0:
        offset = 0
        for s, e in ranges:
            lo, hi = max(a, offset), min(b, offset + e - s)
            if lo < hi:
                dst[lo - a:hi - a].copy_(full[s + lo - offset:s + hi - offset])
            offset += e - s
    else:
        offset = 0
        for s, e in ranges:
            dst.narrow(dim, offset, e - s).copy_(full[a:b].narrow(dim, s, e - s))
            offset += e - s


def scatter_shard(pg: dist.ProcessGroup, src_rank: int, full: Optional[torch.Tensor],
                  out: torch.Tensor, ranges: Sequence[Sequence[Tuple[int, int]]], dim: int,
                  chunk_bytes: Optional[int] = None) -> None:
    """Fills ``out`` (this rank's shard) from ``full`` held by group rank ``src_rank``: rank
    ``r``'s shard is the ranges ``ranges[r]`` of ``full`` along ``dim``, concatenated.

    The shards travel in steps of whole rows of their dim 0, one ``scatter`` per step, each
    step carrying at most about ``chunk_bytes`` (``init_chunk_bytes()``) from the source. Every
    size is derived from ``ranges``, ``out``'s shape outside ``dim`` and the dtype, which all
    ranks share; ``full`` is read on the source rank only (``None`` elsewhere is fine)."""
    world = pg.size()
    shapes = [_shard_shape(out.shape, ranges[r], dim) for r in range(world)]

    def fill(r: int, a: int, b: int, dst: torch.Tensor) -> None:
        _copy_rows(full, ranges[r], dim, a, b, dst)

    _scatter_rows(pg, src_rank, out, shapes, fill, chunk_bytes)


def scatter_blocks(pg: dist.ProcessGroup, src_rank: int, full: Optional[torch.Tensor],
                   out: torch.Tensor, blocks: Sequence[Sequence[Tuple[int, int]]],
                   chunk_bytes: Optional[int] = None) -> None:
    """Fills ``out`` (this rank's block) from ``full`` held by group rank ``src_rank``: rank
    ``r``'s block is ``full[s0:e0, s1:e1, ...]`` with ``blocks[r] = ((s0, e0), (s1, e1), ...)``,
    one range per dim of ``full`` (a block of a weight split along several dims, as the
    multi-dimensional layers hold; several ranks may hold the same block). Sent in steps of
    whole rows of the blocks' dim 0 as :func:`scatter_shard`, at most about ``chunk_bytes``
    from the source per step; ``full`` is read on the source rank only."""
    shapes = [[e - s for s, e in blk] for blk in blocks]

    def fill(r: int, a: int, b: int, dst: torch.Tensor) -> None:
        (s0, _), rest = blocks[r][0], blocks[r][1:]
        index = (slice(s0 + a, s0 + b),) + tuple(slice(s, e) for s, e in rest)
        dst.copy_(full[index])

    _scatter_rows(pg, src_rank, out, shapes, fill, chunk_bytes)


def _scatter_rows(pg: dist.ProcessGroup, src_rank: int, out: torch.Tensor,
                  shapes: Sequence[Sequence[int]],
                  fill: Callable[[int, int, int, torch.Tensor], None],
                  chunk_bytes: Optional[int]) -> None:
    """The scatter of :func:`scatter_shard` / :func:`scatter_blocks`: rank ``r``'s tensor has
    shape ``shapes[r]``; on the source, ``fill(r, a, b, dst)`` writes rows ``[a, b)`` of rank
    ``r``'s tensor into ``dst``."""
    world, rank = pg.size(), dist.get_rank(pg)
    chunk_bytes = init_chunk_bytes() if chunk_bytes is None else chunk_bytes
    elem = out.element_size()
    shapes = [list(sh) for sh in shapes]
    if list(out.shape) != shapes[rank]:
        raise ValueError(f"tpx: the shard has shape {tuple(out.shape)} but its ranges give "
                         f"{tuple(shapes[rank])}")
    row_bytes = [max(1, math.prod(sh[1:]) * elem) for sh in shapes]
    piece = max(1, chunk_bytes // world)
    rows_per_step = [max(1, piece // rb) for rb in row_bytes]
    steps = max(-(-sh[0] // k) for sh, k in zip(shapes, rows_per_step))
    dev = comm_device(pg, out.device)
    spans = [[(min(i * k, sh[0]), min((i + 1) * k, sh[0])) for sh, k in zip(shapes, rows_per_step)]
             for i in range(steps)]
    sizes = [[(b - a) * rb for (a, b), rb in zip(step, row_bytes)] for step in spans]
    biggest = max((max(s) for s in sizes), default=0)
    if biggest == 0:
        return
    recv_all = torch.empty(biggest, dtype=torch.uint8, device=dev)
    send_all = ([torch.empty(biggest, dtype=torch.uint8, device=dev) for _ in range(world)]
                if rank == src_rank else None)
    for step, nbytes in zip(spans, sizes):
        n = max(nbytes)
        if n == 0:
            continue
        send = None
        if send_all is not None:
            send = [buf[:n] for buf in send_all]
            for r, ((a, b), m) in enumerate(zip(step, nbytes)):
                if m:
                    view = send[r][:m].view(out.dtype).view([b - a] + shapes[r][1:])
                    fill(r, a, b, view)
        recv = recv_all[:n]
        collectives.scatter(recv, send, src_rank, pg)
        (a, b), m = step[rank], nbytes[rank]
        if m:
            out[a:b].copy_(recv[:m].view(out.dtype).view([b - a] + shapes[rank][1:]))


def broadcast_(pg: dist.ProcessGroup, src_rank: int, tensors: Sequence[torch.Tensor],
               chunk_bytes: Optional[int] = None) -> None:
    """Overwrites every tensor of ``tensors`` in place with its value on group rank
    ``src_rank``. Small tensors travel together (one broadcast per bucket of up to
    ``chunk_bytes``), large ones in place or through staging pieces of that size. The
    tensors' shapes and dtypes, in order, must be the same on every rank; tensors on the meta
    device (on every rank alike) are skipped."""
    chunk_bytes = init_chunk_bytes() if chunk_bytes is None else chunk_bytes
    is_src = dist.get_rank(pg) == src_rank
    bucket: List[torch.Tensor] = []
    bucket_dev: List[Optional[torch.device]] = [None]

    def _aligned(n: int) -> int:
        return -(-n // 16) * 16

    def flush() -> None:
        if not bucket:
            return
        dev = bucket_dev[0]
        total = sum(_aligned(t.numel() * t.element_size()) for t in bucket)
        buf = torch.empty(total, dtype=torch.uint8, device=dev)
        offset = 0
        views = []
        for t in bucket:
            n = t.numel() * t.element_size()
            view = buf[offset:offset + n].view(t.dtype).view(t.shape)
            if is_src:
                view.copy_(t)
            views.append(view)
            offset += _aligned(n)
        collectives.broadcast(buf, src_rank, pg)
        if not is_src:
            for t, view in zip(bucket, views):
                t.copy_(view)
        bucket.clear()

    for t in tensors:
        t = t.detach()
        if t.numel() == 0 or t.device.type == "meta":
            continue  # a meta tensor has no value yet (a model built on meta: loaded later)
        dev = comm_device(pg, t.device)
        nbytes = t.numel() * t.element_size()
        if nbytes < chunk_bytes:
            if bucket_dev[0] != dev or sum(_aligned(b.numel() * b.element_size())
                                           for b in bucket) + nbytes > chunk_bytes:
                flush()
            bucket_dev[0] = dev
            bucket.append(t)
            continue
        flush()
        flat = t if t.is_contiguous() else t.contiguous()
        data = flat.view(-1).view(torch.uint8)
        if dev == t.device:
            collectives.broadcast(data, src_rank, pg)
        else:
            stage = torch.empty(min(chunk_bytes, data.numel()), dtype=torch.uint8, device=dev)
            for i in range(0, data.numel(), stage.numel()):
                part = data[i:i + stage.numel()]
                piece = stage[:part.numel()]
                if is_src:
                    piece.copy_(part)
                collectives.broadcast(piece, src_rank, pg)
                if not is_src:
                    part.copy_(piece)
        if flat is not t and not is_src:
            t.copy_(flat)
    flush()


def _generator(device: torch.device) -> Optional[torch.Generator]:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def rng_fingerprint(device: torch.device) -> Optional[str]:
    """A digest of the default generator's state for ``device`` (``None`` if unknown)."""
    gen = _generator(device)
    if gen is None:
        return None
    return hashlib.sha1(gen.get_state().cpu().numpy().tobytes()).hexdigest()


@dataclass
class ShardSpec:
    """One parameter to fill at construction: ``out`` is this rank's tensor; ``ranges`` (per
    rank, the ranges of the full tensor along ``dim`` it holds) or ``None`` for a replicated
    parameter (the full tensor on every rank). ``blocks`` instead of ``ranges``: per rank, one
    ``(start, end)`` per dim of the full tensor (a block split along several dims, as
    :func:`scatter_blocks` takes it)."""

    out: torch.Tensor
    ranges: Optional[Sequence[Sequence[Tuple[int, int]]]] = None
    dim: int = 0
    blocks: Optional[Sequence[Sequence[Tuple[int, int]]]] = None


def load_initial(pg: dist.ProcessGroup, what: str, config: dict, specs: Sequence[ShardSpec],
                 full_fn: Callable[[], Sequence[Optional[torch.Tensor]]], *,
                 src_rank: Optional[int], drawn: bool) -> None:
    """Fills a module's parameters with their initial values and checks the module's
    arguments across the ranks of ``pg`` (the same ``ValueError`` on every rank if they differ).

    ``full_fn()`` returns the full tensors, one per spec: a fresh draw (``drawn=True``) or the
    module being sharded (``from_linear``). With ``src_rank`` a rank of the group, only that
    rank calls it; the others receive their shards (``scatter_shard``) and the replicated
    tensors (``broadcast_``). When every rank's default generator was in the same state before
    a draw, the source rank's state after it is copied to the others, so that they go on
    drawing the same numbers as if each had drawn the full tensor. With ``src_rank=None``
    every rank calls ``full_fn`` and keeps its part, with no communication of weights; a
    checksum of the first full tensor is compared across ranks instead. (With
    ``TPX_RANK_CHECKS=0`` nothing is compared, and the generators are left as they are.)
    """
    world, rank = pg.size(), dist.get_rank(pg)
    meta = any(s.out.device.type == "meta" for s in specs)
    config = dict(config, src_rank=src_rank, meta=meta)

    def keep_local(fulls) -> None:
        with torch.no_grad():
            for spec, full in zip(specs, fulls):
                if spec.blocks is not None:
                    spec.out.copy_(full[tuple(slice(s, e) for s, e in spec.blocks[rank])])
                elif spec.ranges is None:
                    spec.out.copy_(full)
                else:
                    _copy_rows(full, spec.ranges[rank], spec.dim, 0, spec.out.shape[0], spec.out)

    if src_rank is None:
        fulls = None if meta else list(full_fn())
        if fulls is not None:
            keep_local(fulls)
        checksum = tensor_checksum(fulls[0]) if fulls else None
        if drawn:
            check_same_on_ranks(pg, what, dict(config, initial_weights=checksum))
            return
        # An existing module (PyTorch's src_data_rank=None): each rank keeps its slice of its
        # own module, as asked; ranks whose modules differ are told, not stopped (a checkpoint
        # loaded next makes the initial values moot).
        sums = check_same_on_ranks(pg, what, config, extra=checksum)
        if sums and any(c != sums[0] for c in sums):
            warnings.warn(
                f"tpx: {what}: src_rank=None keeps each rank's slice of its own module, and the "
                f"ranks' modules differ (weight checksums by rank: {sums}), so the sharded "
                "module is made of different ranks' weights. Seed every rank alike before "
                "building the model, load a checkpoint next, or pass src_rank=0 to take one "
                "rank's weights.", stacklevel=2)
        return
    device = specs[0].out.device
    share_rng = drawn and not meta and world > 1
    extras = check_same_on_ranks(pg, what, dict(config, drawn=bool(drawn),
                                                chunk_bytes=init_chunk_bytes()),
                                 extra=rng_fingerprint(device) if share_rng else None)
    check_src_rank(what, src_rank, world)
    if meta:
        return
    fulls = list(full_fn()) if rank == src_rank else [None] * len(specs)
    if world == 1:
        keep_local(fulls)
        return
    with torch.no_grad():
        replicated = []
        for spec, full in zip(specs, fulls):
            if spec.blocks is not None:
                scatter_blocks(pg, src_rank, full, spec.out, spec.blocks)
            elif spec.ranges is None:
                if full is not None:
                    spec.out.copy_(full)
                replicated.append(spec.out)
            else:
                scatter_shard(pg, src_rank, full, spec.out, spec.ranges, spec.dim)
        broadcast_(pg, src_rank, replicated)
    if share_rng and extras and extras[0] is not None and all(e == extras[0] for e in extras):
        gen = _generator(device)
        state = gen.get_state().clone()
        broadcast_(pg, src_rank, [state])
        if rank != src_rank:
            gen.set_state(state)
    del fulls


def shard_in_place(module: nn.Module, shards, pg: dist.ProcessGroup, src_rank: Optional[int],
                   what: str, config: dict, replicated=()) -> None:
    """Each parameter ``(name, dim, rows per rank)`` of ``shards`` (attributes of ``module``)
    keeps this rank's rows, the ``replicated`` ones whole, all with the values of rank
    ``src_rank`` of ``pg`` (the ``Parameter`` objects stay; ``config`` is compared across the
    ranks first, the same ``ValueError`` on every rank where it differs)."""
    rank = dist.get_rank(pg)
    specs, fulls = [], []
    for name, dim, rows in shards:
        p = getattr(module, name)
        shape = list(p.shape)
        shape[dim] = sum(e - s for s, e in rows[rank])
        specs.append(ShardSpec(torch.empty(shape, dtype=p.dtype, device=p.device),
                               ranges=rows, dim=dim))
        fulls.append(p)
    for p in replicated:
        specs.append(ShardSpec(torch.empty_like(p)))
        fulls.append(p)
    load_initial(pg, what, dict(config, dtype=str(fulls[0].dtype)), specs,
                 lambda: [p.detach() for p in fulls], src_rank=src_rank, drawn=False)
    with torch.no_grad():
        for p, spec in zip(fulls, specs):
            p.data = spec.out
            p.grad = None
