"""Parallel styles: how one module of a plan is sharded, with PyTorch's names and placements.

Placements of plain tensors at a module boundary: ``Replicate()`` (R, the full tensor on
every rank) and ``Shard(dim)`` (S(dim), this rank's block of ``dim``). A replicated tensor
carries the same full gradient on every rank.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm_groups import guarded
from ..group import mesh_for_group, shard_bounds, shard_sizes
from ..nn import (ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear,
                  VocabParallelEmbedding)
from ..nn.dtensor_io import DTensor, Partial, Replicate, Shard, gathered_local, wrap_output

__all__ = ["Replicate", "Shard", "ParallelStyle", "ColwiseParallel", "RowwiseParallel",
           "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "ShardedAttention",
           "ReplicatedWithGradAllReduce", "apply_style", "is_style", "torch_style"]


def _check_placement(style: str, name: str, value, allowed: tuple) -> None:
    if value is None or isinstance(value, allowed):
        return
    names = [a.__name__ + ("(dim)" if a is Shard else "()") for a in allowed]
    if isinstance(value, Partial):
        raise ValueError(f"tpx.{style}: `{name}`={value!r}: a plain tensor of partial sums is not a "
                         f"layout this style takes (one of {names}); reduce it first, or pass "
                         "a DTensor with that placement (it is redistributed to what the layer "
                         "needs)")
    raise TypeError(f"tpx.{style}: `{name}` must be one of {names} (torch.distributed.tensor's "
                    f"placements, which tpx.Replicate / tpx.Shard are); got {value!r}")


@guarded
def redistribute(x, src, dst, pg: dist.ProcessGroup, *, local: bool = True):
    """Changes the placement of a tensor from ``src`` to ``dst`` (R <-> S(d)).

    A plain tensor is this rank's part of ``src``; a ``DTensor`` carries its own placement
    (``src`` is ignored) and is redistributed to ``dst``. The result is local, or a ``DTensor``
    with placement ``dst`` when ``local=False``."""
    if isinstance(x, DTensor):
        if dst is not None:
            d = Shard(dst.dim % x.dim()) if isinstance(dst, Shard) else dst
            if tuple(x.placements) != (d,):
                full = gathered_local(x, d, pg)  # S(k) -> R through tpx's counted gather
                if full is not None:
                    if local:
                        return full
                    out = wrap_output(full, d, pg, x.shape, x.device_mesh)
                    twin = getattr(full, "_tpx_partial_grad_input", None)
                    if twin is not None:  # for the column-parallel layers that read it
                        out._tpx_partial_grad_input = twin
                    return out
                x = x.redistribute(x.device_mesh, [d])
        return x.to_local() if local else x
    if not isinstance(x, Tensor):
        return x
    if isinstance(src, Partial) or isinstance(dst, Partial):
        raise ValueError(f"tpx: a plain tensor cannot be redistributed from {src} to {dst}; "
                         "partial sums are accepted as DTensor inputs only")
    y = x
    if not (src is None or dst is None or src == dst):
        world = pg.size()
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            d = dst.dim % x.dim()
            if x.shape[d] % world:
                # The way back (S(d) -> R below) and every rank's peers take a plain tensor's
                # shards as equal-sized: an uneven split would gather wrong sizes. The input is
                # replicated, so every rank raises here, before any collective.
                raise ValueError(
                    f"tpx: Replicate() -> Shard({dst.dim}) of a tensor of shape "
                    f"{tuple(x.shape)}: dim {d} (size {x.shape[d]}) does not divide by the "
                    f"group size {world}, and the shards of a plain tensor are equal-sized; pad "
                    f"dim {d} (the sequence) to a multiple of {world}")
            sizes = shard_sizes(x.shape[d], world)
            start, _ = shard_bounds(x.shape[d], dist.get_rank(pg), world)
            y = mappings.split_dim(x, d, sizes, start, pg)
        elif isinstance(src, Shard) and isinstance(dst, Replicate):
            d = src.dim % x.dim()
            # Shards of a plain tensor are equal-sized: the full size is local * world. The
            # column-parallel layers that read the result send their (partial) input
            # gradients back with one reduce-scatter of their sum.
            y = mappings.gather_dim_for_partial_grads(x, d, pg)
        else:
            raise ValueError(f"tpx: cannot redistribute a tensor from {src} to {dst}")
    if local:
        return y
    placement = dst if dst is not None else src
    if placement is None:
        return y
    shape = list(y.shape)
    if isinstance(placement, Shard):
        shape[placement.dim % y.dim()] *= pg.size()
    return wrap_output(y, placement, pg, shape)


def _is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a linear layer whose weight is stored ``[in, out]``."""
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")
            and getattr(module, "weight", None) is not None
            and tuple(module.weight.shape) == (module.nx, module.nf))


