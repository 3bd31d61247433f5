"""The tensor-parallel API of earlier PyTorch releases (2.0 / 2.1), on tpx.

Scripts written for ``torch.distributed.tensor.parallel`` of those releases run with their
import changed to tpx::

    from torch.distributed._tensor import DeviceMesh
    from tpx import PairwiseParallel, parallelize_module

    device_mesh = DeviceMesh("cpu", torch.arange(0, world_size))   # or "cuda"
    model = parallelize_module(ToyModel(), device_mesh, PairwiseParallel())

What is here, each with a ``DeprecationWarning`` that names its current equivalent:

* :class:`PairwiseParallel`: the ``nn.Linear`` children of a module in column/row pairs
  (Megatron-LM's MLP), ``nn.MultiheadAttention`` split by heads
  (:class:`ParallelMultiheadAttention`), and containers (``nn.TransformerEncoder``,
  ``nn.Transformer``, a module holding them) searched for both; input and output
  replicated.
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
import threading
import warnings
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import random as tpx_random
from ..comm.groups import DeviceMesh, copied_with_module, resolve_group
from ..nn.attention import ParallelMultiheadAttention, check_mha
from .api import become_module, check_can_become_module, parallelize_module
from .style import ColwiseParallel as _Colwise
from .style import ParallelStyle, Replicate, Shard, TPContext, apply_style, redistribute
from .style import RowwiseParallel as _Rowwise

__all__ = ["DeviceMesh", "parallelize_module", "PairwiseParallel", "SequenceParallel", "ColwiseParallel", "RowwiseParallel",
           "ParallelMultiheadAttention",
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
# Containers: the transformer layers' inference fast paths read the weights directly
# --------------------------------------------------------------------------------------------

_FASTPATH = threading.local()


def _fastpath_off(module, args) -> None:
    """Forward pre-hook: turns PyTorch's MHA / transformer fast path off while the module
    runs (``torch._transformer_encoder_layer_fwd`` and the nested-tensor path of
    ``nn.TransformerEncoder`` read ``self_attn.in_proj_weight`` and the feed-forward weights
    as full matrices, which they no longer are)."""
    stack = _FASTPATH.__dict__.setdefault("stack", [])
    stack.append(torch.backends.mha.get_fastpath_enabled())
    torch.backends.mha.set_fastpath_enabled(False)


def _fastpath_back(module, args, output) -> None:
    stack = getattr(_FASTPATH, "stack", None)
    if stack:
        torch.backends.mha.set_fastpath_enabled(stack.pop())


def _guard_fastpath(module: nn.Module) -> None:
    module.register_forward_pre_hook(copied_with_module(_fastpath_off))
    module.register_forward_hook(copied_with_module(_fastpath_back), always_call=True)
    if isinstance(module, nn.TransformerEncoder):
        module.use_nested_tensor = False


def _tp_stream_dropout(module: nn.Module) -> None:
    """The dropout between a layer's column- and row-parallel linears acts on this rank's
    features: it draws on tpx.random's tensor-parallel stream when that is seeded."""
    state: Dict[str, object] = {}

    def enter(mod, args):
        if (mod.training and getattr(mod, "p", 0) > 0 and tpx_random.is_seeded() and args
                and isinstance(args[0], Tensor)):
            swap = tpx_random.Swap(args[0].device)
            swap.enter()
            state["swap"] = swap

    def leave(mod, args, output):
        swap = state.pop("swap", None)
        if swap is not None:
            swap.exit()

    module.register_forward_pre_hook(copied_with_module(enter))
    module.register_forward_hook(copied_with_module(leave), always_call=True)


_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class _Found:
    """What PairwiseParallel shards in a module: attention modules, column/row pairs of
    nn.Linear siblings, and the modules whose fast path must stay off."""

    def __init__(self) -> None:
        self.attention: List[Tuple[str, nn.Module]] = []
        self.pairs: List[Tuple[Tuple[str, nn.Linear], Tuple[str, nn.Linear], nn.Module]] = []
        self.fast: List[nn.Module] = []
        self.seen: set = set()


