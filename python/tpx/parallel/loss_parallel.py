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
from typing import Iterator, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import mappings, ops
from ..comm.groups import GroupLike, resolve_group
from ..mesh import mesh_layout
from ..layout.dtensor_io import DTensor
from ..nn.functional import vocab_parallel_cross_entropy
from . import simulated

__all__ = ["loss_parallel"]

_lock = threading.Lock()

class _Logits1D(NamedTuple):
    """Where 1-D logits live: their classes split over ``group`` as
    ``shard_range(vocab_size)`` (``vocab_size`` None: any split, widths exchanged per call)."""

    group: torch.distributed.ProcessGroup
    vocab_size: Optional[int]


_active = []  # the open contexts, innermost last: _Logits1D or _MeshLogits


class _MeshLogits:
    """Where a multi-dimensional layout's logits live: the vocabulary split over
    ``vocab_group``, the batch (dim 0) split over ``batch_groups`` into ``blocks`` blocks, this
    rank's block ``index``."""

    def __init__(self, mesh, hidden_mesh_dim: Optional[str]) -> None:
        from ..nn.multidim import block_of, mesh_splits
        from .mesh_styles import mesh_info

        info = mesh_info(mesh, "loss_parallel")
        if info.layout == "3d":
            hidden = hidden_mesh_dim or "weight"
            if hidden not in ("weight", "output"):
                raise ValueError(f"tpx.loss_parallel: `hidden_mesh_dim` must be 'weight' or "
                                 f"'output'; got {hidden_mesh_dim!r}")
        elif hidden_mesh_dim is not None:
            raise ValueError("tpx.loss_parallel: `hidden_mesh_dim` is only for 3-D meshes")
        else:
            hidden = None
        bdims, hdims = mesh_splits(info, hidden)
        self.vocab_group = info.groups[hdims[0]]
        self.batch_groups = [info.group_name(d) for d in bdims]
        self.index, self.blocks = block_of(info, bdims)

    def local_target(self, target: Tensor, rows: int) -> Tensor:
        """This rank's batch block of ``target`` (given whole, or already as the block)."""
        if target.shape[0] == rows:
            return target
        if target.shape[0] == rows * self.blocks:
            return target.narrow(0, self.index * rows, rows)
        raise ValueError(f"tpx.loss_parallel: the target has {target.shape[0]} rows in dim 0; "
                         f"the logits block has {rows} of the {rows * self.blocks} of the full "
                         f"batch: pass the full target or this rank's block of it")

    def total(self, t: Tensor) -> Tensor:
        return mappings.all_reduce_sum_over(t, self.batch_groups)


def _mesh_cross_entropy(spec: _MeshLogits, input: Tensor, target: Tensor, ignore_index: int,
                        label_smoothing: float, reduction: str,
                        divide_by: Optional[Tensor] = None) -> Tensor:
    """Cross-entropy of logits in a multi-dimensional layout (batch rows split, classes
    split): the exact loss of the full batch and vocabulary, the same on every rank."""
    target = spec.local_target(target, input.shape[0])
    rows_in, rows_t = input.reshape(-1, input.shape[-1]), target.reshape(-1)
    # The layouts split the classes evenly (the layers require it), so the full vocabulary is
    # known without asking the other ranks.
    vocab_size = rows_in.shape[-1] * spec.vocab_group.size()
    if reduction == "none":
        return vocab_parallel_cross_entropy(rows_in, rows_t, group=spec.vocab_group,
                                            ignore_index=ignore_index,
                                            label_smoothing=label_smoothing,
                                            reduction="none",
                                            vocab_size=vocab_size).reshape(target.shape)
    if reduction not in ("sum", "mean"):
        raise ValueError(f"tpx.loss_parallel: unknown reduction {reduction!r}")
    local = vocab_parallel_cross_entropy(rows_in, rows_t, group=spec.vocab_group,
                                         ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, reduction="sum",
                                         vocab_size=vocab_size)
    loss = spec.total(local)
    if divide_by is not None:
        return loss / divide_by
    if reduction == "mean":
        with torch.no_grad():
            count = spec.total((rows_t != ignore_index).sum().to(local.dtype))
        return loss / count
    return loss


def _sharded_cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                           size_average=None, ignore_index: int = -100, reduce=None,
                           reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
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
    if isinstance(_active[-1], _MeshLogits):
        if weight is not None:
            raise NotImplementedError(
                "tpx.loss_parallel: class `weight` on the logits of a 2-D / 2.5-D / 3-D layout "
                "is not supported; use a 1-D TP group, or compute the weighted loss from the "
                "per-row losses (reduction='none') yourself")
        return _mesh_cross_entropy(_active[-1], input, target, ignore_index, label_smoothing,
                                   reduction)
    spec = _active[-1]
    if isinstance(input, DTensor):
        # The DTensor knows its mesh and its full vocabulary (the output of a
        # ColwiseParallel(use_local_output=False) head, as in torchtitan's plans).
        return vocab_parallel_cross_entropy(input, target, ignore_index=ignore_index,
                                            label_smoothing=label_smoothing,
                                            reduction=reduction, weight=weight)
    return vocab_parallel_cross_entropy(input, target, group=spec.group,
                                        ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, reduction=reduction,
                                        vocab_size=spec.vocab_size, weight=weight)