def is_peft_layer(module: nn.Module) -> bool:
    """A layer one of peft's tuners put in place of a model's module (read without importing
    peft)."""
    return any(c.__module__.split(".")[0] == "peft" for c in type(module).__mro__)


def _shard_peft_layer(style: "ParallelStyle", module: nn.Module, pg: dist.ProcessGroup,
                      src_rank: Optional[int]) -> nn.Module:
    """The column or row style applied to a peft layer (LoRA on the projection it names): the
    base layer sharded by the style, the adapters with it (:mod:`tpx.nn.lora`)."""
    import copy

    from ..nn.lora import shard_lora_layer

    local = copy.copy(style)
    local.use_local_output = True
    new = shard_lora_layer(local, module, pg, src_rank)
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
    if type(module).forward is not base.forward:
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
    if _is_conv1d(module):
        return module.nx, module.nf, module.weight.t(), module.bias, True
    raise ValueError(f"tpx.{style} applies to nn.Linear, Hugging Face Conv1D or nn.Embedding; "
                     f"got {type(module).__name__}")


def head_rows(segments: Sequence[int], head_size: Optional[int], replicate_heads: bool,
               world: int) -> List[List[Tuple[int, int]]]:
    """Per rank, the row ranges it holds of a projection whose output is the concatenation of
    ``segments``, each split over the ranks separately (in whole heads of ``head_size`` when
    given; a segment with fewer heads than ranks is replicated when ``replicate_heads``)."""
    rows: List[List[Tuple[int, int]]] = [[] for _ in range(world)]
    offset = 0
    for i, n in enumerate(segments):
        if head_size is None:
            for r in range(world):
                s, e = shard_bounds(n, r, world)
                rows[r].append((offset + s, offset + e))
        else:
            if n % head_size:
                raise ValueError(f"tpx.ColwiseParallel: segment {i} has {n} features, not a whole "
                                 f"number of heads of head_size={head_size}")
            heads = n // head_size
            if heads % world == 0:
                per = heads // world
                for r in range(world):
                    rows[r].append((offset + r * per * head_size, offset + (r + 1) * per * head_size))
            elif replicate_heads and world % heads == 0:
                for r in range(world):
                    h = r * heads // world
                    rows[r].append((offset + h * head_size, offset + (h + 1) * head_size))
            else:
                extra = (" and the TP size is not a multiple of it either (KV heads can be "
                         "replicated only when it is)") if replicate_heads else ""
                raise ValueError(
                    f"tpx.ColwiseParallel: {heads} heads (head_size={head_size}) do not divide by "
                    f"the TP size {world}{extra}; choose a TP size that divides the head count")
        offset += n
    return rows


class ParallelStyle:
    """Base of the styles: ``apply(module, group)`` returns the sharded module (the same
    object, with hooks, or a tpx replacement). Styles that build tpx modules also take
    ``src_rank`` (the rank whose weights are used, as ``tpx.parallelize_module``'s)."""

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:  # pragma: no cover
        raise NotImplementedError


def torch_style(style) -> bool:
    """Whether ``style`` is one of PyTorch's ``ParallelStyle`` s (torch's own, torchtitan's,
    a user's written for ``torch.distributed.tensor.parallel``): tpx applies it with PyTorch's
    implementation."""
    try:
        from torch.distributed.tensor.parallel.style import ParallelStyle as TorchParallelStyle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(style, TorchParallelStyle)


def is_style(style) -> bool:
    """A style ``parallelize_module`` takes: tpx's, or PyTorch's (applied by PyTorch)."""
    return isinstance(style, ParallelStyle) or torch_style(style)


def apply_style(style: ParallelStyle, module: nn.Module, pg: dist.ProcessGroup,
                src_rank: Optional[int] = 0) -> nn.Module:
    """``style.apply(module, pg)``, passing ``src_rank`` to styles whose ``apply`` takes it
    (user-defined styles with ``apply(module, pg)`` keep working). A PyTorch
    ``ParallelStyle`` tpx did not write (``PrepareModuleInputOutput``, torchtitan's styles) is
    applied by PyTorch (``style._apply(module, mesh)``) on the 1-D mesh over ``pg`` (the mesh
    ``parallelize_module`` was given, when it was one): its parameters and outputs are
    PyTorch's ``DTensor`` s, which tpx's layers take as inputs."""
    if torch_style(style):
        return _apply_with_pytorch(style, module, pg)
    try:
        takes = "src_rank" in inspect.signature(style.apply).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        takes = False
    if takes:
        return style.apply(module, pg, src_rank=src_rank)
    return style.apply(module, pg)


