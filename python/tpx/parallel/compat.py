"""The tensor-parallel API of earlier PyTorch releases (2.0 / 2.1), on tpx.

Scripts written for ``torch.distributed.tensor.parallel`` of those releases run with their
import changed to tpx::

    from torch.distributed._tensor import DeviceMesh
    from tpx import PairwiseParallel, parallelize_module

    device_mesh = DeviceMesh("cpu", torch.arange(0, world_size))   # or "cuda"
    model = parallelize_module(ToyModel(), device_mesh, PairwiseParallel())

What is here, each with a ``DeprecationWarning`` that names its current equivalent:

* :class:`PairwiseParallel`: the ``nn.Linear`` children of a module in column/row pairs
  (Megatron-LM's MLP), input and output replicated.
* :class:`SequenceParallel` (the older one, a subclass of ``PairwiseParallel``; not
  ``tpx.SequenceParallel``, the current style for norms): the same pairs with the input and the
  output sharded along dim 0.
* :class:`ColwiseParallel` / :class:`RowwiseParallel` taking the older ``_prepare_input`` /
  ``_prepare_output`` functions (positional, as then).
* The ``make_input_*`` / ``make_output_*`` functions. Given to a style they say how its input
  arrives and its output leaves; called on a tensor they do the same to a plain tensor (tpx has
  no DTensor: an input helper takes the tensor as this rank's part of the placement it names,
  an output helper takes a plain tensor as replicated and returns this rank's local tensor).
  Called on a ``DTensor`` they do what they did in PyTorch (a redistribution).
* ``tp_mesh_dim`` of :func:`tpx.parallelize_module`.

This module also holds ``parallelize_module`` and torch's ``DeviceMesh``, so that it can stand
in for the older ``torch.distributed.tensor.parallel`` in one import.

Placements are written R (replicated) and S(d) (sharded on dim d), as in the rest of tpx.
Shards of plain tensors are taken to be equal-sized (as ``DTensor.from_local`` did).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch.distributed as dist
from torch import Tensor, nn

from ..group import DeviceMesh, resolve_group
from .api import parallelize_module
from .style import (ColwiseParallel as _Colwise, ParallelStyle, Replicate,
                    RowwiseParallel as _Rowwise, Shard, apply_style, redistribute)

__all__ = ["DeviceMesh", "parallelize_module", "PairwiseParallel", "SequenceParallel", "ColwiseParallel", "RowwiseParallel",
           "make_input_replicate_1d", "make_input_reshard_replicate", "make_input_shard_1d",
           "make_input_shard_1d_last_dim", "make_sharded_output_tensor",
           "make_output_replicate_1d", "make_output_reshard_tensor", "make_output_tensor",
           "make_output_shard_1d"]


def _deprecated(name: str, modern: str, stacklevel: int = 3) -> None:
    warnings.warn(f"tpx: {name} is the tensor-parallel API of earlier PyTorch releases; use "
                  f"{modern} instead.", DeprecationWarning, stacklevel=stacklevel)


# --------------------------------------------------------------------------------------------
# make_input_* / make_output_*
# --------------------------------------------------------------------------------------------

# helper -> (kind, modern equivalent, placement(**keywords)). For an input helper the
# placement is the one of the tensor given to the module; for an output helper, the one the
# module's output is turned into (None: left as the module produces it).
_HELPERS: Dict[Callable, Tuple[str, str, Callable]] = {}


def _helper(kind: str, modern: str, placement: Callable):
    def register(fn):
        _HELPERS[fn] = (kind, modern, placement)
        return fn
    return register


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except ImportError:  # pragma: no cover
        return None


def _torch_placement(p):
    from torch.distributed.tensor import Replicate as TR, Shard as TS

    return TR() if isinstance(p, Replicate) else TS(p.dim)


def _run(name: str, x, device_mesh, src, dst, to_local: bool):
    """Turns ``x`` (placement ``src``) into ``dst`` (``None``: unchanged)."""
    x = _first(x)
    DTensor = _dtensor_type()
    if DTensor is not None and isinstance(x, DTensor):
        mesh = device_mesh if device_mesh is not None else x.device_mesh
        if mesh.ndim != 1:
            raise ValueError(f"tpx.{name}: device_mesh has {mesh.ndim} dims; it must be 1-D")
        target = dst if dst is not None else src
        if target is not None:
            dim = target.dim % x.dim() if isinstance(target, Shard) else None
            x = x.redistribute(mesh, [_torch_placement(Shard(dim) if dim is not None
                                                       else target)])
        return x.to_local() if to_local else x
    if not isinstance(x, Tensor):
        raise RuntimeError(f"tpx.{name}: tensor parallel modules expect a torch.Tensor or a "
                           f"DTensor; got {type(x).__name__}")
    pg = resolve_group(device_mesh)
    return redistribute(x, src, dst, pg)


@_helper("input", "ColwiseParallel(input_layouts=Replicate()) / PrepareModuleInput("
         "input_layouts=Replicate(), desired_input_layouts=Replicate())",
         lambda: Replicate())
def make_input_replicate_1d(input, device_mesh=None):
    """The input is replicated: ``x R -> x R`` (a plain tensor is returned as it is)."""
    _deprecated("make_input_replicate_1d", _HELPERS[make_input_replicate_1d][1])
    return _run("make_input_replicate_1d", input, device_mesh, Replicate(), None, False)


@_helper("input", "ColwiseParallel(input_layouts=Shard(dim)) / PrepareModuleInput("
         "input_layouts=Shard(dim), ...)", lambda dim=0: Shard(dim))
def make_input_shard_1d(input, device_mesh=None, dim: int = 0):
    """The input is this rank's block of dim ``dim``: ``x S(dim)`` (a plain tensor is returned
    as it is: it already is the local block)."""
    _deprecated("make_input_shard_1d", _HELPERS[make_input_shard_1d][1])
    return _run("make_input_shard_1d", input, device_mesh, Shard(dim), None, False)


@_helper("input", "RowwiseParallel(input_layouts=Shard(-1))", lambda: Shard(-1))
def make_input_shard_1d_last_dim(input, device_mesh=None):
    """The input is this rank's block of its last dim: ``x S(-1)`` (returned as it is)."""
    _deprecated("make_input_shard_1d_last_dim", _HELPERS[make_input_shard_1d_last_dim][1])
    return _run("make_input_shard_1d_last_dim", input, device_mesh, Shard(-1), None, False)


