"""Parallel styles: how one module of a plan is sharded, with PyTorch's names and placements.

Placements of plain tensors at a module boundary: ``Replicate()`` (R, the full tensor on
every rank) and ``Shard(dim)`` (S(dim), this rank's block of ``dim``). A replicated tensor
carries the same full gradient on every rank.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch.distributed as dist
from torch import Tensor, nn

from ..comm.groups import copied_with_module, head_rows, head_split, shard_bounds
from ..nn import (
    ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
from ..layout.dtensor_io import DTensor, Partial, Replicate, Shard, wrap_output
from ..layout.param_dtensors import compute_on_locals, replicate_params
from ..layout.sharding import mark_transposed_weight
from .base import (
    ParallelStyle, TPContext, apply_style, apply_with_pytorch, check_placement, is_style,
    redistribute, torch_style)
from .module_styles import (
    NoParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput,
    ReplicatedWithGradAllReduce, ShardedAttention)

__all__ = ["Replicate", "Shard", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
           "SequenceParallel", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "ShardedAttention",
           "NoParallel", "ReplicatedWithGradAllReduce", "apply_style", "is_style", "torch_style"]


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is stored ``[in, out]``."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
            and getattr(module, "weight", None) is not None
            and tuple(module.weight.shape) == (module.nx, module.nf))


def is_peft_layer(module: nn.Module) -> bool:
    """A layer one of peft's tuners put in place of a model's module (read without importing
    peft)."""
    return any(c.__module__.split(".")[0] == "peft" for c in type(module).__mro__)


def _shard_peft_layer(style: "ParallelStyle", module: nn.Module, ctx: TPContext) -> nn.Module:
    """The column or row style applied to a peft layer (LoRA on the projection it names): the
    base layer sharded by the style, the adapters with it (:mod:`tpx.nn.lora`)."""
    import copy

    from ..nn.lora import shard_lora_layer

    local = copy.copy(style)
    local.use_local_output = True
    new = shard_lora_layer(local, module, ctx)
    pg = ctx.group
    if not style.use_local_output:
        if isinstance(style, ColwiseParallel):
            base = new.base_layer
            if base.out_rows != [[shard_bounds(base.out_features, r, pg.size())]
                                 for r in range(pg.size())]:
                raise ValueError("tpx.ColwiseParallel: use_local_output=False needs the "
                                 "contiguous split of the output features that Shard(-1) "
                                 "describes (keep use_local_output=True)")
            style._wrap(new, pg, base.out_features)
        else:
            style._wrap(new, pg)
    return new


def _check_plain(module: nn.Module, base: type, style: str) -> None:
    """A subclass with its own ``forward`` would lose it when tpx's layer takes its place."""
    if type(module).forward is not base.forward and not _plain_equivalent(module):
        raise ValueError(
            f"tpx.{style}: {type(module).__name__} subclasses {base.__name__} with its own "
            f"forward; tpx replaces the module by a sharded {base.__name__}, which would drop that "
            "forward. Shard a plain nn.Linear / nn.Embedding, or write a style for this module")
    if isinstance(module, nn.Embedding) and (
            tuple(module.weight.shape) != (module.num_embeddings, module.embedding_dim)):
        raise ValueError(
            f"tpx.{style}: the weight of this nn.Embedding has the shape "
            f"{tuple(module.weight.shape)}, not (num_embeddings, embedding_dim) = "
            f"{(module.num_embeddings, module.embedding_dim)}: it was sharded already (a "
            "parameter tied to one an earlier parallelize_module call sharded?). Tie "
            "parameters again after both modules are parallelized")


def _linear_parts(style: str, module: nn.Module):
    """(in_features, out_features, weight [out, in], bias, transposed) of an ``nn.Linear`` or a
    Hugging Face ``Conv1D``."""
    if isinstance(module, nn.Linear):
        _check_plain(module, nn.Linear, style)
        if tuple(module.weight.shape) != (module.out_features, module.in_features):
            raise ValueError(
                f"tpx.{style}: the weight of this nn.Linear has the shape "
                f"{tuple(module.weight.shape)}, not (out_features, in_features) = "
                f"{(module.out_features, module.in_features)}: it was sharded already (a "
                "parameter tied to one an earlier parallelize_module call sharded?). Tie "
                "parameters again after both modules are parallelized")
        return module.in_features, module.out_features, module.weight, module.bias, False
    if is_conv1d(module):
        return module.nx, module.nf, module.weight.t(), module.bias, True
    raise ValueError(f"tpx.{style} applies to nn.Linear, Hugging Face Conv1D or nn.Embedding; "
                     f"got {type(module).__name__}")


