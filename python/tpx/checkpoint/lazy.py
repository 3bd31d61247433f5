"""Tensors of checkpoint files not read yet, and the conversions of a loader applied to them
before any byte is read.

A :class:`Lazy` knows its shape and dtype; ``read_into(region, out)`` reads only the part of
it that ``region`` names (a ``(start, end)`` range per dim) into ``out``. The leaves are
tensors of safetensors files (:class:`Source`, read through ``safe_open(...).get_slice``, which
reads the bytes of the slice only) or of ``pytorch_model.bin`` files, memory-mapped
(:class:`TensorSource`); the other nodes stand for what a loader does to them:
stack the per-expert tensors of a mixture of experts (:class:`Stack`), concatenate gate and up
projections (:class:`Cat`), chunk a fused tensor (:class:`Narrow`), transpose
(:class:`Transpose`). A region of a node becomes regions of its inputs, so a rank that needs
rows 100-200 of the stacked experts reads rows 100-200 of each expert, nothing else.

The nodes speak enough of torch (``torch.stack``, ``torch.cat``, ``torch.chunk``,
``torch.split``, ``torch.transpose``, ``.contiguous()``, ``.reshape()`` ...) through
``__torch_function__`` for transformers' own weight converters (``MergeModulelist``,
``Concatenate``, ``Chunk``, ``Split``, ``Transpose``, ``Interleave``) to run on them unchanged:
their result is the plan of the reads. An operation these nodes do not know raises
:class:`NotSliceable` naming it, before anything is read.

A reshape that is not a squeeze or unsqueeze (``Interleave``) is the one node that reads its
input whole (one tensor of the files, never more) before it cuts the region out."""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

Region = Tuple[Tuple[int, int], ...]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
           "F8_E5M2": getattr(torch, "float8_e5m2", None)}


class NotSliceable(TypeError):
    """A conversion of checkpoint tensors that tpx cannot apply slice by slice."""


def whole(shape: Sequence[int]) -> Region:
    return tuple((0, int(n)) for n in shape)


class Lazy:
    """A tensor of the files, not read yet (module docstring)."""

    shape: torch.Size
    dtype: torch.dtype
    # Whether reading a region reads only that region (False: some node reads its input whole).
    sliced = True

    # -- reading -----------------------------------------------------------------------------
    def read_into(self, region: Region, out: Tensor) -> None:
        raise NotImplementedError

    def read(self, region: Optional[Region] = None, dtype: Optional[torch.dtype] = None
             ) -> Tensor:
        region = whole(self.shape) if region is None else tuple(region)
        out = torch.empty([e - s for s, e in region], dtype=dtype or self.dtype)
        self.read_into(region, out)
        return out

    def sources(self) -> List["Source"]:
        raise NotImplementedError

    # -- the torch surface transformers' converters use --------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, d: Optional[int] = None):
        return self.shape if d is None else self.shape[d]

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def contiguous(self, *args, **kwargs) -> "Lazy":
        return self

    def clone(self, *args, **kwargs) -> "Lazy":
        return self

    def detach(self) -> "Lazy":
        return self

    def to(self, *args, **kwargs) -> "Lazy":
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
        return self if dtype is None or dtype == self.dtype else Cast(self, dtype)

    def transpose(self, d0: int, d1: int) -> "Lazy":
        return Transpose(self, d0, d1)

    def t(self) -> "Lazy":
        return Transpose(self, 0, 1)

    def narrow(self, d: int, start: int, length: int) -> "Lazy":
        return Narrow(self, d, start, length)

    def chunk(self, chunks: int, dim: int = 0) -> Tuple["Lazy", ...]:
        return _chunk(self, chunks, dim)

    def split(self, sizes, dim: int = 0) -> Tuple["Lazy", ...]:
        return _split(self, sizes, dim)

    def squeeze(self, dim: Optional[int] = None) -> "Lazy":
        return _reshape(self, [n for i, n in enumerate(self.shape)
                               if not (n == 1 and (dim is None or i == dim % self.ndim))])

    def unsqueeze(self, dim: int) -> "Lazy":
        shape = list(self.shape)
        shape.insert(dim % (self.ndim + 1), 1)
        return _reshape(self, shape)

    def reshape(self, *shape) -> "Lazy":
        if len(shape) == 1 and isinstance(shape[0], (list, tuple, torch.Size)):
            shape = shape[0]
        return _reshape(self, list(shape))

    view = reshape

    def __getitem__(self, index) -> "Lazy":
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            at = index.index(Ellipsis)
            rest = len(index) - 1
            index = index[:at] + (slice(None),) * (self.ndim - rest) + index[at + 1:]
        out: Lazy = self
        d = 0
        for i in index:
            if isinstance(i, slice):
                start, stop, step = i.indices(out.shape[d])
                if step != 1:
                    raise NotSliceable("tpx: a strided index of checkpoint tensors")
                if (start, stop) != (0, out.shape[d]):
                    out = Narrow(out, d, start, max(stop - start, 0))
                d += 1
            elif isinstance(i, int):
                out = _reshape(Narrow(out, d, i % out.shape[d], 1),
                               [n for j, n in enumerate(out.shape) if j != d])
            else:
                raise NotSliceable(f"tpx: index {i!r} of checkpoint tensors")
        return out

    def _new(self, *args, **kwargs) -> "Lazy":
        # padding (transformers' vocabulary padding on save): tensors of no checkpoint's
        raise NotSliceable("tpx: new tensors made beside checkpoint tensors (padding) are "
                           "not read or written slice by slice")

    new_zeros = new_ones = new_full = new_empty = _new

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _FUNCTIONS.get(func)
        if impl is None:
            name = getattr(func, "__name__", repr(func))
            raise NotSliceable(f"tpx: torch.{name} of checkpoint tensors is not read slice by "
                               "slice")
        return impl(*args, **kwargs)


