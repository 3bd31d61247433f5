"""The only import of the compiled extension (``tpx._C``): loading it registers the
``torch.ops.tpx`` operators (``TORCH_LIBRARY(tpx)``). The rest of tpx calls the extension's
plain functions through this module."""

from ._C import (build_info, comm_counters, count_collective, cpu_memory_stats,  # noqa: F401
                 enable_cpu_memory_stats, group_broken_reason, mark_group_broken, pipeline_depth,
                 register_owned_group, reset_cpu_memory_peak)

__all__ = ["build_info", "comm_counters", "count_collective", "cpu_memory_stats",
           "enable_cpu_memory_stats", "group_broken_reason", "mark_group_broken",
           "pipeline_depth", "register_owned_group", "reset_cpu_memory_peak"]
