"""tpx's drop-in ``nn.Module`` replacements."""

from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]