@_helper("input", "ColwiseParallel(input_layouts=Shard(0)) / PrepareModuleInput("
         "input_layouts=Shard(0), desired_input_layouts=Replicate())", lambda: Shard(0))
def make_input_reshard_replicate(input, device_mesh=None):
    """The input is this rank's block of dim 0, gathered: ``x S(0) -> x R`` (an all-gather;
    its backward keeps this rank's block of the gradient)."""
    _deprecated("make_input_reshard_replicate", _HELPERS[make_input_reshard_replicate][1])
    return _run("make_input_reshard_replicate", input, device_mesh, Shard(0), Replicate(), False)


@_helper("output", "ColwiseParallel(output_layouts=Replicate()) / RowwiseParallel("
         "output_layouts=Replicate())", lambda: Replicate())
def make_output_replicate_1d(output, device_mesh=None):
    """The output replicated: ``y -> y R`` (a plain tensor is replicated already)."""
    _deprecated("make_output_replicate_1d", _HELPERS[make_output_replicate_1d][1])
    return _run("make_output_replicate_1d", output, device_mesh, Replicate(), Replicate(), False)


@_helper("output", "ColwiseParallel(output_layouts=Replicate()) / RowwiseParallel("
         "output_layouts=Replicate()) (outputs are plain tensors)", lambda: Replicate())
def make_output_tensor(output, device_mesh=None):
    """The output replicated, as a local tensor: ``y -> y R``."""
    _deprecated("make_output_tensor", _HELPERS[make_output_tensor][1])
    return _run("make_output_tensor", output, device_mesh, Replicate(), Replicate(), True)


@_helper("output", "ColwiseParallel(output_layouts=Shard(-1)) (the default; outputs are "
         "plain tensors)", lambda: None)
def make_sharded_output_tensor(output, _device_mesh=None):
    """The output as the module produced it, as a local tensor (no communication)."""
    _deprecated("make_sharded_output_tensor", _HELPERS[make_sharded_output_tensor][1])
    return _run("make_sharded_output_tensor", output, _device_mesh, None, None, True)


@_helper("output", "RowwiseParallel(output_layouts=Shard(dim)) / PrepareModuleOutput("
         "output_layouts=Replicate(), desired_output_layouts=Shard(dim))",
         lambda dim=0: Shard(dim))
def make_output_shard_1d(output, device_mesh=None, dim: int = 0):
    """The output sharded on ``dim``: ``y R -> y S(dim)`` (this rank's block, no
    communication; a plain tensor is taken as replicated)."""
    _deprecated("make_output_shard_1d", _HELPERS[make_output_shard_1d][1])
    return _run("make_output_shard_1d", output, device_mesh, Replicate(), Shard(dim), False)


@_helper("output", "RowwiseParallel(output_layouts=Shard(0))", lambda: Shard(0))
def make_output_reshard_tensor(output, device_mesh=None):
    """The output sharded on dim 0, as a local tensor: ``y R -> y S(0)``."""
    _deprecated("make_output_reshard_tensor", _HELPERS[make_output_reshard_tensor][1])
    return _run("make_output_reshard_tensor", output, device_mesh, Replicate(), Shard(0), True)


