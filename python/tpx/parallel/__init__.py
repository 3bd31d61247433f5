"""Sharding whole models: ``parallelize_module`` and the parallel styles."""

from .api import parallelize_module
from .style import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                    Replicate, RowwiseParallel, SequenceParallel, Shard)

__all__ = ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleOutput", "ParallelStyle", "Replicate", "Shard"]
