"""tpx's drop-in ``nn.Module`` replacements and their functional forms."""

from . import functional
from .functional import linear_cross_entropy, vocab_parallel_cross_entropy
from .embedding import ColumnParallelEmbedding, VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import VocabParallelCrossEntropyLoss
from .multidim import (
    Embedding2D, Embedding2p5D, Embedding3D, LayerNorm2D, LayerNorm2p5D, LayerNorm3D, Linear2D,
    Linear2p5D, Linear3D, RMSNorm2D, RMSNorm2p5D, RMSNorm3D, gather_output, split_input)

__all__ = ["ColumnParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelCrossEntropyLoss",
           "VocabParallelEmbedding",
           "functional", "linear_cross_entropy", "vocab_parallel_cross_entropy"]
__all__ += ["Linear2D", "Linear2p5D", "Linear3D", "gather_output", "split_input", "LayerNorm2D",
            "LayerNorm2p5D", "LayerNorm3D", "RMSNorm2D", "RMSNorm2p5D", "RMSNorm3D", "Embedding2D", "Embedding2p5D", "Embedding3D"]
