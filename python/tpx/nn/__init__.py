"""tpx's drop-in ``nn.Module`` replacements and their functional forms."""

from . import functional
from .functional import linear_cross_entropy, vocab_parallel_cross_entropy
from .embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import VocabParallelCrossEntropyLoss

__all__ = ["ColumnParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelCrossEntropyLoss",
           "VocabParallelEmbedding",
           "functional", "linear_cross_entropy", "vocab_parallel_cross_entropy"]