def _walk(module: nn.Module, prefix: str, found: _Found) -> None:
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerEncoder)):
        found.fast.append(module)
    linears = []
    for name, child in module.named_children():
        if id(child) in found.seen:
            continue  # a module held in several places is sharded once (in place)
        found.seen.add(id(child))
        path = prefix + name
        if isinstance(child, nn.MultiheadAttention):
            found.attention.append((path, child))
        elif isinstance(child, nn.Linear):
            linears.append((path, child))
        else:
            _walk(child, path + ".", found)
    for i in range(0, len(linears) // 2 * 2, 2):
        found.pairs.append((linears[i], linears[i + 1], module))


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

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tpx.{self.name} (older API) applies to nn.Linear; got "
                             f"{type(module).__name__}. Use tpx.ColwiseParallel / "
                             "tpx.RowwiseParallel for other modules")
        style, pre, post = self._plan()
        new = apply_style(style, module, ctx)
        if pre is not None:
            new.register_forward_pre_hook(
                copied_with_module(lambda m, args: (redistribute(args[0], pre, Replicate(), pg),)
                                   + tuple(args[1:])))
        if post is not None:
            new.register_forward_hook(copied_with_module(
                lambda m, args, out: redistribute(out, Replicate(), post, pg)))
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
    """The older ``PairwiseParallel``: Megatron-LM's column/row pairs, input and output
    replicated (``x R -> y R``).

    * ``nn.MultiheadAttention`` becomes a :class:`ParallelMultiheadAttention`: heads split
      over the group (each rank holds its heads' rows of q, of k and of v, and its columns of
      ``out_proj``); one all-reduce forward. Heads must divide by the TP size.
    * Any other module: its ``nn.Linear`` children, in the order they were registered, are
      taken in pairs (the first of each pair column-parallel, the second row-parallel; a last
      unpaired layer stays whole, replicated), and every other child is searched the same
      way: an ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` / ``nn.Transformer``, a
      ``Transformer*Layer`` or a module holding them gets every ``nn.MultiheadAttention``
      split by heads and every ``linear1`` / ``linear2`` feed-forward pair split
      column/row. The element-wise functions between the two linears of a pair are assumed
      to act per feature (ReLU, GELU; not a GLU).
    * The ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` inference fast paths
      (``torch._transformer_encoder_layer_fwd``, nested tensors) read the full weights: they
      are turned off while a sharded layer runs (``torch.backends.mha`` fast path, and
      ``use_nested_tensor = False``). The dropout between a layer's ``linear1`` and
      ``linear2`` draws on ``tpx.random``'s tensor-parallel stream when it is seeded.

    Every module replaced (``nn.Linear``, ``nn.MultiheadAttention``) is changed in place, so
    references to it (a parent's, the caller's) hold the parallel module, and the state dict
    keeps the original keys (:func:`tpx.checkpoint.full_state_dict` gathers it).

    ``_prepare_input`` / ``_prepare_output`` (the older helpers) change how the input arrives
    and the output leaves: for a module whose only sharded layers are its own ``nn.Linear``
    pairs, the first layer's input and the last pair's output (inside the GEMMs); otherwise
    the module's first positional input (for an ``nn.MultiheadAttention`` ``query``, ``key``
    and ``value``) is brought to ``R`` before it runs and its output (the first of a tuple)
    is turned into the requested placement after.

    Current equivalent: a plan dict, ``{"net1": ColwiseParallel(), "net2": RowwiseParallel()}``
    (for attention: ``ColwiseParallel(segments=..., head_size=...)`` on a fused projection)."""

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

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        """Shards ``module``; returns it (an ``nn.MultiheadAttention`` given directly: the
        :class:`ParallelMultiheadAttention` replacing it, which ``parallelize_module`` turns
        the given object into). Everything is checked before anything is changed."""
        pg, src_rank = ctx.group, ctx.src_rank
        world = pg.size()
        if isinstance(module, nn.MultiheadAttention):
            check_mha(module, world, "")
            new = ParallelMultiheadAttention(module, pg, src_rank=src_rank)
            self._io_hooks(new, pg, 3)
            return new
        found = _Found()
        _walk(module, "", found)
        nested = found.attention or any(parent is not module for _, _, parent in found.pairs)
        if not nested and not found.pairs:
            linears = sum(isinstance(m, nn.Linear) for m in module.children())
            raise ValueError(
                f"tpx.{self._name} needs an nn.MultiheadAttention, or a module whose children "
                f"include at least two nn.Linear layers (paired column then row), somewhere "
                f"in the module; {type(module).__name__} has {linears} nn.Linear children and "
                "no attention. For a single layer use ColwiseParallel() or RowwiseParallel()")
        for path, mha in found.attention:
            check_mha(mha, world, path)
        # Build every replacement first (collectives, the same order on every rank), then
        # change the modules in place.
        work: List[Tuple[str, nn.Module, nn.Module]] = []
        for path, mha in found.attention:
            work.append((path, mha, ParallelMultiheadAttention(mha, pg, src_rank=src_rank)))
        last = len(found.pairs) - 1
        for i, ((c_path, col), (r_path, row), _) in enumerate(found.pairs):
            first_in = self.in_layout if (i == 0 and not nested) else Replicate()
            last_out = self.out_layout if (i == last and not nested) else Replicate()
            work.append((c_path, col, _LegacyLinear(True, first_in, Shard(-1), self._name)
                         .apply(col, ctx)))
            work.append((r_path, row, _LegacyLinear(False, Shard(-1), last_out, self._name)
                         .apply(row, ctx)))
        for path, old, new in work:
            check_can_become_module(old, new, repr(path))
        for _, old, new in work:
            become_module(old, new)
        for mod in found.fast:
            _guard_fastpath(mod)
        if world > 1:
            for mod in module.modules():
                if isinstance(mod, _LAYERS) and isinstance(getattr(mod, "dropout", None),
                                                           nn.Dropout):
                    _tp_stream_dropout(mod.dropout)
        if nested:
            self._io_hooks(module, pg, 1)
        return module

    def _io_hooks(self, module: nn.Module, pg: dist.ProcessGroup, inputs: int) -> None:
        """``_prepare_input`` / ``_prepare_output`` around a module that computes ``R -> R``:
        its first ``inputs`` positional tensors are brought from ``in_layout`` to ``R`` and its
        output (the first of a tuple) from ``R`` to ``out_layout``."""
        src, dst = self.in_layout, self.out_layout
        if isinstance(src, Replicate) and isinstance(dst, Replicate):
            return
        name = self._name

        def pre(mod, args):
            if not args:
                raise RuntimeError(f"tpx.{name}: pass the input of {type(mod).__name__} "
                                   "positionally; its placement is prepared from the positional "
                                   "arguments")
            done: Dict[int, Tensor] = {}
            out = list(args)
            for i in range(min(inputs, len(out))):
                if id(out[i]) not in done:  # q is k is v stays so (self-attention)
                    done[id(out[i])] = redistribute(out[i], src, Replicate(), pg)
                out[i] = done[id(out[i])]
            return tuple(out)

        def post(mod, args, output):
            if isinstance(output, tuple):
                return (redistribute(output[0], Replicate(), dst, pg),) + tuple(output[1:])
            return redistribute(output, Replicate(), dst, pg)

        module.register_forward_pre_hook(copied_with_module(pre))
        module.register_forward_hook(copied_with_module(post))

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
