"""The only import of the compiled extension (``tpx._C``): loading it registers the
``torch.ops.tpx`` operators (``TORCH_LIBRARY(tpx)``). The rest of tpx calls the extension's
plain functions through this module; ``direct`` holds the kernels of the layers' common calls,
callable without the dispatcher (used by :mod:`tpx.ops` only, see
:func:`tpx.ops.core.lean_mode`)."""

from ._C import (
    build_info, direct, comm_counters, count_collective, cpu_memory_stats, enable_cpu_memory_stats,
    group_broken_reason, mark_group_broken, pipeline_depth, register_owned_group,
    reset_cpu_memory_peak)

__all__ = ["build_info", "direct", "comm_counters", "count_collective", "cpu_memory_stats",
           "enable_cpu_memory_stats", "group_broken_reason", "mark_group_broken",
           "pipeline_depth", "register_owned_group", "reset_cpu_memory_peak"]