def _plain_equivalent(module: nn.Module) -> bool:
    """A subclass whose own forward a derived plan found to compute ``F.linear`` (Falcon's
    ``FalconLinear``); marked by the derived plan's styles as they replace it."""
    return getattr(module, "_tpx_plain_equivalent", False)


def _own_forward_linear(module: nn.Module) -> bool:
    return (isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
            and not _plain_equivalent(module))


def _linear_with_pytorch(name: str, torch_style, module: nn.Module, ctx: TPContext,
                         sharded_rows: bool) -> nn.Module:
    """A subclass of ``nn.Linear`` with a forward of its own (an LM head that scales its
    logits): tpx's layer would drop that forward, so PyTorch's style of the same name shards
    the module itself and its forward runs on ``DTensor`` s. PyTorch's column style splits
    every parameter by its first dimension, which is right only for parameters with one row
    per output feature (``sharded_rows``); its row style splits the weight and keeps the bias
    whole, and leaves any other parameter plain (refused: the forward would mix it with
    ``DTensor`` s)."""
    extra = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)
             if n not in ("weight", "bias")}
    bad = {n: sh for n, sh in extra.items()
           if not sharded_rows or not sh or sh[0] != module.out_features}
    if bad or any(True for _ in module.children()):
        raise ValueError(
            f"tpx.{name}: {type(module).__name__} subclasses Linear with its own forward; "
            "tpx's sharded Linear would drop that forward, and PyTorch's style, which keeps it, "
            f"cannot split its parameters {bad or extra} (or its submodules) with the weight. "
            "Shard a plain nn.Linear, or write a style for this module")
    if hasattr(torch_style, "src_data_rank"):
        torch_style.src_data_rank = ctx.src_rank
    in_features = module.in_features
    out = apply_with_pytorch(torch_style, module, ctx)
    layout = getattr(torch_style, "input_layouts", None)
    layout = layout[0] if isinstance(layout, tuple) and len(layout) == 1 else layout
    if not sharded_rows and isinstance(layout, Shard):
        # PyTorch's row style takes a plain input as an even split (its global size: the
        # local one times the group size); with in_features that do not divide, the blocks
        # are torch.chunk's (tpx.shard_range), so the input is given its global shape first.
        def global_input(mod, args):
            x = args[0] if args else None
            if not isinstance(x, Tensor) or isinstance(x, DTensor):
                return None
            shape = list(x.shape)
            shape[layout.dim % x.dim()] = in_features
            return (wrap_output(x, layout, ctx.group, shape, ctx.mesh), *args[1:])

        out.register_forward_pre_hook(copied_with_module(global_input), prepend=True)
    return out


