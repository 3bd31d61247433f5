"""Communication accounting: the collectives tpx's ops issue, counted per process group.

Every collective of a tpx op (the C++ engine's, and those issued from Python, all through
:mod:`tpx.comm.collectives`) is counted with the size of this rank's message: its input for an
all-gather, its output for a reduce-scatter or a scatter, the whole buffer for an all-reduce,
a broadcast or a reduce to one rank (an object all-gather: its pickled size). Counting is
always on; it costs one map update per collective. The C++ ops count in compiled graphs too;
the collectives issued from Python are counted in eager mode only.

>>> with tpx.comm_stats() as stats:
...     loss = model(x).sum(); loss.backward()
>>> stats.calls(), stats.bytes(kind="all_reduce")
>>> print(stats)       # one line per (group, kind)
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _ext

__all__ = ["CommStats", "comm_stats", "count_collective", "KINDS"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "scatter")

Key = Tuple[str, str]


def _counters() -> Dict[Key, Tuple[int, int]]:
    return {tuple(k): tuple(v) for k, v in _ext.comm_counters().items()}


def count_collective(pg: dist.ProcessGroup, kind: str, message: Union[Tensor, int]) -> None:
    """Records one collective issued from Python on ``pg`` (``kind`` one of :data:`KINDS`;
    ``message`` this rank's message as a tensor or a byte count)."""
    if torch.compiler.is_compiling():  # a host-side counter has no place in a traced graph
        return
    nbytes = message if isinstance(message, int) else message.numel() * message.element_size()
    _ext.count_collective(pg.group_name, kind, int(nbytes))


class CommStats:
    """The collectives tpx issued between ``__enter__`` and ``__exit__`` (or up to now, while
    still inside), per ``(group name, kind)``."""

    def __init__(self) -> None:
        self._start: Dict[Key, Tuple[int, int]] = {}
        self._end: Optional[Dict[Key, Tuple[int, int]]] = None

    def __enter__(self) -> "CommStats":
        self._start, self._end = _counters(), None
        return self

    def __exit__(self, *exc) -> None:
        self._end = _counters()

    def reset(self) -> None:
        """Starts counting afresh from now."""
        self.__enter__()

    @property
    def counts(self) -> Dict[Key, Tuple[int, int]]:
        """``{(group_name, kind): (calls, bytes)}`` for the entries that changed."""
        end = self._end if self._end is not None else _counters()
        out = {}
        for key, (calls, nbytes) in end.items():
            c0, b0 = self._start.get(key, (0, 0))
            if calls != c0:
                out[key] = (calls - c0, nbytes - b0)
        return out

    def _select(self, group, kind):
        if kind is not None and kind not in KINDS:
            raise ValueError(f"tpx.comm_stats: kind must be one of {KINDS}; got {kind!r}")
        name = group if (group is None or isinstance(group, str)) else _name(group)
        return [v for (g, k), v in self.counts.items()
                if (name is None or g == name) and (kind is None or k == kind)]

    def calls(self, group=None, kind: Optional[str] = None) -> int:
        """Number of collectives (optionally of one group: a name, ProcessGroup or 1-D mesh;
        and of one kind)."""
        return sum(c for c, _ in self._select(group, kind))

    def bytes(self, group=None, kind: Optional[str] = None) -> int:
        """Bytes of this rank's messages (see the module docstring), filtered likewise."""
        return sum(b for _, b in self._select(group, kind))

    def __repr__(self) -> str:
        rows = sorted(self.counts.items())
        if not rows:
            return "CommStats(no collectives)"
        lines = [f"{'group':<12} {'kind':<15} {'calls':>7} {'bytes':>14}"]
        for (g, k), (c, b) in rows:
            lines.append(f"{g:<12} {k:<15} {c:>7} {b:>14}")
        return "\n".join(lines)


def _name(group) -> str:
    from .groups import resolve_group

    return resolve_group(group).group_name


def comm_stats() -> CommStats:
    """A context manager counting the collectives tpx issues inside it (see :class:`CommStats`)."""
    return CommStats()