def _causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int,
                    num_items_in_batch: Optional[Tensor] = None, ignore_index: int = -100,
                    shift_labels: Optional[Tensor] = None, **kwargs) -> Tensor:
    """A Hugging Face causal-LM loss on vocab-sharded logits: position t predicts token
    t + 1, ``ignore_index`` rows are skipped, ``num_items_in_batch`` (when given) divides
    the summed loss, as the library's own loss does."""
    logits = logits.float()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if isinstance(_active[-1], _MeshLogits):
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(logits.device)
        return _mesh_cross_entropy(_active[-1], logits, shift_labels.to(logits.device),
                                   ignore_index, 0.0,
                                   "sum" if num_items_in_batch is not None else "mean",
                                   divide_by=num_items_in_batch)
    logits = logits.reshape(-1, logits.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = vocab_parallel_cross_entropy(logits, shift_labels, group=_active[-1].group,
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
def loss_parallel(group: GroupLike = None, *, hidden_mesh_dim: Optional[str] = None,
                  vocab_size: Optional[int] = None) -> Iterator[None]:
    """Inside this context, cross-entropy losses take vocab-sharded logits.

    Placement: ``logits S(class dim)`` (this rank's ``tpx.shard_range(V)`` block), ``target
    R`` -> ``loss R``, for ``F.cross_entropy``, ``nn.CrossEntropyLoss`` and the causal-LM
    loss of Hugging Face models (``model(input_ids, labels=labels)``). Supports
    ``ignore_index``, ``label_smoothing`` (over the full vocabulary), class ``weight`` (the full
    ``[V]`` vector on every rank; 1-D groups) and every ``reduction``; probability targets
    raise. The backward needs no context.

    Beyond 1-D (``group`` a mesh from ``tpx.init_mesh("2d" | "2.5d" | "3d")``): the logits
    are the LM head's output in the layout's blocks (batch dim 0 split over the
    batch-splitting mesh dims, classes over the hidden one; ``tpx.plans.auto(model,
    layout=..., loss_parallel=True)``), the target is the FULL batch (or this rank's batch
    block), and the loss is the exact loss of the full batch on every rank (``"mean"``
    divides by the number of non-ignored targets of the whole batch); ``"none"`` returns
    this rank's batch block of the per-row losses.

    Args:
        group: the TP group the logits are sharded over (``None``: the default group; a
            ``ProcessGroup`` or a 1-D ``DeviceMesh``, e.g. ``mesh["tp"]``), or a 2-D / 2.5-D
            / 3-D mesh.
        hidden_mesh_dim: 3-D meshes only: the mesh dim splitting the logits' classes
            (``"weight"``, the default, is the output of a ``Linear3D`` reading the residual
            stream, as in ``tpx.plans.auto``'s plans).
        vocab_size: 1-D only: the full number of classes, when the logits are split as
            ``tpx.shard_range(vocab_size)`` (as tpx's column layers and plans split them).
            Without it, every ``F.cross_entropy`` call all-gathers the ranks' widths and reads
            them on the host (on a GPU, a synchronisation per call). Hugging Face's causal-LM
            loss passes the model's vocabulary size itself; the multi-dimensional layouts
            need no exchange.

    Under PyTorch's simulated ranks (``LocalTensorMode``) this is PyTorch's own
    ``loss_parallel()`` (``tpx.parallel.simulated``).
    """
    if simulated.active():
        from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

        with torch_loss_parallel():
            yield
        return
    if mesh_layout(group) in ("2d", "2.5d", "3d"):
        if vocab_size is not None:
            raise ValueError("tpx.loss_parallel: `vocab_size` is for 1-D groups; a 2-D / 2.5-D "
                             "/ 3-D layout splits the classes evenly and needs no size")
        pg = _MeshLogits(group, hidden_mesh_dim)
    elif hidden_mesh_dim is not None:
        raise ValueError("tpx.loss_parallel: `hidden_mesh_dim` is only for 3-D meshes")
    else:
        pg = resolve_group(group)
        if vocab_size is not None and (not isinstance(vocab_size, int)
                                       or isinstance(vocab_size, bool) or vocab_size < 1):
            raise ValueError(f"tpx.loss_parallel: `vocab_size` must be a positive int (the full "
                             f"number of classes) or None; got {vocab_size!r}")
        pg = _Logits1D(pg, vocab_size)
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
