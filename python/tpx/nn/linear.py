"""Column- and row-parallel ``nn.Linear`` replacements.

A column layer holds a block of the weight's rows (output features), a row layer a block of
its columns (input features). Chained as column -> elementwise -> row (an MLP, attention's
QKV and output projections) they need one collective forward and one backward, and tpx
overlaps it with the GEMMs.

Placements (R = replicated, S(d) = sharded on dim d):

=================================  =======================================================
layer                              forward
=================================  =======================================================
ColumnParallelLinear               x R -> y S(-1)
  sequence_parallel=True           x S(sequence_dim) -> y S(-1)
  gather_output=True               ... -> y R
RowParallelLinear                  x S(-1) -> y R
  input_is_parallel=False          x R -> (split) -> y R
  sequence_parallel=True           x S(-1) -> y S(sequence_dim)
=================================  =======================================================
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import mappings
from .. import ops
from ..comm.guard import guarded
from ..ops.amp import autocast_casts
from ..comm.groups import GroupLike, resolve_group, shard_bounds, shard_sizes, SharesGroupOnCopy
from ..layout.initial import load_initial, ShardSpec
from ..layout.dtensor_io import Replicate, Shard, local_input
from ..layout.sharding import KeepsParamSharding, describe_params
from ..layout.param_dtensors import local_of, local_params, read_for_input_grad, watch_params
from .sources import check_source

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _default_chunks() -> int:
    return ops.default_chunks()


def _check_features(cls: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"tpx.{cls}: `{name}` must be a positive int; got {value!r}")


def _check_chunks(cls: str, chunks: Optional[int]) -> None:
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"tpx.{cls}: `chunks` must be None or an int >= 1; got {chunks!r}")


def full_linear_init(in_features: int, out_features: int, bias: bool, device, dtype
                      ) -> Tuple[Tensor, Optional[Tensor]]:
    """The full weight and bias drawn exactly as ``nn.Linear(in, out)`` draws them (same RNG
    calls, same order), so a seeded TP model and a seeded single-device model start equal."""
    w = torch.empty(out_features, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        b = torch.empty(out_features, device=device, dtype=dtype)
        nn.init.uniform_(b, -bound, bound)
    return w, b


def _check_in_cols(in_cols, in_features: int, world: int) -> List[Tuple[int, int]]:
    """``in_cols`` (per rank, the one range of input features it holds, in rank order and
    covering them all) checked, or ``tpx.shard_range``'s split when ``None``."""
    if in_cols is None:
        return [shard_bounds(in_features, r, world) for r in range(world)]
    cols = [(int(s), int(e)) for s, e in in_cols]
    if len(cols) != world or cols[0][0] != 0 or cols[-1][1] != in_features or any(
            e < s for s, e in cols) or any(cols[r][1] != cols[r + 1][0] for r in range(world - 1)):
        raise ValueError(f"tpx.RowParallelLinear: `in_cols` must give each of the {world} ranks "
                         f"one range of the {in_features} input features, in rank order, "
                         f"together covering them once; got {cols}")
    return cols


def _check_out_rows(out_rows, out_features: int, world: int
                    ) -> Tuple[List[List[Tuple[int, int]]], bool]:
    """Validates ``out_rows`` (per rank, the row ranges of the full weight it holds) and says
    whether some row is held by several ranks."""
    if len(out_rows) != world:
        raise ValueError(f"tpx.ColumnParallelLinear: `out_rows` must list the rows of each of "
                         f"the {world} ranks; got {len(out_rows)} entries")
    rows = [[(int(s), int(e)) for s, e in r] for r in out_rows]
    held = [0] * out_features
    for r, ranges in enumerate(rows):
        for s, e in ranges:
            if not 0 <= s <= e <= out_features:
                raise ValueError(f"tpx.ColumnParallelLinear: out_rows[{r}] has the range "
                                 f"({s}, {e}) outside [0, {out_features})")
            for i in range(s, e):
                held[i] += 1
    if min(held, default=1) == 0:
        raise ValueError("tpx.ColumnParallelLinear: `out_rows` leaves output feature "
                         f"{held.index(0)} on no rank")
    return rows, max(held, default=1) > 1


