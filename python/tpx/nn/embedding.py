"""Vocab-parallel ``nn.Embedding`` replacement."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import autograd as tpx_autograd  # also registers the backward of every op
from .. import ops
from ..checks import check_values
from ..group import (GroupLike, SharesGroupOnCopy, _range, check_same_on_ranks, resolve_group,
                     shard_sizes, tensor_checksum)

__all__ = ["VocabParallelEmbedding", "ColumnParallelEmbedding"]


def _check_embedding_args(cls: str, num_embeddings: int, embedding_dim: int,
                          padding_idx: Optional[int]) -> Optional[int]:
    """Validates the sizes; returns ``padding_idx`` made non-negative."""
    for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"tpx.{cls}: `{name}` must be a positive int; got {value!r}")
    if padding_idx is not None:
        if not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"tpx.{cls}: padding_idx={padding_idx} must lie in "
                             f"[-{num_embeddings}, {num_embeddings})")
        padding_idx %= num_embeddings
    return padding_idx


def _full_embedding_init(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int],
                         device, dtype) -> Tensor:
    """The full table drawn as ``nn.Embedding`` draws it: normal(0, 1), padding row zero."""
    full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
    nn.init.normal_(full)
    if padding_idx is not None:
        with torch.no_grad():
            full[padding_idx].fill_(0)
    return full


def _embedding_kwargs(cls, embedding: nn.Embedding, kwargs: dict) -> dict:
    """Checks an ``nn.Embedding`` passed to ``from_embedding`` and returns the constructor's
    arguments taken from it."""
    if not isinstance(embedding, nn.Embedding):
        raise TypeError(f"tpx.{cls.__name__}.from_embedding expects an nn.Embedding; got "
                        f"{type(embedding).__name__}")
    for key in ("device", "dtype", "padding_idx"):
        if key in kwargs:
            raise ValueError(f"tpx.{cls.__name__}.from_embedding: `{key}` is taken from the "
                             "embedding; do not pass it")
    for unsupported in ("max_norm", "sparse"):
        if getattr(embedding, unsupported, None):
            raise ValueError(f"tpx.{cls.__name__}: nn.Embedding({unsupported}=...) is not "
                             "supported")
    w = embedding.weight
    return dict(num_embeddings=embedding.num_embeddings, embedding_dim=embedding.embedding_dim,
                padding_idx=embedding.padding_idx, device=w.device, dtype=w.dtype,
                _full_weight=w)


class VocabParallelEmbedding(SharesGroupOnCopy, nn.Module):
    """``nn.Embedding`` with the rows of its table sharded over ``group``.

    Placement: ``ids R -> y R``; with ``sequence_parallel=True``: ``ids R -> y
    S(sequence_dim)`` (the partial lookups are reduce-scattered along the sequence instead of
    all-reduced; that dimension of ``ids`` must divide by the group size).

    This rank holds rows ``tpx.shard_range(num_embeddings)`` (uneven splits allowed); ids
    outside them look up zeros, so the rows of other ranks never leak. ``padding_idx``
    behaves as in ``nn.Embedding``: its row is initialised to zero and gets no gradient. Ids
    outside ``[0, num_embeddings)`` raise ``ValueError``. Parameters are initialised with
    ``nn.Embedding``'s distribution over the FULL table and then sliced, so with the same seed
    the shards equal the slices of ``nn.Embedding``'s weight.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, *, group: GroupLike = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, device=None,
                 dtype=None, _full_weight: Optional[Tensor] = None) -> None:
        super().__init__()
        padding_idx = _check_embedding_args("VocabParallelEmbedding", num_embeddings,
                                            embedding_dim, padding_idx)
        self.group = resolve_group(group)
        self.world_size, self.rank = self.group.size(), torch.distributed.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.vocab_start, self.vocab_end = _range(num_embeddings, self.rank, self.world_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               device=device, dtype=dtype))
        if _full_weight is not None:
            with torch.no_grad():
                self.weight.copy_(_full_weight[self.vocab_start:self.vocab_end])
            checksum = tensor_checksum(_full_weight)
        else:
            checksum = self.reset_parameters()
        check_same_on_ranks(self.group, "VocabParallelEmbedding", dict(
            num_embeddings=num_embeddings, embedding_dim=embedding_dim, padding_idx=padding_idx,
            sequence_parallel=self.sequence_parallel, sequence_dim=sequence_dim,
            dtype=str(self.weight.dtype), initial_weights=checksum))

    @property
    def _local_padding_idx(self) -> int:
        p = self.padding_idx
        return p - self.vocab_start if p is not None and self.vocab_start <= p < self.vocab_end else -1

    def reset_parameters(self) -> Optional[float]:
        """Draws the full table as ``nn.Embedding`` does (normal(0, 1), padding row zero) and
        keeps this rank's rows; returns a checksum of the full table."""
        if self.weight.device.type == "meta":
            return None
        full = _full_embedding_init(self.num_embeddings, self.embedding_dim, self.padding_idx,
                                    self.weight.device, self.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(full[self.vocab_start:self.vocab_end])
        return tensor_checksum(full)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: GroupLike = None, **kwargs
                       ) -> "VocabParallelEmbedding":
        """Shards an ``nn.Embedding`` that every rank holds whole (keeps this rank's rows)."""
        return cls(group=group, **_embedding_kwargs(cls, embedding, kwargs), **kwargs)

    def forward(self, ids: Tensor) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError("tpx.VocabParallelEmbedding: ids must be an integer Tensor")
        if ids.device != self.weight.device:
            raise ValueError(f"tpx.VocabParallelEmbedding: ids are on {ids.device} but the table "
                             f"is on {self.weight.device}")
        if ids.numel():  # one aminmax; no host synchronisation (tpx.checks)
            n = self.num_embeddings

            def in_range():
                lo, hi = torch.aminmax(ids)
                return (lo >= 0) & (hi < n)

            def message():
                lo, hi = (int(v) for v in torch.aminmax(ids))
                return (f"tpx.VocabParallelEmbedding: id {lo if lo < 0 else hi} is outside the "
                        f"table [0, {n})")

            check_values(in_range, message)
        scatter_dim = None
        if self.sequence_parallel:
            d = self.sequence_dim
            if not -ids.dim() <= d < ids.dim():
                raise ValueError(f"tpx.VocabParallelEmbedding: sequence_dim={d} is not a dimension "
                                 f"of ids of shape {tuple(ids.shape)}")
            scatter_dim = d % ids.dim()
            if ids.shape[scatter_dim] % self.world_size:
                raise ValueError(
                    f"tpx.VocabParallelEmbedding: with sequence_parallel=True the sequence "
                    f"dimension (dim {scatter_dim}, size {ids.shape[scatter_dim]}) must divide by "
                    f"the group size {self.world_size}; pad the sequence.")
        return ops.vocab_parallel_embedding(self.weight, ids.long(), self.vocab_start, self.group,
                                            scatter_dim, self._local_padding_idx)

    def _shards(self):
        """(parameter name, sharded dim, rows of the full table held by each rank)."""
        yield "weight", 0, [[_range(self.num_embeddings, r, self.world_size)]
                            for r in range(self.world_size)]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.vocab_start}:"
                f"{self.vocab_end}), padding_idx={self.padding_idx}, world_size={self.world_size}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelEmbedding(SharesGroupOnCopy, nn.Module):
    """``nn.Embedding`` with the columns of its table (the embedding dimension) sharded over
    ``group``: every rank looks up all ids in its ``[num_embeddings, embedding_dim / P]``
    block, so the forward needs no communication before the optional gather.

    Placement: ``ids R -> y S(-1)``; with ``gather_output=True`` (default, as PyTorch's
    ``ColwiseParallel`` with ``output_layouts=Replicate()``): ``ids R -> y R`` (all-gathered
    along the last dimension; its backward keeps this rank's columns, no communication).

    This rank holds columns ``tpx.shard_range(embedding_dim)`` (uneven splits allowed).
    ``padding_idx`` behaves as in ``nn.Embedding``. Initialised with ``nn.Embedding``'s
    distribution over the FULL table, then sliced.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, *, group: GroupLike = None,
                 gather_output: bool = True, device=None, dtype=None,
                 _full_weight: Optional[Tensor] = None) -> None:
        super().__init__()
        padding_idx = _check_embedding_args("ColumnParallelEmbedding", num_embeddings,
                                            embedding_dim, padding_idx)
        self.group = resolve_group(group)
        self.world_size, self.rank = self.group.size(), torch.distributed.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.gather_output = padding_idx, bool(gather_output)
        self.dim_start, self.dim_end = _range(embedding_dim, self.rank, self.world_size)
        self.dim_sizes = shard_sizes(embedding_dim, self.world_size)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.dim_end - self.dim_start,
                                               device=device, dtype=dtype))
        if _full_weight is None and self.weight.device.type != "meta":
            _full_weight = _full_embedding_init(num_embeddings, embedding_dim, padding_idx,
                                                self.weight.device, self.weight.dtype)
        checksum = None
        if _full_weight is not None:
            with torch.no_grad():
                self.weight.copy_(_full_weight[:, self.dim_start:self.dim_end])
            checksum = tensor_checksum(_full_weight)
        check_same_on_ranks(self.group, "ColumnParallelEmbedding", dict(
            num_embeddings=num_embeddings, embedding_dim=embedding_dim, padding_idx=padding_idx,
            gather_output=self.gather_output, dtype=str(self.weight.dtype),
            initial_weights=checksum))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: GroupLike = None, **kwargs
                       ) -> "ColumnParallelEmbedding":
        """Shards an ``nn.Embedding`` that every rank holds whole (keeps this rank's columns)."""
        return cls(group=group, **_embedding_kwargs(cls, embedding, kwargs), **kwargs)

    def forward(self, ids: Tensor) -> Tensor:
        y = torch.nn.functional.embedding(ids, self.weight, self.padding_idx)
        if self.gather_output:
            y = tpx_autograd.gather_last_dim(y, self.dim_sizes, self.dim_start, self.group)
        return y

    def _shards(self):
        """(parameter name, sharded dim, columns of the full table held by each rank)."""
        yield "weight", 1, [[_range(self.embedding_dim, r, self.world_size)]
                            for r in range(self.world_size)]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local columns {self.dim_start}:"
                f"{self.dim_end}), padding_idx={self.padding_idx}, world_size={self.world_size}, "
                f"gather_output={self.gather_output}")