def _layout(fn, kind: str, style: str):
    """The placement that the helper ``fn`` (or ``functools.partial`` of one) stands for."""
    base, args, kwargs = fn, (), {}
    if isinstance(fn, functools.partial):
        base, args, kwargs = fn.func, fn.args, dict(fn.keywords)
    if base not in _HELPERS:
        raise ValueError(
            f"tpx.{style}: the {kind} function {getattr(base, '__name__', base)!r} is not one of "
            "tpx.parallel.compat's make_*_ helpers, and tpx cannot translate an arbitrary "
            f"function; use PrepareModule{kind.capitalize()}(...) with placements instead")
    helper_kind, modern, placement = _HELPERS[base]
    if helper_kind != kind:
        raise ValueError(f"tpx.{style}: {base.__name__} is an {helper_kind} helper; it cannot "
                         f"prepare the {kind}")
    if args:
        raise ValueError(f"tpx.{style}: give the arguments of {base.__name__} by keyword "
                         "(functools.partial(make_output_shard_1d, dim=1))")
    _deprecated(base.__name__, modern, stacklevel=4)
    try:
        return placement(**{k: v for k, v in kwargs.items() if k == "dim"})
    except TypeError:
        raise ValueError(f"tpx.{style}: {base.__name__} takes no `dim`") from None


# --------------------------------------------------------------------------------------------
# Styles
# --------------------------------------------------------------------------------------------

def _last(p) -> bool:
    return isinstance(p, Shard) and p.dim == -1


class _LegacyLinear(ParallelStyle):
    """One ``nn.Linear`` split by columns (``colwise``, weight rows) or rows, whose input
    arrives as ``in_layout`` and whose output leaves as ``out_layout`` (``None``: as the layer
    produces it). Placements tpx's layers take directly become arguments of the current
    styles; the others are redistributed around the layer."""

    def __init__(self, colwise: bool, in_layout, out_layout, name: str) -> None:
        self.colwise, self.in_layout, self.out_layout, self.name = (
            colwise, in_layout, out_layout, name)
        if not colwise and out_layout is None:
            raise ValueError(
                f"tpx.{name}: make_sharded_output_tensor on a row-wise layer asks for its "
                "partial sums; tpx's RowParallelLinear always reduces them. Use "
                "make_output_tensor (replicated) or make_output_reshard_tensor (sharded on "
                "dim 0)")

    def _plan(self):
        """(current style, placement to gather the input from, placement to split the output
        into), the latter two applied by hooks around the layer."""
        pre = post = None
        i, o = self.in_layout, self.out_layout
        if self.colwise:
            if _last(i):  # features sharded: gather them first
                pre, i = i, Replicate()
            if isinstance(o, Shard) and not _last(o):
                post, o = o, Replicate()
            style = _Colwise(input_layouts=i, output_layouts=o if o is not None else Shard(-1))
        else:
            if isinstance(i, Shard) and not _last(i):
                pre, i = i, Replicate()
            if _last(o):
                post, o = o, Replicate()
            style = _Rowwise(input_layouts=i, output_layouts=o)
        return style, pre, post

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tpx.{self.name} (older API) applies to nn.Linear; got "
                             f"{type(module).__name__}. Use tpx.ColwiseParallel / "
                             "tpx.RowwiseParallel for other modules")
        style, pre, post = self._plan()
        new = apply_style(style, module, pg, src_rank)
        if pre is not None:
            new.register_forward_pre_hook(
                lambda m, args: (redistribute(args[0], pre, Replicate(), pg),) + tuple(args[1:]))
        if post is not None:
            new.register_forward_hook(lambda m, args, out: redistribute(out, Replicate(), post, pg))
        return new

    def __repr__(self) -> str:
        kind = "colwise" if self.colwise else "rowwise"
        return f"{self.name}({kind}, input={self.in_layout}, output={self.out_layout})"


class ColwiseParallel(_LegacyLinear):
    """The older ``ColwiseParallel(_prepare_input, _prepare_output)``: ``nn.Linear`` ->
    :class:`tpx.ColumnParallelLinear`. Defaults: input ``make_input_replicate_1d`` (x R),
    output ``make_sharded_output_tensor`` (y S(-1)), as then. Input S(d) of another dim than
    the last is gathered inside the GEMM (sequence parallel); S(-1) is gathered first."""

    def __init__(self, _prepare_input=None, _prepare_output=None) -> None:
        in_layout = (Replicate() if _prepare_input is None
                     else _layout(_prepare_input, "input", "ColwiseParallel"))
        out_layout = (None if _prepare_output is None
                      else _layout(_prepare_output, "output", "ColwiseParallel"))
        super().__init__(True, in_layout, out_layout, "ColwiseParallel")