class _ParallelLinear(KeepsParamSharding, SharesGroupOnCopy, nn.Module):
    """Shared bookkeeping of the two layers: the group, the configuration check across ranks,
    input validation."""

    _tpx_dtensor_params = True  # parameters are DTensors where placements say the layout

    def _short_call(self, x: Tensor) -> Optional[Tensor]:
        """The layer's own short call (``_lean_forward``: the kernel without the op wrappers),
        where it applies: a plain tensor input to a layer whose ``_plain`` says it may;
        ``None`` otherwise, and the general path runs."""
        if self._plain and type(x) is Tensor:
            return self._lean_forward(x)
        return None

    def _setup_group(self, group: GroupLike) -> None:
        pg = resolve_group(group)
        self.group = pg
        self.world_size = pg.size()
        self.rank = dist.get_rank(pg)

    def _seq_dim(self, x: Tensor) -> int:
        d = self.sequence_dim
        if not -x.dim() <= d < x.dim() or d % x.dim() == x.dim() - 1:
            raise ValueError(
                f"tpx.{type(self).__name__}: sequence_dim={self.sequence_dim} does not name a "
                f"sequence dimension of an input of shape {tuple(x.shape)} (the last dimension "
                "holds the features); for [tokens, features] inputs pass sequence_dim=0.")
        return d % x.dim()

    def _check_input(self, x: Tensor, features: int, what: str) -> None:
        name = type(self).__name__
        if not isinstance(x, Tensor):
            raise TypeError(f"tpx.{name}: input must be a Tensor; got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != features:
            raise ValueError(f"tpx.{name}: input.shape[-1] must be {features} ({what}); got "
                             f"input of shape {tuple(x.shape)}")
        if x.dtype != self.weight.dtype and not autocast_casts(x, self.weight):
            raise ValueError(f"tpx.{name}: input dtype {x.dtype} differs from the weight dtype "
                             f"{self.weight.dtype}; cast the input, or the module with .to(dtype), "
                             f"or run the forward under torch.autocast")
        if x.device != self.weight.device:
            raise ValueError(f"tpx.{name}: input is on {x.device} but the weight is on "
                             f"{self.weight.device}; move one of them")

    def _fits(self, x: Tensor, weight: Tensor, features: int) -> bool:
        """The lean path's input check: ``x`` has ``features`` features and the weight's dtype
        and device; anything else goes through :meth:`_check_input` (its error)."""
        return (x.dim() >= 1 and x.shape[-1] == features and x.dtype == weight.dtype
                and x.device == weight.device)

    def reset_parameters(self) -> None:
        """Draws the full ``nn.Linear`` initialisation (same RNG calls as ``nn.Linear``) and
        gives every rank its shard: with ``src_rank`` set, rank ``src_rank`` draws and the
        others receive their shards from it; with ``src_rank=None`` every rank draws and keeps
        its part. A collective: call it on every rank of the group."""
        self._init_weights(None)

    @classmethod
    def _from_linear(cls, linear: nn.Linear, group: GroupLike, src_rank: Optional[int],
                     kwargs: dict):
        check_source(cls, "from_linear", linear, nn.Linear, kwargs, ("device", "dtype", "bias"))
        return cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                   group=group, device=linear.weight.device, dtype=linear.weight.dtype,
                   src_rank=src_rank, _full_weights=(linear.weight, linear.bias), **kwargs)

    def _init_weights(self, full_weights) -> None:
        """Fills the shards, from ``full_weights`` (``from_linear``: the full weight and bias)
        or from a fresh draw, as ``src_rank`` says, and checks the arguments across ranks."""
        def full_fn():
            if full_weights is not None:
                return full_weights[0], full_weights[1]
            return full_linear_init(self.in_features, self.out_features,
                                     self.bias is not None, self.weight.device,
                                     self.weight.dtype)

        specs = [ShardSpec(local_of(self.weight), *self._weight_layout())]
        if self.bias is not None:
            specs.append(ShardSpec(local_of(self.bias), *self._bias_layout()))
        load_initial(self.group, type(self).__name__, self._layer_config(), specs, full_fn,
                     src_rank=self.src_rank, drawn=full_weights is None)
        describe_params(self)  # each parameter knows its layout (tpx.layout.sharding)

    def _config(self, **config) -> dict:
        # chunks decides how many collectives run, so it must agree too.
        return dict(config, in_features=self.in_features, out_features=self.out_features,
                    bias=self.bias is not None, sequence_parallel=self.sequence_parallel,
                    sequence_dim=self.sequence_dim, chunks=self.chunks,
                    default_chunks=_default_chunks(), dtype=str(self.weight.dtype))


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split by rows (output features) over ``group``.

    Placement: ``x R -> y S(-1)``; with ``sequence_parallel=True``: ``x S(sequence_dim) ->
    y S(-1)`` (the all-gather of ``x`` is overlapped with the GEMM); with
    ``gather_output=True`` the output is all-gathered to ``y R``.

    This rank holds ``weight[out_start:out_end]`` (``tpx.shard_range(out_features)``);
    ``out_features`` need not divide by the group size (an LM head of 50257 at TP 4).
    Parameters are initialised with ``nn.Linear``'s distribution over the FULL matrix and then
    sliced: by default rank ``src_rank`` (0) draws it and every rank receives its shard, so the
    layer equals rank 0's ``nn.Linear`` whatever the other ranks' seeds (and, with the same
    seed on every rank, equals ``nn.Linear`` built after that seed on one device).

    Backward: without sequence parallelism the input-gradient all-reduce is issued before the
    weight-gradient GEMM and waited after it; with it, the input gradient is reduce-scattered
    while the weight gradient is computed. Note that with sequence parallelism the gathered
    input is kept for the backward pass.

    Args:
        in_features, out_features, bias: as in ``nn.Linear`` (full sizes).
        group: ``None`` (default group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        gather_output: all-gather the output to every rank.
        sequence_parallel: the input is sharded along ``sequence_dim``.
        sequence_dim: the sequence dimension of the input (1 for ``[batch, seq, hidden]``,
            0 for ``[seq, batch, hidden]`` or ``[tokens, hidden]``).
        chunks: pipeline depth of the overlapped collectives (``1``: no overlap).
        device, dtype: as in ``nn.Linear``.
        out_rows: for each rank, the ``(start, end)`` row ranges of the full weight it holds,
            concatenated in that order (default: ``shard_range(out_features)``). Used for
            fused projections whose segments are split separately (a fused QKV: each rank
            holds its block of q, of k and of v) and for rows held by several ranks (KV heads
            replicated when there are fewer than ranks: their weight gradients are summed over
            the ranks that hold them). Not combinable with ``gather_output``.
        src_rank: the rank of ``group`` whose initial weights every rank takes (default 0,
            as PyTorch's ``src_data_rank``): it draws the full matrix and sends each rank its
            shard, in steps of bounded size (``TPX_INIT_CHUNK_BYTES``), so it holds one full
            matrix and the others one shard. ``None``: every rank draws the full matrix and
            keeps its shard, with no communication of weights; the ranks must then be seeded
            alike (``torch.manual_seed``), which is checked with a checksum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: GroupLike = None, gather_output: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 chunks: Optional[int] = None, device=None, dtype=None,
                 out_rows: Optional[Sequence[Sequence[Tuple[int, int]]]] = None,
                 src_rank: Optional[int] = 0, _full_weights=None) -> None:
        super().__init__()
        _check_features("ColumnParallelLinear", in_features=in_features,
                        out_features=out_features)
        _check_chunks("ColumnParallelLinear", chunks)
        self._setup_group(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = bool(gather_output), bool(sequence_parallel)
        self.sequence_dim, self.chunks = sequence_dim, chunks
        if out_rows is None:
            self.out_start, self.out_end = shard_bounds(out_features, self.rank, self.world_size)
            self.out_sizes = shard_sizes(out_features, self.world_size)
            self.out_rows = [[shard_bounds(out_features, r, self.world_size)]
                             for r in range(self.world_size)]
            self.replicated_rows = False
        else:
            self.out_rows, self.replicated_rows = _check_out_rows(
                out_rows, out_features, self.world_size)
            if gather_output:
                raise ValueError("tpx.ColumnParallelLinear: gather_output=True needs the default "
                                 "contiguous split of the output features, not `out_rows`")
            self.out_sizes = [sum(e - s for s, e in rows) for rows in self.out_rows]
            self.out_start = None
            self.out_end = None
        local = self.out_sizes[self.rank]
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(local, **factory)) if bias else None
        self.src_rank = src_rank
        self._init_weights(_full_weights)

    @property
    def _plain(self) -> bool:
        """Whether the layer's forward is one operator on this rank's input as it comes (no
        sequence shards to gather first): :meth:`_lean_forward` applies."""
        return not self.sequence_parallel

    def _lean_forward(self, x: Tensor) -> Optional[Tensor]:
        """The common call of a plain input, or ``None`` for :meth:`forward`'s general path:
        without gradients the GEMM alone; in training one autograd node on the parameters
        (then the gather of ``gather_output``)."""
        weight, bias = self.weight, self.bias
        mode = ops.lean_mode(x, weight, bias)
        w = local_of(weight)
        if not mode or not self._fits(x, w, self.in_features):
            return None
        if mode == ops.PLAIN:
            y = ops.plain_linear(x, w, local_of(bias), ops.plain_group_name(self.group),
                                 self.chunks)
        elif self.replicated_rows or mappings.partial_grad_input(x, self.group) is not None:
            return None
        else:
            y = ops.linear_on_params("replicated_matmul", x, weight, bias,
                                     ops.plain_group_name(self.group), self.chunks)
        if self.gather_output:
            y = mappings.gather_last_dim(y, self.out_sizes, self.out_start, self.group)
        return y

    def _layer_config(self) -> dict:
        return self._config(gather_output=self.gather_output,
                            out_rows=[list(map(list, rows)) for rows in self.out_rows])

    def _weight_layout(self):
        return self.out_rows, 0

    def _bias_layout(self):
        return self.out_rows, 0

    def _shards(self):
        """(parameter name, sharded dim, rows of the full tensor held by each rank)."""
        yield "weight", 0, self.out_rows
        if self.bias is not None:
            yield "bias", 0, self.out_rows

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: GroupLike = None, *,
                    src_rank: Optional[int] = 0, **kwargs) -> "ColumnParallelLinear":
        """Shards an ``nn.Linear`` that every rank holds whole: every rank gets rows
        ``shard_range(out_features)`` of the weight and bias of rank ``src_rank``'s layer (the
        other ranks' layers are not read; they need the same sizes). With ``src_rank=None``
        each rank keeps its rows of its own layer, with no communication of weights (ranks
        whose layers differ get a warning). ``kwargs`` are the keyword
        arguments of the constructor (``gather_output``, ``sequence_parallel``, ...)."""
        return cls._from_linear(linear, group, src_rank, kwargs)

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        y = self._short_call(x)
        if y is not None:
            return y
        # A DTensor input is redistributed to R (S(sequence_dim) with sequence parallelism).
        x = local_input(x, Shard(self.sequence_dim) if self.sequence_parallel else Replicate(),
                        self.group, "ColumnParallelLinear")
        self._check_input(x, self.in_features, "in_features")
        twin = None if self.sequence_parallel else mappings.partial_grad_input(x, self.group)
        if (twin is None and not self.sequence_parallel and not self.replicated_rows
                and ops.params_path(self.weight, self.bias)):
            # the common training call: the operator takes the DTensor parameters itself
            y = ops.replicated_matmul(x, None, self.group, self.chunks, bias=self.bias,
                                      weight=self.weight)
            if self.gather_output:
                y = mappings.gather_last_dim(y, self.out_sizes, self.out_start, self.group)
            return y
        weight, bias = self._row_params(self.weight, self.bias)
        w_t = weight.t()
        if self.sequence_parallel:
            _, y = ops.all_gather_matmul(x, w_t, self._seq_dim(x), self.group, self.chunks,
                                         bias=bias, return_gathered=False)
        elif twin is not None:
            # x was gathered from sequence shards by a plan style: the partial input gradient
            # is left unreduced, summed with those of the other column layers reading x, and
            # reduce-scattered once (tpx.mappings.gather_dim_for_partial_grads).
            y = F.linear(twin, weight, bias)
        else:
            y = ops.replicated_matmul(x, w_t, self.group, self.chunks, bias=bias)
        y = watch_params(y, self.weight, read=read_for_input_grad(x, self.weight))
        if self.gather_output:
            y = mappings.gather_last_dim(y, self.out_sizes, self.out_start, self.group)
        return y

    def _row_params(self, *params):
        """The local tensors of ``params`` (this layer's weight and bias, or tensors split by
        the same rows, as a LoRA factor), computed with: where rows are held by several ranks
        (replicated KV heads) each holder saw only its own query heads, so their gradients are
        summed over the holders."""
        local = local_params(*params)
        if not self.replicated_rows:
            return local
        return tuple(None if t is None else
                     mappings.sum_grad_over_holders(t, self.out_rows, self.group)
                     for t in local)

    def extra_repr(self) -> str:
        rows = ", ".join(f"{s}:{e}" for s, e in self.out_rows[self.rank])
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {rows}), bias={self.bias is not None}, "
                f"world_size={self.world_size}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, chunks={self.chunks}")


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with ``W`` split by columns (input features) over ``group``.

    Placement: ``x S(-1) -> y R`` (the partial products are all-reduced, overlapped with the
    GEMM); with ``sequence_parallel=True``: ``x S(-1) -> y S(sequence_dim)`` (reduce-scattered
    instead); with ``reduce_output=False``: ``x S(-1) -> y P`` (this rank's partial sum, no
    communication; the bias is added on the group's first rank only, and its gradient, which
    a partial output's replicated gradient gives every rank alike, is full everywhere). With
    ``input_is_parallel=False`` the input is ``R`` and each rank keeps its columns of it first.

    This rank holds ``weight[:, in_start:in_end]`` (``tpx.shard_range(in_features)``;
    uneven splits are supported: the input shard must then have this rank's width, as a
    column layer with the same ``out_features`` produces). The bias is replicated: every
    rank holds all of it and, after backward, the same full gradient of it. The initial
    weights are those of rank ``src_rank`` (see :class:`ColumnParallelLinear`); the bias is
    broadcast from it.

    Args:
        in_features, out_features, bias: as in ``nn.Linear`` (full sizes).
        group: ``None`` (default group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        input_is_parallel: the input already holds this rank's columns (``S(-1)``).
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` (its size must
            divide by the group size).
        sequence_dim: the sequence dimension of the input/output.
        reduce_output: ``False`` leaves the output as this rank's partial sum (``Partial()``),
            for a consumer that sums it later (e.g. with other partial sums, in one
            collective).
        chunks: pipeline depth of the overlapped collectives (``1``: no overlap).
        device, dtype: as in ``nn.Linear``.
        src_rank: the rank whose initial weights every rank takes (default 0); ``None``: every
            rank draws and keeps its part (ranks seeded alike, checked), no communication.
        in_cols: for each rank, the ``(start, end)`` range of input features it holds (in
            rank order, covering them once); default ``tpx.shard_range``'s split. Attention
            whose heads do not divide the TP size holds whole heads:
            ``tpx.parallel.RowwiseParallel(head_size=..., heads=...)`` gives them.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: GroupLike = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 reduce_output: bool = True,
                 chunks: Optional[int] = None, device=None, dtype=None,
                 src_rank: Optional[int] = 0,
                 in_cols: Optional[Sequence[Tuple[int, int]]] = None, _full_weights=None) -> None:
        super().__init__()
        _check_features("RowParallelLinear", in_features=in_features, out_features=out_features)
        _check_chunks("RowParallelLinear", chunks)
        if sequence_parallel and not reduce_output:
            raise ValueError("tpx.RowParallelLinear: sequence_parallel=True reduce-scatters the "
                             "output, reduce_output=False leaves it unreduced: pass one of them")
        self._setup_group(group)
        self.in_features, self.out_features = in_features, out_features
        self.reduce_output = bool(reduce_output)
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim, self.chunks = sequence_dim, chunks
        self.in_cols = _check_in_cols(in_cols, in_features, self.world_size)
        self.in_start, self.in_end = self.in_cols[self.rank]
        self.in_sizes = [e - s for s, e in self.in_cols]
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.empty(out_features, self.in_end - self.in_start, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.src_rank = src_rank
        self._init_weights(_full_weights)

    @property
    def _plain(self) -> bool:
        """Whether the layer's forward is one operator on this rank's columns as they come (no
        split of a replicated input, a reduced output): :meth:`_lean_forward` applies."""
        return self.input_is_parallel and self.reduce_output and not self.sequence_parallel

    def _lean_forward(self, x: Tensor) -> Optional[Tensor]:
        """The common call of a plain input, or ``None`` for :meth:`forward`'s general path:
        without gradients the operator alone (at world size 1 the GEMM alone); in training
        one autograd node on the parameters."""
        weight, bias = self.weight, self.bias
        mode = ops.lean_mode(x, weight, bias)
        w = local_of(weight)
        if not mode or not self._fits(x, w, self.in_end - self.in_start):
            return None
        name = ops.plain_group_name(self.group)
        if mode == ops.PLAIN:
            plain = ops.plain_linear if self.world_size == 1 else ops.plain_linear_all_reduce
            return plain(x, w, local_of(bias), name, self.chunks)
        return ops.linear_on_params("matmul_all_reduce", x, weight, bias, name, self.chunks)

    def _layer_config(self) -> dict:
        return self._config(input_is_parallel=self.input_is_parallel,
                            reduce_output=self.reduce_output,
                            in_cols=[list(c) for c in self.in_cols])

    def _weight_layout(self):
        return [[c] for c in self.in_cols], 1

    def _bias_layout(self):
        return None, 0  # replicated

    def _shards(self):
        """(parameter name, sharded dim, columns of the full weight held by each rank)."""
        yield "weight", 1, [[c] for c in self.in_cols]

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: GroupLike = None, *,
                    src_rank: Optional[int] = 0, **kwargs) -> "RowParallelLinear":
        """Shards an ``nn.Linear`` that every rank holds whole: every rank gets columns
        ``shard_range(in_features)`` of the weight, and all of the bias, of rank
        ``src_rank``'s layer. With ``src_rank=None`` each rank keeps its part of its own layer
        (no communication of weights; ranks whose layers differ get a warning)."""
        return cls._from_linear(linear, group, src_rank, kwargs)

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        y = self._short_call(x)
        if y is not None:
            return y
        x = self._local_columns(x, "RowParallelLinear")
        if (not self.sequence_parallel and self.reduce_output
                and ops.params_path(self.weight, self.bias)):
            # the common training call: the operator takes the DTensor parameters itself
            return ops.matmul_all_reduce(x, None, self.group, self.chunks, bias=self.bias,
                                         weight=self.weight)
        weight, bias = local_params(self.weight, self.bias)
        w_t = weight.t()
        if self.sequence_parallel:
            d = self._scatter_dim(x)
            y = ops.matmul_reduce_scatter(x, w_t, d, self.group, self.chunks, bias=bias)
        elif not self.reduce_output:
            y = self._partial_output(torch.matmul(x, w_t), bias)
        else:
            y = ops.matmul_all_reduce(x, w_t, self.group, self.chunks, bias=bias)
        return watch_params(y, self.weight, read=read_for_input_grad(x, self.weight))

    def _partial_output(self, y: Tensor, bias: Optional[Tensor]) -> Tensor:
        """``y`` (this rank's partial sum) with the replicated bias counted once over the group:
        added on its first rank, its gradient whole on every rank."""
        if bias is None:
            return y
        return y + mappings.scale_forward(bias, 1.0 if self.rank == 0 else 0.0)

    def _local_columns(self, x: Tensor, who: str) -> Tensor:
        """This rank's columns of the input: a ``DTensor`` redistributed to ``S(-1)`` (``R``
        with ``input_is_parallel=False``) and made local, checked, and split when the input is
        replicated."""
        x = local_input(x, Shard(-1) if self.input_is_parallel else Replicate(), self.group,
                        who)
        if self.input_is_parallel:
            self._check_input(x, self.in_end - self.in_start,
                              f"this rank's columns {self.in_start}:{self.in_end} of "
                              f"in_features={self.in_features}")
            return x
        self._check_input(x, self.in_features, "in_features")
        return mappings.split_last_dim(x, self.in_sizes, self.in_start, self.group)

    def _scatter_dim(self, x: Tensor) -> int:
        """The sequence dimension the output is reduce-scattered along (its size must divide
        by the group size)."""
        d = self._seq_dim(x)
        if x.shape[d] % self.world_size:
            raise ValueError(
                f"tpx.RowParallelLinear: with sequence_parallel=True the sequence dimension "
                f"(dim {d}, size {x.shape[d]}) must divide by the group size "
                f"{self.world_size}; pad the sequence to a multiple of {self.world_size}.")
        return d

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_start}:{self.in_end}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"world_size={self.world_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, "
                f"reduce_output={self.reduce_output}, chunks={self.chunks}")
