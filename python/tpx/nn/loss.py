"""Loss modules for vocab-sharded logits (loss parallelism)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..comm.groups import GroupLike, SharesGroupOnCopy, resolve_group
from ..comm.guard import guarded
from .functional import vocab_parallel_cross_entropy

__all__ = ["VocabParallelCrossEntropyLoss"]


class VocabParallelCrossEntropyLoss(SharesGroupOnCopy, nn.Module):
    """Module form of :func:`tpx.vocab_parallel_cross_entropy`: ``loss(logits, target)``.

    Placement: ``logits S(-1)`` (this rank's vocabulary columns), ``target R`` -> ``loss R``.
    Arguments as in ``nn.CrossEntropyLoss`` plus ``group``, ``inplace_backward`` and
    ``vocab_size`` (pass it to skip the per-call all-gather of the shard widths).
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, group: GroupLike = None,
                 inplace_backward: bool = False, vocab_size: Optional[int] = None) -> None:
        super().__init__()
        self.group = resolve_group(group)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.inplace_backward = label_smoothing, inplace_backward
        self.vocab_size = vocab_size

    @guarded
    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits, target, group=self.group, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, reduction=self.reduction,
            inplace_backward=self.inplace_backward, vocab_size=self.vocab_size)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, vocab_size={self.vocab_size}")