class RowwiseParallel(_LegacyLinear):
    """The older ``RowwiseParallel(_prepare_input, _prepare_output)``: ``nn.Linear`` ->
    :class:`tpx.RowParallelLinear`. Defaults: input ``make_input_shard_1d_last_dim`` (x S(-1)),
    output ``make_output_tensor`` (y R), as then. Output S(d) (d not the last dim) is
    reduce-scattered along d (sequence parallel)."""

    def __init__(self, _prepare_input=None, _prepare_output=None) -> None:
        in_layout = (Shard(-1) if _prepare_input is None
                     else _layout(_prepare_input, "input", "RowwiseParallel"))
        out_layout = (Replicate() if _prepare_output is None
                      else _layout(_prepare_output, "output", "RowwiseParallel"))
        super().__init__(False, in_layout, out_layout, "RowwiseParallel")


class PairwiseParallel(ParallelStyle):
    """The older ``PairwiseParallel``: the ``nn.Linear`` children of a module, in the order
    they were registered, taken in pairs as Megatron-LM's MLP: the first of each pair
    column-parallel, the second row-parallel; a last unpaired layer stays whole (replicated).
    Input and output replicated: ``x R -> y R`` (``_prepare_input`` / ``_prepare_output``, the
    older helpers, change the first layer's input and the last pair's output).

    Current equivalent: a plan dict, ``{"net1": ColwiseParallel(), "net2": RowwiseParallel()}``.
    ``nn.MultiheadAttention`` is not supported (its projections are one fused parameter):
    write attention with ``nn.Linear`` projections and use a plan."""

    _name = "PairwiseParallel"

    def __init__(self, _prepare_input=None, _prepare_output=None) -> None:
        _deprecated(self._name, self._modern(), stacklevel=3)
        self.in_layout = (Replicate() if _prepare_input is None
                          else _layout(_prepare_input, "input", self._name))
        self.out_layout = (Replicate() if _prepare_output is None
                           else _layout(_prepare_output, "output", self._name))
        # Validated now rather than when the model is sharded.
        _LegacyLinear(False, Shard(-1), self.out_layout, self._name)

    @staticmethod
    def _modern() -> str:
        return ("a plan dict with the current styles, e.g. parallelize_module(model, mesh, "
                "{'net1': ColwiseParallel(), 'net2': RowwiseParallel()})")

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        if isinstance(module, nn.MultiheadAttention) or any(
                isinstance(m, nn.MultiheadAttention) for m in module.children()):
            raise ValueError(
                f"tpx.{self._name} does not support nn.MultiheadAttention (its q/k/v "
                "projections are one fused in_proj_weight): write the attention with nn.Linear "
                "projections and shard them with a plan of ColwiseParallel (q, k, v) and "
                "RowwiseParallel (output)")
        linears = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Linear)]
        if len(linears) < 2:
            raise ValueError(
                f"tpx.{self._name} needs a module whose direct children include at least two "
                f"nn.Linear layers (paired column then row); {type(module).__name__} has "
                f"{len(linears)}. For a single layer use ColwiseParallel() or RowwiseParallel()")
        paired = len(linears) // 2 * 2
        for i, (name, child) in enumerate(linears[:paired]):
            if i % 2 == 0:
                style = _LegacyLinear(True, self.in_layout if i == 0 else Replicate(),
                                      Shard(-1), self._name)
            else:
                style = _LegacyLinear(False, Shard(-1),
                                      self.out_layout if i == paired - 1 else Replicate(),
                                      self._name)
            setattr(module, name, style.apply(child, pg, src_rank))
        return module

    def __repr__(self) -> str:
        return f"{self._name}(input={self.in_layout}, output={self.out_layout})"


class SequenceParallel(PairwiseParallel):
    """The older ``SequenceParallel`` (a ``PairwiseParallel``, not ``tpx.SequenceParallel``):
    the same column/row pairs with the input sharded along dim 0 (gathered inside the first
    GEMM) and the output reduce-scattered along dim 0: ``x S(0) -> y S(0)``. Dim 0 of the
    output must divide by the group size. Current equivalent: ``{"net1":
    ColwiseParallel(input_layouts=Shard(0)), "net2": RowwiseParallel(output_layouts=Shard(0))}``.
    """

    _name = "SequenceParallel"

    def __init__(self) -> None:
        with warnings.catch_warnings():  # one warning, naming this style's equivalent
            warnings.simplefilter("ignore", DeprecationWarning)
            super().__init__(make_input_reshard_replicate, make_output_reshard_tensor)
        _deprecated("tpx.parallel.compat.SequenceParallel", self._modern(), stacklevel=3)

    @staticmethod
    def _modern() -> str:
        return ("a plan dict: {'net1': ColwiseParallel(input_layouts=Shard(0)), "
                "'net2': RowwiseParallel(output_layouts=Shard(0))}")