def _apply_with_pytorch(style, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
    """``style`` (one of PyTorch's ``ParallelStyle`` s) applied by PyTorch
    (``style._apply(module, mesh)``) on the 1-D mesh over ``pg``."""
    device = next((t.device.type for t in module.parameters()), None) or \
        next((t.device.type for t in module.buffers()), "cpu")
    return style._apply(module, mesh_for_group(pg, device))


def _own_forward_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward


def _linear_with_pytorch(name: str, torch_style, module: nn.Module, pg: dist.ProcessGroup,
                         src_rank: Optional[int], sharded_rows: bool) -> nn.Module:
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
        torch_style.src_data_rank = src_rank
    return _apply_with_pytorch(torch_style, module, pg)


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
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 chunks: Optional[int] = None, segments: Optional[Sequence[int]] = None,
                 head_size: Optional[int] = None, replicate_heads: bool = False) -> None:
        _check_placement("ColwiseParallel", "input_layouts", input_layouts, (Replicate, Shard))
        _check_placement("ColwiseParallel", "output_layouts", output_layouts, (Replicate, Shard))
        if isinstance(output_layouts, Shard) and output_layouts.dim != -1:
            raise ValueError("tpx.ColwiseParallel: output_layouts must be Shard(-1) or Replicate()")
        self.input_layouts = input_layouts or Replicate()
        self.output_layouts = output_layouts or Shard(-1)
        self.use_local_output = bool(use_local_output)
        self.chunks = chunks
        self.segments = tuple(segments) if segments is not None else None
        self.head_size, self.replicate_heads = head_size, bool(replicate_heads)

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        if is_peft_layer(module):
            return _shard_peft_layer(self, module, pg, src_rank)
        sp = isinstance(self.input_layouts, Shard)
        gather = isinstance(self.output_layouts, Replicate)
        if isinstance(module, nn.Embedding):
            if sp:
                raise ValueError("tpx.ColwiseParallel: an nn.Embedding takes Replicate() ids")
            _check_plain(module, nn.Embedding, "ColwiseParallel")
            new = ColumnParallelEmbedding.from_embedding(module, group=pg, gather_output=gather,
                                                         src_rank=src_rank)
            return self._wrap(new, pg, module.embedding_dim)
        if _own_forward_linear(module) and self.segments is None and self.head_size is None:
            from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise

            return _linear_with_pytorch("ColwiseParallel", TorchColwise(
                input_layouts=self.input_layouts, output_layouts=self.output_layouts,
                use_local_output=self.use_local_output), module, pg, src_rank, True)
        in_f, out_f, weight, bias, transposed = _linear_parts("ColwiseParallel", module)
        out_rows = None
        if self.segments is not None or self.head_size is not None:
            segments = self.segments or (out_f,)
            if sum(segments) != out_f:
                raise ValueError(f"tpx.ColwiseParallel: segments={segments} add up to "
                                 f"{sum(segments)}, but the layer has {out_f} output features")
            rows = head_rows(segments, self.head_size, self.replicate_heads, pg.size())
            default = [[shard_bounds(out_f, r, pg.size())] for r in range(pg.size())]
            out_rows = None if rows == default else rows
        new = ColumnParallelLinear(
            in_f, out_f, bias=bias is not None, group=pg, gather_output=gather,
            sequence_parallel=sp, sequence_dim=self.input_layouts.dim if sp else 1,
            chunks=self.chunks, device=weight.device, dtype=weight.dtype, out_rows=out_rows,
            src_rank=src_rank, _full_weights=(weight, bias))
        new._transposed_weight = transposed
        return self._wrap(new, pg, out_f)

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

        new.register_forward_hook(hook)
        return new

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in (("segments", self.segments),
                                                    ("head_size", self.head_size))
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
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 chunks: Optional[int] = None) -> None:
        _check_placement("RowwiseParallel", "input_layouts", input_layouts, (Replicate, Shard))
        _check_placement("RowwiseParallel", "output_layouts", output_layouts,
                         (Replicate, Shard, Partial))
        if isinstance(output_layouts, Partial) and output_layouts.reduce_op != "sum":
            raise ValueError(f"tpx.RowwiseParallel: output_layouts={output_layouts!r}: a row-"
                             "parallel layer's partial results add up; use Partial() "
                             "(reduce_op 'sum')")
        self.input_layouts, self.output_layouts = input_layouts, output_layouts or Replicate()
        self.use_local_output = bool(use_local_output)
        self.chunks = chunks

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        partial = isinstance(self.output_layouts, Partial)
        if partial and (is_peft_layer(module) or isinstance(module, nn.Embedding)):
            raise ValueError(
                f"tpx.RowwiseParallel: output_layouts=Partial() is for a linear layer; "
                f"{type(module).__name__} takes Replicate() or Shard(d) outputs (reduce them, "
                "then pass the result on)")
        if is_peft_layer(module):
            return _shard_peft_layer(self, module, pg, src_rank)
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
            from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

            return _linear_with_pytorch("RowwiseParallel", TorchRowwise(
                input_layouts=self.input_layouts, output_layouts=self.output_layouts,
                use_local_output=self.use_local_output), module, pg, src_rank, False)
        in_f, out_f, weight, bias, transposed = _linear_parts("RowwiseParallel", module)
        layout = self.input_layouts or Shard(-1)
        if isinstance(layout, Shard) and layout.dim != -1:
            raise ValueError("tpx.RowwiseParallel: input_layouts must be Shard(-1) or "
                             "Replicate() for a linear layer")
        new = RowParallelLinear(
            in_f, out_f, bias=bias is not None, group=pg,
            input_is_parallel=isinstance(layout, Shard), sequence_parallel=sp,
            sequence_dim=seq_dim, reduce_output=not partial, chunks=self.chunks, device=weight.device, dtype=weight.dtype,
            src_rank=src_rank, _full_weights=(weight, bias))
        new._transposed_weight = transposed
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

        new.register_forward_hook(hook)
        return new

    def __repr__(self) -> str:
        return f"RowwiseParallel(input_layouts={self.input_layouts}, output_layouts={self.output_layouts})"