def read_local(src: Lazy, ranges: List[List[Tuple[int, int]]], dst: torch.Tensor) -> None:
    """Reads the blocks ``ranges`` (per dim, in local order) of ``src`` into ``dst``."""
    per_dim = []
    for rs in ranges:
        offs, o = [], 0
        for s, e in rs:
            offs.append((s, e, o))
            o += e - s
        per_dim.append(offs)
    if not per_dim:  # a scalar
        src.read_into((), dst)
        return
    for combo in itertools.product(*per_dim):
        view = dst
        for d, (s, e, o) in enumerate(combo):
            view = view.narrow(d, o, e - s)
        src.read_into(tuple((s, e) for s, e, _ in combo), view)


def map_safetensors(path: str) -> Dict[str, Tensor]:
    """The tensors of a safetensors file as views of the file mapped into memory (read-only,
    no copy: reading a slice of one copies those bytes once, from the page cache into the
    destination). A tensor whose data does not start at a multiple of its element size is
    left out (read through safetensors instead)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
        if size <= 8 + n:
            return {}
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # read-only memory: the views are never written
        warnings.simplefilter("ignore")
        buf = torch.frombuffer(mapped, dtype=torch.uint8)
    out = {}
    for key, info in header.items():
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if key != "__metadata__" else None
        if dtype is None:
            continue
        s, e = info["data_offsets"]
        if (8 + n + s) % dtype.itemsize:
            continue
        out[key] = buf[8 + n + s:8 + n + e].view(dtype).view(info["shape"])
    return out


class Source(Lazy):
    """One tensor of a safetensors file: ``sl`` is ``safe_open(...).get_slice(key)``;
    ``mapped``, when given, the same tensor as a view of the mapped file
    (:func:`map_safetensors`), read from without an intermediate copy."""

    def __init__(self, sl, key: str, file: str, mapped: Optional[Tensor] = None) -> None:
        self.sl, self.key, self.file, self.mapped = sl, key, file, mapped
        self.shape = torch.Size(sl.get_shape())
        dtype = SAFETENSORS_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise NotSliceable(f"tpx: {key} in {file} has dtype {sl.get_dtype()}, which tpx "
                               "does not read")
        self.dtype = dtype

    def read_into(self, region: Region, out: Tensor) -> None:
        if any(e <= s for s, e in region):
            return
        if self.mapped is not None:
            out.copy_(self.mapped[tuple(slice(s, e) for s, e in region)])
            return
        if not region:
            out.copy_(self.sl[...])
            return
        out.copy_(self.sl[tuple(slice(s, e) for s, e in region)])

    def sources(self) -> List["Source"]:
        return [self]


class TensorSource(Lazy):
    """One tensor of a pickled checkpoint (``pytorch_model.bin``), loaded memory-mapped
    (:func:`map_pickled`): reading a region copies those bytes once, from the page cache into
    the destination."""

    def __init__(self, tensor: Tensor, key: str, file: str) -> None:
        self.tensor, self.key, self.file = tensor, key, file
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def read_into(self, region: Region, out: Tensor) -> None:
        if any(e <= s for s, e in region):
            return
        out.copy_(self.tensor[tuple(slice(s, e) for s, e in region)] if region else self.tensor)

    def sources(self) -> List["Lazy"]:
        return [self]


def map_pickled(path: str, what: str) -> Dict[str, Tensor]:
    """The tensors of a ``pytorch_model.bin`` file, memory-mapped (``torch.load(mmap=True,
    weights_only=True)``: nothing is read until a slice is copied, and no code of the file
    runs)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - one message for every way a file is not readable
        raise ValueError(
            f"{what}: {path} cannot be read memory-mapped with weights_only=True "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}); "
            "convert it to safetensors (transformers' from_pretrained on one process, then "
            "save_pretrained). Nothing was loaded") from None
    if not isinstance(state, dict):
        raise ValueError(f"{what}: {path} holds a {type(state).__name__}, not a state dict; "
                         "nothing was loaded")
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


