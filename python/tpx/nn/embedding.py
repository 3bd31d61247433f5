"""Vocab-parallel ``nn.Embedding`` replacement."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .. import config, mappings
from .. import ops
from ..comm.guard import guarded
from ..comm.checks import check_values
from ..layout.dtensor_io import Replicate, local_input
from ..layout.sharding import KeepsParamSharding, describe_params
from ..layout.param_dtensors import local_of, local_params
from ..comm.groups import GroupLike, resolve_group, shard_bounds, shard_sizes, SharesGroupOnCopy
from ..layout.initial import load_initial, ShardSpec
from .sources import check_source

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
    check_source(cls, "from_embedding", embedding, nn.Embedding, kwargs,
                 ("device", "dtype", "padding_idx"))
    for unsupported in ("max_norm", "sparse"):
        if getattr(embedding, unsupported, None):
            raise ValueError(f"tpx.{cls.__name__}: nn.Embedding({unsupported}=...) is not "
                             "supported")
    w = embedding.weight
    return dict(num_embeddings=embedding.num_embeddings, embedding_dim=embedding.embedding_dim,
                padding_idx=embedding.padding_idx, device=w.device, dtype=w.dtype,
                _full_weight=w)


class VocabParallelEmbedding(KeepsParamSharding, SharesGroupOnCopy, nn.Module):
    """``nn.Embedding`` with the rows of its table sharded over ``group``.

    Placement: ``ids R -> y R``; with ``sequence_parallel=True``: ``ids R -> y
    S(sequence_dim)`` (the partial lookups are reduce-scattered instead of all-reduced).
    ``sequence_dim`` is a dimension of the output ``y`` (``[*ids.shape, embedding_dim]``), as
    PyTorch's ``RowwiseParallel(output_layouts=Shard(d))`` reads it: a dimension of ``ids``
    (the sequence), or the last one (``-1``, or ``ids.dim()``: this rank's block of the
    embedding features); that dimension must divide by the group size.

    This rank holds rows ``tpx.shard_range(num_embeddings)`` (uneven splits allowed); ids
    outside them look up zeros, so the rows of other ranks never leak. ``padding_idx``
    behaves as in ``nn.Embedding``: its row is initialised to zero and gets no gradient. Ids
    outside ``[0, num_embeddings)`` raise ``ValueError``. Parameters are initialised with
    ``nn.Embedding``'s distribution over the FULL table and then sliced, so with the same seed
    the shards equal the slices of ``nn.Embedding``'s weight.

    ``src_rank`` (default 0): the rank of ``group`` whose initial table every rank takes; it
    draws the full table and sends each rank its rows in steps of bounded size
    (``TPX_INIT_CHUNK_BYTES``), so the others never hold more than their shard. ``None``:
    every rank draws and keeps its rows, with no communication (ranks seeded alike, checked).
    """

    _tpx_dtensor_params = True  # the table is a DTensor Shard(dim) parameter

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, *, group: GroupLike = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1, device=None,
                 dtype=None, src_rank: Optional[int] = 0,
                 _full_weight: Optional[Tensor] = None) -> None:
        super().__init__()
        padding_idx = _check_embedding_args("VocabParallelEmbedding", num_embeddings,
                                            embedding_dim, padding_idx)
        self.group = resolve_group(group)
        self.world_size, self.rank = self.group.size(), torch.distributed.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.vocab_start, self.vocab_end = shard_bounds(num_embeddings, self.rank, self.world_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               device=device, dtype=dtype))
        self.src_rank = src_rank
        self._init_weight(_full_weight)

    def _init_weight(self, full_weight: Optional[Tensor]) -> None:
        ranges = [[shard_bounds(self.num_embeddings, r, self.world_size)]
                  for r in range(self.world_size)]
        load_initial(self.group, "VocabParallelEmbedding", dict(
            num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
            padding_idx=self.padding_idx, sequence_parallel=self.sequence_parallel,
            sequence_dim=self.sequence_dim, dtype=str(self.weight.dtype)),
            [ShardSpec(local_of(self.weight), ranges, 0)],
            lambda: [full_weight if full_weight is not None else _full_embedding_init(
                self.num_embeddings, self.embedding_dim, self.padding_idx,
                self.weight.device, self.weight.dtype)],
            src_rank=self.src_rank, drawn=full_weight is None)
        describe_params(self)  # each parameter knows its layout (tpx.layout.sharding)

    @property
    def _local_padding_idx(self) -> int:
        p = self.padding_idx
        return p - self.vocab_start if p is not None and self.vocab_start <= p < self.vocab_end else -1

    def reset_parameters(self) -> None:
        """Draws the full table as ``nn.Embedding`` does (normal(0, 1), padding row zero) and
        gives every rank its rows (from rank ``src_rank``, or each rank's own draw when it is
        ``None``). A collective: call it on every rank of the group."""
        self._init_weight(None)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: GroupLike = None, *,
                       src_rank: Optional[int] = 0, **kwargs) -> "VocabParallelEmbedding":
        """Shards an ``nn.Embedding`` that every rank holds whole: every rank gets its rows of
        rank ``src_rank``'s table (``src_rank=None``: of its own table, no communication; ranks
        whose tables differ get a warning)."""
        return cls(group=group, src_rank=src_rank, **_embedding_kwargs(cls, embedding, kwargs),
                   **kwargs)

    @guarded
    def forward(self, ids: Tensor) -> Tensor:
        if (not self.sequence_parallel and type(ids) is Tensor
                and ops.lean_mode(ids, self.weight, None) == ops.PLAIN):
            # no gradient wanted (inference, decoding): the operator alone, nothing recorded
            weight = local_of(self.weight)
            # CPU ids: their range is checked by the lookup itself, in the same C++ call
            on_cpu = ids.is_cpu
            self._check_ids(ids, weight, values=not on_cpu)
            n = self.num_embeddings if on_cpu and config.input_checks() != "off" else -1
            return ops.plain_embedding(weight, ids.long(), self.vocab_start,
                                       ops.plain_group_name(self.group), self._local_padding_idx,
                                       n)
        ids = local_input(ids, Replicate(), self.group, "VocabParallelEmbedding")
        self._check_ids(ids, self.weight)
        scatter_dim = None
        if self.sequence_parallel:
            d, out_dims = self.sequence_dim, ids.dim() + 1
            if not -out_dims <= d < out_dims:
                raise ValueError(
                    f"tpx.VocabParallelEmbedding: sequence_dim={d} is not a dimension of the "
                    f"output (ids of shape {tuple(ids.shape)} give {out_dims} dimensions)")
            scatter_dim = d % out_dims
            if scatter_dim == ids.dim():
                return self._features_block(ids)
            if ids.shape[scatter_dim] % self.world_size:
                raise ValueError(
                    f"tpx.VocabParallelEmbedding: with sequence_parallel=True the sequence "
                    f"dimension (dim {scatter_dim}, size {ids.shape[scatter_dim]}) must divide by "
                    f"the group size {self.world_size}; pad the sequence.")
        weight, = local_params(self.weight)
        return ops.vocab_parallel_embedding(weight, ids.long(), self.vocab_start, self.group,
                                            scatter_dim, self._local_padding_idx)

    def _features_block(self, ids: Tensor) -> Tensor:
        """``y S(-1)``: this rank's partial lookups, reduce-scattered along the features."""
        if self.embedding_dim % self.world_size:
            raise ValueError(
                f"tpx.VocabParallelEmbedding: an output sharded along the embedding dim needs "
                f"embedding_dim ({self.embedding_dim}) to divide by the group size "
                f"{self.world_size}; shard another output dim or use Replicate()")
        weight, = local_params(self.weight)
        rows = weight.shape[0]
        local = ids.long() - self.vocab_start
        held = (local >= 0) & (local < rows)
        if rows == 0:
            partial = weight.new_zeros((*ids.shape, self.embedding_dim)) + weight.sum() * 0
        else:
            pad = self._local_padding_idx
            partial = torch.nn.functional.embedding(local.clamp(0, rows - 1), weight,
                                                    padding_idx=pad if pad >= 0 else None)
            partial = partial * held.unsqueeze(-1).to(partial.dtype)
        return mappings.reduce_scatter_dim(partial, -1, self.group)

    def _check_ids(self, ids, weight: Tensor, values: bool = True) -> None:
        """Raises unless ``ids`` is an integer tensor on the table's device with (``values``)
        every id in ``[0, num_embeddings)`` (the value check without a host synchronisation:
        tpx.comm.checks)."""
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError("tpx.VocabParallelEmbedding: ids must be an integer Tensor")
        if ids.device != weight.device:
            raise ValueError(f"tpx.VocabParallelEmbedding: ids are on {ids.device} but the table "
                             f"is on {weight.device}")
        if values and ids.numel():  # one aminmax; no host synchronisation (tpx.comm.checks)
            n = self.num_embeddings

            def in_range():
                lo, hi = torch.aminmax(ids)
                return (lo >= 0) & (hi < n)

            def message():
                lo, hi = (int(v) for v in torch.aminmax(ids))
                return (f"tpx.VocabParallelEmbedding: id {lo if lo < 0 else hi} is outside the "
                        f"table [0, {n})")

            check_values(in_range, message)

    def _shards(self):
        """(parameter name, sharded dim, rows of the full table held by each rank)."""
        yield "weight", 0, [[shard_bounds(self.num_embeddings, r, self.world_size)]
                            for r in range(self.world_size)]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.vocab_start}:"
                f"{self.vocab_end}), padding_idx={self.padding_idx}, world_size={self.world_size}, "
                f"sequence_parallel={self.sequence_parallel}")


