"""Every collective tpx issues from Python, through one path: the layout changes at the
layers' edges, the width exchange of a vocab-parallel loss, the norms of gradient clipping,
the initial weights handed out by a source rank, and the cross-rank checks.

Each function takes the user's group ``pg`` and runs on tpx's own copy of it (made on first
use, :func:`tpx.comm.owned.own`; NCCL groups are used as they are), raising at once if tpx
marked that group broken (:func:`tpx.comm.owned.wire_group`: ``torch.distributed.DistError``);
a collective that fails raises ``torch.distributed.DistBackendError``. Each is counted by
:func:`tpx.comm_stats` under the user's group with this rank's message size (an object
collective with its pickled size). Ranks are ranks of ``pg`` (``src_rank``), as everywhere in
tpx. The C++ ops issue the rest of tpx's traffic, counted the same way.

While one of PyTorch's tools that watch collectives is active (:func:`watched`:
``torch.distributed.tensor.debug.CommDebugMode``), the tensor collectives go through PyTorch's
functional collectives (``torch.ops._c10d_functional``) instead, so that the tool sees them
under the names PyTorch's own TP would issue; tpx's operators then run their reference
decomposition the same way (:mod:`tpx.ops.reference`).
"""

from __future__ import annotations

import pickle
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .stats import count_collective
from .owned import own, wire_group

__all__ = ["all_gather", "all_gather_object", "all_reduce", "broadcast", "reduce_scatter",
           "scatter", "watched", "functional_all_gather", "functional_all_reduce",
           "functional_reduce_scatter"]


def _wire(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    own(pg)
    return wire_group(pg)


def _run(collective, *args, **kwargs) -> None:
    """Runs one of ``torch.distributed``'s collectives; its failure (gloo raises a plain
    ``RuntimeError``) is raised as ``torch.distributed.DistBackendError``, as the C++ ops raise
    theirs, so that tpx tells a failed collective from other errors by its type."""
    try:
        collective(*args, **kwargs)
    except dist.DistError:
        raise
    except RuntimeError as e:
        raise dist.DistBackendError(f"tpx: a collective failed: {e}") from e


# The dispatch modes of PyTorch's that count or simulate collectives (filled by
# tpx.ops.reference, which gives tpx's operators a rule for each).
WATCHING_MODES: set = set()


def watched() -> bool:
    """Whether a dispatch mode of :data:`WATCHING_MODES` (PyTorch's ``CommDebugMode``) is
    active: tpx's collectives then go through PyTorch's functional collectives."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(type(m) in WATCHING_MODES for m in _get_current_dispatch_mode_stack())


_FUNCOL = None


def _funcol():
    global _FUNCOL
    if _FUNCOL is None:
        _FUNCOL = torch.ops._c10d_functional
    return _FUNCOL


def functional_all_reduce(tensor: Tensor, pg: dist.ProcessGroup, op: str = "sum") -> Tensor:
    """The reduction (``"sum"`` or ``"max"``) of ``tensor`` over ``pg``, as a new tensor, through
    PyTorch's functional collective (``_c10d_functional.all_reduce``)."""
    if pg.size() == 1:
        return tensor.clone()
    wire = _wire(pg)
    count_collective(pg, "all_reduce", tensor)
    f = _funcol()
    return f.wait_tensor(f.all_reduce(tensor.contiguous(), op, wire.group_name))


def functional_all_gather(tensor: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, through PyTorch's
    functional collective (``_c10d_functional.all_gather_into_tensor``)."""
    if pg.size() == 1:
        return tensor.clone()
    wire = _wire(pg)
    count_collective(pg, "all_gather", tensor)
    f = _funcol()
    return f.wait_tensor(f.all_gather_into_tensor(tensor.contiguous(), pg.size(),
                                                  wire.group_name))


def functional_reduce_scatter(tensor: Tensor, pg: dist.ProcessGroup) -> Tensor:
    """Block ``rank`` (along dim 0) of the sum over ``pg`` of ``tensor``, through PyTorch's
    functional collective (``_c10d_functional.reduce_scatter_tensor``)."""
    if pg.size() == 1:
        return tensor.clone()
    f = _funcol()
    wire = _wire(pg)
    out = f.wait_tensor(f.reduce_scatter_tensor(tensor.contiguous(), "sum", pg.size(),
                                                wire.group_name))
    count_collective(pg, "reduce_scatter", out)
    return out


def all_gather(outputs: List[Tensor], tensor: Tensor, pg: dist.ProcessGroup) -> None:
    """``outputs[r]`` <- rank ``r``'s ``tensor`` (every rank's of the same shape)."""
    if watched():
        for out, piece in zip(outputs, functional_all_gather(tensor[None], pg)):
            out.copy_(piece)
        return
    wire = _wire(pg)
    count_collective(pg, "all_gather", tensor)
    _run(dist.all_gather, outputs, tensor, group=wire)


def all_gather_object(outputs: List[Any], obj: Any, pg: dist.ProcessGroup) -> None:
    """``outputs[r]`` <- rank ``r``'s picklable ``obj``. tpx's agreement checks, not a
    collective of the model's layout: hidden from the modes of :func:`watched`."""
    wire = _wire(pg)
    count_collective(pg, "all_gather", len(pickle.dumps(obj)))
    if watched():
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            _run(dist.all_gather_object, outputs, obj, group=wire)
        return
    _run(dist.all_gather_object, outputs, obj, group=wire)


def all_reduce(tensor: Tensor, pg: dist.ProcessGroup,
               op: "dist.ReduceOp.RedOpType" = dist.ReduceOp.SUM) -> None:
    """``tensor`` <- its reduction (``op``) over the ranks of ``pg``, in place."""
    if watched() and op in _FUNCOL_OPS:
        tensor.copy_(functional_all_reduce(tensor, pg, _FUNCOL_OPS[op]))
        return
    wire = _wire(pg)
    count_collective(pg, "all_reduce", tensor)
    _run(dist.all_reduce, tensor, op=op, group=wire)


def reduce_scatter(output: Tensor, tensor: Tensor, pg: dist.ProcessGroup) -> None:
    """``output`` <- block ``rank`` (along dim 0) of the sum over ranks of ``tensor``."""
    if watched():
        output.copy_(functional_reduce_scatter(tensor, pg).view_as(output))
        return
    wire = _wire(pg)
    count_collective(pg, "reduce_scatter", output)
    _run(_REDUCE_SCATTER, output, tensor, group=wire)


_FUNCOL_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}


# torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor is deprecated there)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def broadcast(tensor: Tensor, src_rank: int, pg: dist.ProcessGroup) -> None:
    """``tensor`` <- its value on rank ``src_rank`` of ``pg``, in place."""
    wire = _wire(pg)
    count_collective(pg, "broadcast", tensor)
    _run(dist.broadcast, tensor, src=dist.get_global_rank(pg, src_rank), group=wire)


def scatter(output: Tensor, inputs: Optional[List[Tensor]], src_rank: int,
            pg: dist.ProcessGroup) -> None:
    """``output`` <- ``inputs[rank]`` of rank ``src_rank`` of ``pg`` (``inputs`` is read on
    that rank only)."""
    wire = _wire(pg)
    count_collective(pg, "scatter", output)
    _run(dist.scatter, output, inputs, src=dist.get_global_rank(pg, src_rank), group=wire)