class Narrow(Lazy):
    def __init__(self, x: Lazy, d: int, start: int, length: int) -> None:
        d %= x.ndim
        if start < 0 or start + length > x.shape[d]:
            raise ValueError(f"tpx: narrow({d}, {start}, {length}) of a tensor of shape "
                             f"{tuple(x.shape)}")
        self.x, self.d, self.start = x, d, start
        shape = list(x.shape)
        shape[d] = length
        self.shape, self.dtype, self.sliced = torch.Size(shape), x.dtype, x.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        r = list(region)
        s, e = r[self.d]
        r[self.d] = (s + self.start, e + self.start)
        self.x.read_into(tuple(r), out)

    def sources(self):
        return self.x.sources()


class Transpose(Lazy):
    def __init__(self, x: Lazy, d0: int, d1: int) -> None:
        self.x, self.d0, self.d1 = x, d0 % x.ndim, d1 % x.ndim
        shape = list(x.shape)
        shape[self.d0], shape[self.d1] = shape[self.d1], shape[self.d0]
        self.shape, self.dtype, self.sliced = torch.Size(shape), x.dtype, x.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        r = list(region)
        r[self.d0], r[self.d1] = r[self.d1], r[self.d0]
        self.x.read_into(tuple(r), out.transpose(self.d0, self.d1))

    def sources(self):
        return self.x.sources()


class Cast(Lazy):
    def __init__(self, x: Lazy, dtype: torch.dtype) -> None:
        self.x, self.shape, self.dtype, self.sliced = x, x.shape, dtype, x.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        self.x.read_into(region, out)  # out has its own dtype: copy_ casts

    def sources(self):
        return self.x.sources()


class Cat(Lazy):
    def __init__(self, parts: Sequence[Lazy], d: int) -> None:
        parts = list(parts)
        if not parts:
            raise ValueError("tpx: cat of no tensors")
        d %= parts[0].ndim
        for p in parts[1:]:
            if p.ndim != parts[0].ndim or any(a != b for i, (a, b) in
                                              enumerate(zip(p.shape, parts[0].shape)) if i != d):
                raise ValueError(f"tpx: cat along dim {d} of shapes "
                                 f"{[tuple(q.shape) for q in parts]}")
        shape = list(parts[0].shape)
        shape[d] = sum(p.shape[d] for p in parts)
        self.parts, self.d = parts, d
        self.shape, self.dtype = torch.Size(shape), parts[0].dtype
        self.sliced = all(p.sliced for p in parts)

    def read_into(self, region: Region, out: Tensor) -> None:
        s, e = region[self.d]
        offset = 0
        for p in self.parts:
            n = p.shape[self.d]
            a, b = max(s, offset), min(e, offset + n)
            if a < b:
                r = list(region)
                r[self.d] = (a - offset, b - offset)
                p.read_into(tuple(r), out.narrow(self.d, a - s, b - a))
            offset += n

    def sources(self):
        return [s for p in self.parts for s in p.sources()]


class Stack(Lazy):
    def __init__(self, parts: Sequence[Lazy], d: int) -> None:
        parts = list(parts)
        if not parts:
            raise ValueError("tpx: stack of no tensors")
        d %= parts[0].ndim + 1
        for p in parts[1:]:
            if tuple(p.shape) != tuple(parts[0].shape):
                raise ValueError(f"tpx: stack of shapes {[tuple(q.shape) for q in parts]}")
        shape = list(parts[0].shape)
        shape.insert(d, len(parts))
        self.parts, self.d = parts, d
        self.shape, self.dtype = torch.Size(shape), parts[0].dtype
        self.sliced = all(p.sliced for p in parts)

    def read_into(self, region: Region, out: Tensor) -> None:
        s, e = region[self.d]
        inner = region[:self.d] + region[self.d + 1:]
        for i in range(s, e):
            self.parts[i].read_into(inner, out.select(self.d, i - s))

    def sources(self):
        return [s for p in self.parts for s in p.sources()]