class ColwiseParallel(ParallelStyle):
    """``nn.Linear`` (or Hugging Face ``Conv1D``) -> :class:`tpx.ColumnParallelLinear` (weight
    rows = output features sharded); ``nn.Embedding`` -> :class:`tpx.ColumnParallelEmbedding`
    (embedding dim sharded).

    ``input_layouts``: ``Replicate()`` (default) or ``Shard(d)`` (sequence parallel input,
    gathered inside the GEMM); ``output_layouts``: ``Shard(-1)`` (default) or ``Replicate()``
    (gathered). ``chunks`` is the pipeline depth of the overlapped collectives.

    tpx extensions for attention projections:
        segments: sizes of the concatenated parts of a fused projection (GPT-2's ``c_attn``
            is ``[q | k | v]``: ``segments=(d, d, d)``); each part is split separately, so
            every rank holds its block of q, of k and of v.
        head_size: split in whole heads of this size; heads that do not divide by the TP
            size are an error.
        replicate_heads: a part with fewer heads than ranks (GQA's KV heads) is replicated so
            that rank ``r`` holds head ``r * heads // P``, the one its query heads use
            (needs P to be a multiple of the head count).
        heads: ``(query heads, KV heads)`` of the attention this projection feeds: a part of
            that many heads is split as ``tpx.comm.groups.head_split`` deals them, so that
            heads that do not divide by the TP size are split in blocks that differ by one
            head (12 at TP 8: 2,2,2,2,1,1,1,1), each rank's query heads with the KV heads they
            read; where the counts divide, the same split as without it.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 chunks: Optional[int] = None, segments: Optional[Sequence[int]] = None,
                 head_size: Optional[int] = None, replicate_heads: bool = False,
                 heads: Optional[Tuple[int, int]] = None) -> None:
        check_placement("ColwiseParallel", "input_layouts", input_layouts, (Replicate, Shard))
        check_placement("ColwiseParallel", "output_layouts", output_layouts, (Replicate, Shard))
        if isinstance(output_layouts, Shard) and output_layouts.dim != -1:
            raise ValueError("tpx.ColwiseParallel: output_layouts must be Shard(-1) or Replicate()")
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Shard(-1)
        self.use_local_output = bool(use_local_output)
        self.chunks = chunks
        self.segments = tuple(segments) if segments is not None else None
        self.head_size, self.replicate_heads = head_size, bool(replicate_heads)
        self.heads = tuple(heads) if heads is not None else None

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg, src_rank = ctx.group, ctx.src_rank
        if is_peft_layer(module):
            return _shard_peft_layer(self, module, ctx)
        sp = isinstance(self.input_layouts, Shard)
        gather = isinstance(self.output_layouts, Replicate)
        if isinstance(module, nn.Embedding):
            if sp:
                raise ValueError("tpx.ColwiseParallel: an nn.Embedding takes Replicate() ids")
            _check_plain(module, nn.Embedding, "ColwiseParallel")
            new = ColumnParallelEmbedding.from_embedding(module, group=pg, gather_output=gather,
                                                         src_rank=src_rank)
            return self._wrap(new, pg, module.embedding_dim)
        if _own_forward_linear(module) and self._plain_split():
            from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise

            return _linear_with_pytorch("ColwiseParallel", TorchColwise(
                input_layouts=self.input_layouts, output_layouts=self.output_layouts,
                use_local_output=self.use_local_output), module, ctx, True)
        in_f, out_f, weight, bias, transposed = _linear_parts("ColwiseParallel", module)
        rows = self._out_rows(out_f, pg.size())
        default = [[shard_bounds(out_f, r, pg.size())] for r in range(pg.size())]
        out_rows = None if rows is None or rows == default else rows
        new = ColumnParallelLinear(
            in_f, out_f, bias=bias is not None, group=pg, gather_output=gather,
            sequence_parallel=sp, sequence_dim=self.input_layouts.dim if sp else 1,
            chunks=self.chunks, device=weight.device, dtype=weight.dtype, out_rows=out_rows,
            src_rank=src_rank, _full_weights=(weight, bias))
        if transposed:
            mark_transposed_weight(new)
        return self._wrap(new, pg, out_f)

    def _plain_split(self) -> bool:
        return self.segments is None and self.head_size is None

    def _out_rows(self, out_f: int, world: int):
        """Per rank, the row ranges of the weight it holds; ``None`` for the contiguous split."""
        if self.segments is None and self.head_size is None:
            return None
        segments = self.segments or (out_f,)
        if sum(segments) != out_f:
            raise ValueError(f"tpx.ColwiseParallel: segments={segments} add up to "
                             f"{sum(segments)}, but the layer has {out_f} output features")
        return head_rows(segments, self.head_size, self.replicate_heads, world, self.heads)

    def _wrap(self, new: nn.Module, pg: dist.ProcessGroup, features: int) -> nn.Module:
        """With ``use_local_output=False`` the output leaves as a ``DTensor`` (from_local, no
        communication): ``Shard(-1)`` over ``features`` or ``Replicate()``."""
        if self.use_local_output:
            return new
        if getattr(new, "out_rows", None) is not None and (
                new.out_rows != [[shard_bounds(features, r, pg.size())] for r in range(pg.size())]):
            raise ValueError("tpx.ColwiseParallel: use_local_output=False needs the contiguous "
                             "split of the output features that Shard(-1) describes; a split by "
                             "segments or replicated heads has no DTensor placement (keep "
                             "use_local_output=True)")
        placement = self.output_layouts

        def hook(mod, args, y):
            shape = list(y.shape)
            if isinstance(placement, Shard):
                shape[-1] = features
            return wrap_output(y, placement, pg, shape)

        new.register_forward_hook(copied_with_module(hook))
        return new

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("segments", self.segments),
                                                    ("head_size", self.head_size),
                                                    ("heads", self.heads))
                        if v is not None)
        if self.replicate_heads:
            extra += ", replicate_heads=True"
        return (f"ColwiseParallel(input_layouts={self.input_layouts}, "
                f"output_layouts={self.output_layouts}{extra})")


class RowwiseParallel(ParallelStyle):
    """``nn.Linear`` -> :class:`tpx.RowParallelLinear` (weight columns sharded);
    ``nn.Embedding`` -> :class:`tpx.VocabParallelEmbedding` (table rows sharded).

    Linear: ``input_layouts`` ``Shard(-1)`` (default) or ``Replicate()``; ``output_layouts``
    ``Replicate()`` (default, all-reduced), ``Shard(d)`` (reduce-scattered along the
    sequence) or ``Partial()`` (this rank's partial sum, no communication: a local tensor, or a
    ``Partial()`` ``DTensor`` with ``use_local_output=False``). Embedding: input
    ``Replicate()``; output ``Replicate()`` or ``Shard(d)``.

    ``head_size`` and ``heads`` (``(query heads, KV heads)``): the output projection of
    attention, its input features the query heads' outputs; each rank holds the columns of
    the query heads ``ColwiseParallel(heads=...)`` gives it (whole heads where they do not
    divide by the TP size). A layer whose heads are wider than ``head_size`` (Gemma 4's
    global layers) is split by its own width, ``in_features / heads[0]``.
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 chunks: Optional[int] = None, head_size: Optional[int] = None,
                 heads: Optional[Tuple[int, int]] = None) -> None:
        check_placement("RowwiseParallel", "input_layouts", input_layouts, (Replicate, Shard))
        check_placement("RowwiseParallel", "output_layouts", output_layouts,
                         (Replicate, Shard, Partial))
        if isinstance(output_layouts, Partial) and output_layouts.reduce_op != "sum":
            raise ValueError(f"tpx.RowwiseParallel: output_layouts={output_layouts!r}: a row-"
                             "parallel layer's partial results add up; use Partial() "
                             "(reduce_op 'sum')")
        self.input_layouts, self.output_layouts = input_layouts, output_layouts or Replicate()
        self.use_local_output = bool(use_local_output)
        self.chunks = chunks
        if (head_size is None) != (heads is None):
            raise ValueError("tpx.RowwiseParallel: pass head_size and heads together (the "
                             "attention's head width and its (query heads, KV heads))")
        self.head_size, self.heads = head_size, tuple(heads) if heads is not None else None

    def _in_cols(self, in_f: int, world: int):
        """Per rank, the input features it holds; ``None`` for ``tpx.shard_range``'s split."""
        if self.heads is None:
            return None
        if in_f % self.heads[0]:
            raise ValueError(f"tpx.RowwiseParallel: {in_f} input features are not "
                             f"{self.heads[0]} query heads of one width")
        size = in_f // self.heads[0]  # head_size, or a layer's own (Gemma 4's differ)
        split = head_split(self.heads[0], self.heads[1], world)
        cols = [(s * size, e * size) for (s, e), _ in split]
        return None if cols == [shard_bounds(in_f, r, world) for r in range(world)] else cols

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg, src_rank = ctx.group, ctx.src_rank
        partial = isinstance(self.output_layouts, Partial)
        if partial and (is_peft_layer(module) or isinstance(module, nn.Embedding)):
            raise ValueError(
                f"tpx.RowwiseParallel: output_layouts=Partial() is for a linear layer; "
                f"{type(module).__name__} takes Replicate() or Shard(d) outputs (reduce them, "
                "then pass the result on)")
        if is_peft_layer(module):
            return _shard_peft_layer(self, module, ctx)
        sp = isinstance(self.output_layouts, Shard)
        seq_dim = self.output_layouts.dim if sp else 1
        if isinstance(module, nn.Embedding):
            if self.input_layouts is not None and not isinstance(self.input_layouts, Replicate):
                raise ValueError("tpx.RowwiseParallel: an nn.Embedding takes Replicate() ids")
            _check_plain(module, nn.Embedding, "RowwiseParallel")
            new = VocabParallelEmbedding.from_embedding(module, group=pg, sequence_parallel=sp,
                                                        sequence_dim=seq_dim, src_rank=src_rank)
            return self._wrap(new, pg)
        if _own_forward_linear(module) and not partial:
            if self.heads is not None and _linear_parts("RowwiseParallel", module)[0] and \
                    self._in_cols(_linear_parts("RowwiseParallel", module)[0], pg.size()):
                raise ValueError(
                    f"tpx.RowwiseParallel: {type(module).__name__} has a forward of its own, "
                    "which tpx shards through PyTorch's RowwiseParallel (contiguous columns); "
                    f"its {self.heads[0]} heads do not divide by the TP size {pg.size()}: use a "
                    "TP size that divides them")
            from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

            return _linear_with_pytorch("RowwiseParallel", TorchRowwise(
                input_layouts=self.input_layouts, output_layouts=self.output_layouts,
                use_local_output=self.use_local_output), module, ctx, False)
        in_f, out_f, weight, bias, transposed = _linear_parts("RowwiseParallel", module)
        layout = self.input_layouts or Shard(-1)
        if isinstance(layout, Shard) and layout.dim != -1:
            raise ValueError("tpx.RowwiseParallel: input_layouts must be Shard(-1) or "
                             "Replicate() for a linear layer")
        new = RowParallelLinear(
            in_f, out_f, bias=bias is not None, group=pg,
            input_is_parallel=isinstance(layout, Shard), sequence_parallel=sp,
            sequence_dim=seq_dim, reduce_output=not partial, chunks=self.chunks,
            device=weight.device, dtype=weight.dtype, src_rank=src_rank,
            in_cols=self._in_cols(in_f, pg.size()), _full_weights=(weight, bias))
        if transposed:
            mark_transposed_weight(new)
        return self._wrap(new, pg)

    def _wrap(self, new: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        """With ``use_local_output=False`` the output leaves as a ``DTensor`` (from_local, no
        communication): ``Replicate()``, ``Shard(d)`` along the sequence or ``Partial()``."""
        if self.use_local_output:
            return new
        placement = self.output_layouts

        def hook(mod, args, y):
            shape = list(y.shape)
            if isinstance(placement, Shard):
                shape[placement.dim % y.dim()] *= pg.size()
            return wrap_output(y, placement, pg, shape)

        new.register_forward_hook(copied_with_module(hook))
        return new

    def __repr__(self) -> str:
        return f"RowwiseParallel(input_layouts={self.input_layouts}, output_layouts={self.output_layouts})"


class SequenceParallel(ParallelStyle):
    """A module that works row by row (LayerNorm, RMSNorm, dropout) run on this rank's block
    of the sequence: input and output ``Shard(sequence_dim)``, parameters replicated. Each
    rank sees only part of the sequence, so the gradients of the parameters are summed over
    the group in the backward of each call (one all-reduce per call, part of the autograd
    graph: FSDP2's unsharded parameters get them too): every rank ends with the full,
    identical gradient. (The swaps are forward hooks bound to this module: parallelize a copy
    rather than copying a parallelized model.)

    A plain tensor input is this rank's block; a ``DTensor`` input (any placement) is
    redistributed to ``Shard(sequence_dim)`` first. As PyTorch's, the output is a ``DTensor``
    ``Shard(sequence_dim)`` (its global shape: the input's, or a plain input's with the
    sequence ``world`` times as long), or this rank's block as a local tensor with
    ``use_local_output=True``. Unlike PyTorch, whose parameters get ``Partial`` gradients
    reduced in the optimizer step, tpx sums the parameters' gradients over the group in the
    backward pass: every rank holds the full gradient."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        linears = [n for n, m in module.named_modules()
                   if isinstance(m, nn.Linear) or is_conv1d(m)]
        if linears:
            raise ValueError(
                f"tpx.SequenceParallel applies to modules that work row by row (LayerNorm, "
                f"RMSNorm, dropout); {type(module).__name__} holds linear layers "
                f"({linears[:4]}). The older PyTorch SequenceParallel (a column/row pair with "
                "sequence-sharded input and output) is tpx.parallel.compat.SequenceParallel, or "
                "in the current API: ColwiseParallel(input_layouts=Shard(0)) on the first "
                "layer and RowwiseParallel(output_layouts=Shard(0)) on the second.")
        # The parameters become Replicate() DTensors, as PyTorch's style makes them (so
        # torch's clip_grad_norm_, foreach optimizers and DCP see one kind of parameter); the
        # module computes on their local tensors (swapped in for its forward only).
        owned = replicate_params(module, pg)
        seq = Shard(self.sequence_dim)
        want = bool(self.use_local_output)
        state = {}

        def pre(mod, args):
            # DTensor inputs (any placement) become this rank's block of the sequence.
            # A loop, not next(generator, None): dynamo of torch 2.5 cannot trace the latter.
            first = None
            for a in args:
                if isinstance(a, DTensor):
                    first = a
                    break
            state["shape"] = tuple(first.shape) if first is not None else None
            return tuple(redistribute(a, seq, seq, pg) for a in args)

        def post(mod, args, out):
            shape = state.pop("shape", None)
            if want or not isinstance(out, Tensor):
                return out
            if shape is not None and len(shape) == out.dim():
                return wrap_output(out, seq, pg, shape)
            return redistribute(out, seq, seq, pg, local=False)

        compute_on_locals(module, owned, sum_grads_over=pg)
        module.register_forward_pre_hook(copied_with_module(pre))
        module.register_forward_hook(copied_with_module(post))
        return module

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_dim}, "
                f"use_local_output={self.use_local_output})")