class SequenceParallel(ParallelStyle):
    """A module that works row by row (LayerNorm, RMSNorm, dropout) run on this rank's block
    of the sequence: input and output ``Shard(sequence_dim)``, parameters replicated. Each
    rank sees only part of the sequence, so the gradients of the parameters are summed over
    the group as they are produced: every rank ends with the full, identical gradient.
    (The sums are tensor hooks on the parameters, which a ``copy.deepcopy`` of the model does
    not carry over: parallelize the copy instead of copying a parallelized model.)

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

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        linears = [n for n, m in module.named_modules()
                   if isinstance(m, nn.Linear) or _is_conv1d(m)]
        if linears:
            raise ValueError(
                f"tpx.SequenceParallel applies to modules that work row by row (LayerNorm, "
                f"RMSNorm, dropout); {type(module).__name__} holds linear layers "
                f"({linears[:4]}). The older PyTorch SequenceParallel (a column/row pair with "
                "sequence-sharded input and output) is tpx.parallel.compat.SequenceParallel, or "
                "in the current API: ColwiseParallel(input_layouts=Shard(0)) on the first "
                "layer and RowwiseParallel(output_layouts=Shard(0)) on the second.")
        if pg.size() > 1:
            for p in module.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g, pg=pg: mappings.all_reduce_grad_value(g, pg))
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


        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module

    def __repr__(self) -> str:
        return (f"SequenceParallel(sequence_dim={self.sequence_dim}, "
                f"use_local_output={self.use_local_output})")


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


class PrepareModuleInput(ParallelStyle):
    """Redistributes the positional (and keyword) inputs of a module before it runs:
    ``input_layouts[i] -> desired_input_layouts[i]`` (``None`` leaves an input alone).

    A plain tensor is taken as this rank's part of ``input_layouts[i]`` (shards of a plain
    tensor are equal-sized); a ``DTensor`` carries its own placement. As PyTorch's, each input
    is handed on as a ``DTensor`` with placement ``desired_input_layouts[i]``, or as its local
    tensor with ``use_local_output=True``. ``Shard(d) -> Replicate()`` goes through tpx's own
    all-gather, whose gradient a column-parallel layer reading the result reduce-scatters once.
    The module must be called with as many positional inputs as ``input_layouts`` names."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 input_kwarg_layouts=None, desired_input_kwarg_layouts=None,
                 use_local_output: bool = False) -> None:
        self.use_local_output = use_local_output
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError("tpx.PrepareModuleInput: input_layouts and desired_input_layouts "
                             "must have the same length")
        self.kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_kwarg_layouts = dict(desired_input_kwarg_layouts or {})

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        local = bool(self.use_local_output)

        def hook(mod, args, kwargs):
            if self.input_layouts and len(args) != len(self.input_layouts):
                raise ValueError(
                    f"tpx.PrepareModuleInput: {type(mod).__name__} was called with {len(args)} "
                    f"positional inputs, but input_layouts names {len(self.input_layouts)}; give "
                    "one layout per positional input (None for an input to leave alone)")
            args = list(args)
            for i, (src, dst) in enumerate(zip(self.input_layouts, self.desired_input_layouts)):
                if src is not None or dst is not None:
                    args[i] = redistribute(args[i], src, dst, pg, local=local)
            for key, src in self.kwarg_layouts.items():
                if key in kwargs:
                    kwargs[key] = redistribute(kwargs[key], src,
                                               self.desired_kwarg_layouts.get(key), pg,
                                               local=local)
            return tuple(args), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Redistributes a module's output(s): ``output_layouts[i] -> desired_output_layouts[i]``."""

    def __init__(self, *, output_layouts, desired_output_layouts,
                 use_local_output: bool = True) -> None:
        self.use_local_output = use_local_output
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("tpx.PrepareModuleOutput: output_layouts and desired_output_layouts "
                             "must have the same length")

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        local = bool(self.use_local_output)

        def hook(mod, args, output):
            single = not isinstance(output, tuple)
            outs = (output,) if single else list(output)
            outs = [redistribute(o, src, dst, pg, local=local)
                    if i < len(self.output_layouts)
                    else o
                    for i, (o, src, dst) in enumerate(zip(
                        outs, self.output_layouts + (None,) * len(outs),
                        self.desired_output_layouts + (None,) * len(outs)))]
            return outs[0] if single else tuple(outs)

        module.register_forward_hook(hook)
        return module


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module whose parameters stay whole on every rank but see only this rank's part of the
    computation: a per-head norm after a column-parallel projection (Qwen3's ``q_norm`` /
    ``k_norm``), a norm over this rank's heads. Their gradients are partial sums; this style
    sums them over the group as they are computed (one all-reduce per parameter and backward),
    so the replicas stay equal and equal to one device. Hugging Face's plans call it
    ``replicated_with_grad_allreduce``.

    Placement: parameters R (gradient P, summed to R); inputs and outputs as they are.

    Without it such a model runs, gives the right loss, and drifts: the ranks' copies of the
    parameter differ after the first optimizer step. ``tpx.check_replicas(model)`` finds that.
    """

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        params = list(module.parameters())
        if not params:
            raise ValueError(f"tpx.ReplicatedWithGradAllReduce: {type(module).__name__} has no "
                             "parameter to sum the gradient of")
        if pg.size() > 1:
            def hook_trainable(*_):
                for p in params:
                    if not p.requires_grad or \
                            getattr(p, "_tpx_grad_sum_group", None) == pg.group_name:
                        continue  # frozen, or shared with a module styled already
                    p._tpx_grad_sum_group = pg.group_name
                    p.register_hook(lambda g, pg=pg: mappings.sum_over_group(g, pg))

            hook_trainable()
            if not all(p.requires_grad for p in params):
                # Frozen now (a norm under LoRA fine-tuning): hooked at the first forward
                # after it is made trainable.
                module.register_forward_pre_hook(hook_trainable)
        return module

    def __repr__(self) -> str:
        return "ReplicatedWithGradAllReduce()"


class ShardedAttention(ParallelStyle):
    """The attention module around head-sharded projections (colwise q/k/v, rowwise output):
    checks that the head counts fit the TP size, tells the module its LOCAL head counts, and
    runs its sharded part on ``tpx.random``'s tensor-parallel stream.

    Args:
        num_heads: the model's query heads; must divide by the TP size (else ``ValueError``
            naming the numbers).
        num_kv_heads: key/value heads (GQA); ``None`` = ``num_heads``. Either they divide by
            the TP size, or the TP size is a multiple of them: the KV heads are then
            replicated (the k/v projections use ``ColwiseParallel(replicate_heads=True)``)
            and each rank holds the one KV head its query heads read.
        update: ``update(module, local_heads, local_kv_heads)`` sets the module's own
            head-count attributes (``num_key_value_groups``, ``split_size``, ...). Without
            it, the integer attributes the module has among :attr:`HEAD_ATTRIBUTES` are set
            to the local counts, and a module with none of them raises ``ValueError`` (it
            would go on computing with its global head count). A module that reads its head
            count from the tensors' shapes takes ``update=ShardedAttention.shapes_only``.
        out_proj: name of the output projection inside the module. When ``tpx.random`` is
            seeded and the module is training, the module's forward runs on the
            tensor-parallel stream from its start up to the call of ``out_proj`` (attention
            dropout differs across ranks: each holds other heads), and on the replicated
            stream after it (dropout after the output projection is the same on every rank).
    """

    #: head-count attributes set without ``update``: query heads, KV heads, and the number of
    #: query heads per KV head.
    HEAD_ATTRIBUTES = {"num_heads": "q", "n_heads": "q", "n_head": "q",
                       "num_attention_heads": "q", "num_key_value_heads": "kv",
                       "num_kv_heads": "kv", "n_kv_heads": "kv",
                       "num_key_value_groups": "groups", "n_rep": "groups"}

    @staticmethod
    def shapes_only(module: nn.Module, heads: int, kv_heads: int) -> None:
        """``update`` for an attention module that holds no head count (it derives it from
        the projections' output shapes)."""

    def __init__(self, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 update=None, out_proj: Optional[str] = None) -> None:
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads) if num_kv_heads is not None else self.num_heads
        self.update, self.out_proj = update, out_proj

    def local_heads(self, world: int) -> Tuple[int, int]:
        """(query heads, KV heads) held by each rank at TP size ``world``."""
        h, kv = self.num_heads, self.num_kv_heads
        if h % world:
            divisors = [d for d in range(1, h + 1) if h % d == 0]
            raise ValueError(
                f"the model has {h} attention heads, which do not divide by the TP size {world}; "
                f"use a TP size that divides {h} (one of {divisors})")
        if h % kv:
            raise ValueError(f"the model has {h} query heads and {kv} KV heads: not a GQA layout")
        if kv % world == 0:
            return h // world, kv // world
        if world % kv == 0:
            return h // world, 1
        raise ValueError(
            f"the model has {kv} KV heads: they neither divide by the TP size {world} nor does "
            f"{world} divide by them (then each KV head would be replicated); use a TP size "
            f"that divides {kv} or a multiple of it")

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
        heads, kv_heads = self.local_heads(pg.size())
        if self.update is not None:
            self.update(module, heads, kv_heads)
        else:
            self._set_head_attributes(module, heads, kv_heads)
        if self.out_proj is not None and pg.size() > 1:
            self._fork_until_out_proj(module)
        return module

    def _set_head_attributes(self, module: nn.Module, heads: int, kv_heads: int) -> None:
        local = {"q": heads, "kv": kv_heads, "groups": heads // kv_heads}
        found = [a for a in self.HEAD_ATTRIBUTES
                 if isinstance(getattr(module, a, None), int)
                 and not isinstance(getattr(module, a), bool)]
        if not found:
            raise ValueError(
                f"tpx.ShardedAttention: {type(module).__name__} has none of the head-count "
                f"attributes tpx knows ({', '.join(self.HEAD_ATTRIBUTES)}), so it would keep "
                f"computing with {self.num_heads} heads where each rank holds {heads}. Pass "
                "update=fn(module, local_heads, local_kv_heads) that sets its own attributes, "
                "or update=ShardedAttention.shapes_only if it reads the head count from the "
                "tensors' shapes.")
        for a in found:
            setattr(module, a, local[self.HEAD_ATTRIBUTES[a]])

    def _fork_until_out_proj(self, module: nn.Module) -> None:
        from .. import random as tpx_random

        state = {}

        def device_of(mod):
            p = next(mod.parameters(), None)
            return p.device if p is not None else torch.device("cpu")

        def leave(*_):
            swap = state.pop("swap", None)
            if swap is not None:
                swap.exit()

        def enter(mod, args):
            if not (mod.training and tpx_random.is_seeded()):
                return
            proj = mod.get_submodule(self.out_proj)
            if not getattr(proj, "_tpx_leaves_fork", False):
                # The output projection is looked up here, after the plan replaced it.
                proj.register_forward_pre_hook(lambda m, a: leave())
                proj._tpx_leaves_fork = True
            state["swap"] = tpx_random.Swap(device_of(mod))
            state["swap"].enter()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, a, o: leave(), always_call=True)

    def __repr__(self) -> str:
        return f"ShardedAttention(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads})"
