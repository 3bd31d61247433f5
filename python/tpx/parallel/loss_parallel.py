"""``tpx.loss_parallel()``: a model's own cross-entropy on vocab-sharded logits.

Inside the context, ``torch.nn.functional.cross_entropy`` (and so ``nn.CrossEntropyLoss``)
treats its input as this rank's block of the class (vocabulary) dimension over the group and
computes :func:`tpx.vocab_parallel_cross_entropy` — the exact loss of the gathered logits,
without gathering them. Hugging Face causal-LM models compute their loss through their
``loss_function`` (it reshapes the logits to the FULL vocabulary size), so the context also
gives them a causal-LM loss that reshapes to the local width. Use it with a plan whose LM head
keeps its output sharded (``ColwiseParallel(output_layouts=Shard(-1))``;
``tpx.plans.auto(model, loss_parallel=True)``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..group import GroupLike, resolve_group
from ..nn.functional import vocab_parallel_cross_entropy

__all__ = ["loss_parallel"]

_lock = threading.Lock()
_active = []  # stack of process groups of the open contexts


def _sharded_cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                           size_average=None, ignore_index: int = -100, reduce=None,
                           reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    if weight is not None:
        raise NotImplementedError("tpx.loss_parallel: cross_entropy with class `weight` is not "
                                  "supported on vocab-sharded logits")
    if size_average is not None or reduce is not None:
        raise ValueError("tpx.loss_parallel: the deprecated `size_average`/`reduce` arguments "
                         "are not supported; use `reduction`")
    if target.is_floating_point():
        raise NotImplementedError("tpx.loss_parallel: class-probability targets are not "
                                  "supported on vocab-sharded logits; pass class indices")
    if input.dim() >= 3:  # [N, C, d1, ...]: classes are dim 1
        input = input.movedim(1, -1)
    elif input.dim() == 1:
        input, target = input.unsqueeze(0), target.unsqueeze(0)
    return vocab_parallel_cross_entropy(input, target, group=_active[-1],
                                        ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, reduction=reduction)


def _causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int,
                    num_items_in_batch: Optional[Tensor] = None, ignore_index: int = -100,
                    shift_labels: Optional[Tensor] = None, **kwargs) -> Tensor:
    """A Hugging Face causal-LM loss on vocab-sharded logits: position t predicts token
    t + 1, ``ignore_index`` rows are skipped, ``num_items_in_batch`` (when given) divides
    the summed loss, as the library's own loss does."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, logits.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = vocab_parallel_cross_entropy(logits, shift_labels, group=_active[-1],
                                        ignore_index=ignore_index, reduction=reduction,
                                        vocab_size=vocab_size)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _hf_loss_mapping():
    module = sys.modules.get("transformers.loss.loss_utils")
    return getattr(module, "LOSS_MAPPING", None) if module is not None else None


@contextlib.contextmanager
def loss_parallel(group: GroupLike = None) -> Iterator[None]:
    """Inside this context, cross-entropy losses take vocab-sharded logits.

    Placement: ``logits S(class dim)`` (this rank's ``tpx.shard_range(V)`` block), ``target
    R`` -> ``loss R``, for ``F.cross_entropy``, ``nn.CrossEntropyLoss`` and the causal-LM
    loss of Hugging Face models (``model(input_ids, labels=labels)``). Supports
    ``ignore_index``, ``label_smoothing`` (over the full vocabulary) and every ``reduction``;
    class weights and probability targets raise. The backward needs no context.

    Args:
        group: the TP group the logits are sharded over (``None``: the default group; a
            ``ProcessGroup`` or a 1-D ``DeviceMesh``, e.g. ``mesh["tp"]``).
    """
    pg = resolve_group(group)
    with _lock:
        outer = len(_active) == 0
        _active.append(pg)
        if outer:
            saved_ce = F.cross_entropy
            F.cross_entropy = _sharded_cross_entropy
            mapping = _hf_loss_mapping()
            saved_hf = mapping.get("ForCausalLM") if mapping is not None else None
            if saved_hf is not None:
                mapping["ForCausalLM"] = _causal_lm_loss
    try:
        yield
    finally:
        with _lock:
            _active.pop()
            if outer:
                F.cross_entropy = saved_ce
                if saved_hf is not None:
                    mapping["ForCausalLM"] = saved_hf
