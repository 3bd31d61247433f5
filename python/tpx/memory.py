"""CPU tensor memory accounting, for tests and diagnostics.

``with tpx.memory.track_cpu() as m: ...`` counts every CPU tensor allocation made inside the
block — by tpx, by ATen, and by the process group's own temporaries on its threads — and
reports the largest amount allocated at once beyond what was allocated on entry
(``m.peak_extra`` bytes). The first use installs a counting wrapper around torch's CPU
allocator for the rest of the process (a small cost per allocation), which is why it is a
diagnostic, not something to leave on in production.
"""

from __future__ import annotations

from . import _ext

__all__ = ["track_cpu", "CpuMemoryTracker", "cpu_memory_allocated"]


class CpuMemoryTracker:
    """See :func:`track_cpu`."""

    def __init__(self) -> None:
        self.start = 0
        self.peak_extra = 0

    def __enter__(self) -> "CpuMemoryTracker":
        _ext.enable_cpu_memory_stats()
        _ext.reset_cpu_memory_peak()
        self.start = _ext.cpu_memory_stats()[0]
        return self

    def __exit__(self, *exc) -> None:
        _current, peak = _ext.cpu_memory_stats()
        self.peak_extra = peak - self.start


def track_cpu() -> CpuMemoryTracker:
    """A context manager; ``.peak_extra`` is the peak CPU tensor memory allocated inside the
    block beyond what was allocated on entry, in bytes."""
    return CpuMemoryTracker()


def cpu_memory_allocated() -> int:
    """Bytes of CPU tensor memory allocated now, counted since the first :func:`track_cpu`
    (0 before it). A process group's worker threads free their temporaries shortly after a
    collective's ``wait()`` returns: a caller that wants a quiet baseline can poll this until
    it stops falling."""
    return _ext.cpu_memory_stats()[0]