class ColumnParallelEmbedding(KeepsParamSharding, SharesGroupOnCopy, nn.Module):
    """``nn.Embedding`` with the columns of its table (the embedding dimension) sharded over
    ``group``: every rank looks up all ids in its ``[num_embeddings, embedding_dim / P]``
    block, so the forward needs no communication before the optional gather.

    Placement: ``ids R -> y S(-1)``; with ``gather_output=True`` (default, as PyTorch's
    ``ColwiseParallel`` with ``output_layouts=Replicate()``): ``ids R -> y R`` (all-gathered
    along the last dimension; its backward keeps this rank's columns, no communication).

    This rank holds columns ``tpx.shard_range(embedding_dim)`` (uneven splits allowed).
    ``padding_idx`` behaves as in ``nn.Embedding``. Initialised with ``nn.Embedding``'s
    distribution over the FULL table, then sliced; ``src_rank`` as in
    :class:`VocabParallelEmbedding` (default 0: rank 0's table, each rank receiving its columns).
    """

    _tpx_dtensor_params = True  # the table is a DTensor Shard(dim) parameter

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None, *, group: GroupLike = None,
                 gather_output: bool = True, device=None, dtype=None,
                 src_rank: Optional[int] = 0, _full_weight: Optional[Tensor] = None) -> None:
        super().__init__()
        padding_idx = _check_embedding_args("ColumnParallelEmbedding", num_embeddings,
                                            embedding_dim, padding_idx)
        self.group = resolve_group(group)
        self.world_size, self.rank = self.group.size(), torch.distributed.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.gather_output = padding_idx, bool(gather_output)
        self.dim_start, self.dim_end = shard_bounds(embedding_dim, self.rank, self.world_size)
        self.dim_sizes = shard_sizes(embedding_dim, self.world_size)
        self.weight = nn.Parameter(torch.empty(num_embeddings, self.dim_end - self.dim_start,
                                               device=device, dtype=dtype))
        self.src_rank = src_rank
        self._init_weight(_full_weight)

    def _init_weight(self, full_weight: Optional[Tensor]) -> None:
        ranges = [[shard_bounds(self.embedding_dim, r, self.world_size)]
                  for r in range(self.world_size)]
        load_initial(self.group, "ColumnParallelEmbedding", dict(
            num_embeddings=self.num_embeddings, embedding_dim=self.embedding_dim,
            padding_idx=self.padding_idx, gather_output=self.gather_output,
            dtype=str(self.weight.dtype)),
            [ShardSpec(local_of(self.weight), ranges, 1)],
            lambda: [full_weight if full_weight is not None else _full_embedding_init(
                self.num_embeddings, self.embedding_dim, self.padding_idx,
                self.weight.device, self.weight.dtype)],
            src_rank=self.src_rank, drawn=full_weight is None)
        describe_params(self)  # each parameter knows its layout (tpx.layout.sharding)

    def reset_parameters(self) -> None:
        """Draws the full table as ``nn.Embedding`` does and gives every rank its columns
        (from rank ``src_rank``, or each rank's own draw when it is ``None``). A collective:
        call it on every rank of the group."""
        self._init_weight(None)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: GroupLike = None, *,
                       src_rank: Optional[int] = 0, **kwargs) -> "ColumnParallelEmbedding":
        """Shards an ``nn.Embedding`` that every rank holds whole: every rank gets its columns
        of rank ``src_rank``'s table (``src_rank=None``: of its own table, no communication;
        ranks whose tables differ get a warning)."""
        return cls(group=group, src_rank=src_rank, **_embedding_kwargs(cls, embedding, kwargs),
                   **kwargs)

    @guarded
    def forward(self, ids: Tensor) -> Tensor:
        ids = local_input(ids, Replicate(), self.group, "ColumnParallelEmbedding")
        weight, = local_params(self.weight)
        y = torch.nn.functional.embedding(ids, weight, self.padding_idx)
        if self.gather_output:
            y = mappings.gather_last_dim(y, self.dim_sizes, self.dim_start, self.group)
        return y

    def _shards(self):
        """(parameter name, sharded dim, columns of the full table held by each rank)."""
        yield "weight", 1, [[shard_bounds(self.embedding_dim, r, self.world_size)]
                            for r in range(self.world_size)]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local columns {self.dim_start}:"
                f"{self.dim_end}), padding_idx={self.padding_idx}, world_size={self.world_size}, "
                f"gather_output={self.gather_output}")