class Reshape(Lazy):
    """A reshape other than adding or dropping dims of size 1: reads its input whole."""

    sliced = False

    def __init__(self, x: Lazy, shape: Sequence[int]) -> None:
        self.x, self.shape, self.dtype = x, torch.Size(shape), x.dtype

    def read_into(self, region: Region, out: Tensor) -> None:
        full = self.x.read().reshape(self.shape)
        out.copy_(full[tuple(slice(s, e) for s, e in region)])

    def sources(self):
        return self.x.sources()


class Unit(Lazy):
    """Dims of size 1 added or dropped: ``keep[i]`` is the input dim of output dim ``i``
    (``None``: a new dim of size 1)."""

    def __init__(self, x: Lazy, shape: Sequence[int], keep: List[Optional[int]]) -> None:
        self.x, self.keep = x, keep
        self.shape, self.dtype, self.sliced = torch.Size(shape), x.dtype, x.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        r: List[Tuple[int, int]] = [(0, 1)] * self.x.ndim
        for i, src in enumerate(self.keep):
            if src is not None:
                r[src] = region[i]
        view = out  # views only: ``out`` may be a strided view of the destination
        for i in reversed(range(len(self.keep))):
            if self.keep[i] is None:
                view = view.squeeze(i)
        kept = set(k for k in self.keep if k is not None)
        for j in range(self.x.ndim):
            if j not in kept:
                view = view.unsqueeze(j)
        self.x.read_into(tuple(r), view)

    def sources(self):
        return self.x.sources()


def _reshape(x: Lazy, shape: List[int]) -> Lazy:
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        shape = [x.numel() // known if n == -1 else n for n in shape]
    if math.prod(shape) != x.numel():
        raise ValueError(f"tpx: reshape of {tuple(x.shape)} to {tuple(shape)}")
    if tuple(shape) == tuple(x.shape):
        return x
    # Only dims of size 1 added or dropped: a region maps dim by dim.
    big_in = [i for i, n in enumerate(x.shape) if n != 1]
    big_out = [i for i, n in enumerate(shape) if n != 1]
    if [x.shape[i] for i in big_in] == [shape[i] for i in big_out]:
        keep: List[Optional[int]] = [None] * len(shape)
        for i, j in zip(big_out, big_in):
            keep[i] = j
        return Unit(x, shape, keep)
    return Reshape(x, shape)


def _chunk(x: Lazy, chunks: int, dim: int = 0) -> Tuple[Lazy, ...]:
    n = x.shape[dim]
    per = -(-n // chunks) if n else 0
    out = []
    for start in range(0, n, per or 1):
        out.append(Narrow(x, dim, start, min(per, n - start)))
        if per == 0:
            break
    return tuple(out)


def _split(x: Lazy, sizes, dim: int = 0) -> Tuple[Lazy, ...]:
    n = x.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    if sum(sizes) != n:
        raise ValueError(f"tpx: split of {n} entries into {list(sizes)}")
    out, start = [], 0
    for k in sizes:
        out.append(Narrow(x, dim, start, int(k)))
        start += int(k)
    return tuple(out)


def _stack(tensors, dim: int = 0, **_) -> Lazy:
    return Stack(list(tensors), dim)


def _cat(tensors, dim: int = 0, **_) -> Lazy:
    tensors = list(tensors)
    return tensors[0] if len(tensors) == 1 else Cat(tensors, dim)


def _method(name: str) -> Callable:
    return lambda self, *a, **k: getattr(Lazy, name)(self, *a, **k)


_FUNCTIONS = {
    torch.stack: _stack,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.concatenate: _cat,
    torch.chunk: lambda x, chunks, dim=0: _chunk(x, chunks, dim),
    torch.split: lambda x, sizes, dim=0: _split(x, sizes, dim),
    torch.transpose: lambda x, dim0, dim1: Transpose(x, dim0, dim1),
    torch.t: lambda x: Transpose(x, 0, 1),
    torch.narrow: lambda x, dim, start, length: Narrow(x, dim, start, length),
    torch.squeeze: _method("squeeze"),
    torch.unsqueeze: _method("unsqueeze"),
    torch.reshape: lambda x, shape: _reshape(x, list(shape)),
}
