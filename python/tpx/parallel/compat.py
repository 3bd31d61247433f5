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

import contextlib
import functools
import math
import threading
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import mappings
from .. import ops
from ..comm_groups import guarded
from .. import random as tpx_random
from ..group import (DeviceMesh, SharesGroupOnCopy, ShardSpec, load_initial, resolve_group,
                     shard_bounds)
from ..nn import RowParallelLinear
from ..nn.dtensor_io import local_input
from ..sharding import KeepsParamSharding, describe_params
from .api import become_module, check_can_become_module, parallelize_module
from .style import (ColwiseParallel as _Colwise, ParallelStyle, Replicate,
                    RowwiseParallel as _Rowwise, Shard, head_rows, apply_style, redistribute)

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
# nn.MultiheadAttention split by heads
# --------------------------------------------------------------------------------------------

def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_mha(mha: nn.Module, world: int, where: str) -> None:
    """Raises (before anything is built or changed) when ``mha`` cannot be split by heads over
    ``world`` ranks. ``where``: the module's name in the model, for the messages."""
    what = f"nn.MultiheadAttention {where!r}" if where else "the nn.MultiheadAttention"
    if isinstance(mha, ParallelMultiheadAttention):
        raise ValueError(f"tpx.PairwiseParallel: {what} is a ParallelMultiheadAttention already "
                         "(sharded by an earlier call); parallelize the unsharded model once")
    if type(mha).forward is not nn.MultiheadAttention.forward:
        raise ValueError(
            f"tpx.PairwiseParallel: {what} is a {type(mha).__name__}, a subclass of "
            "nn.MultiheadAttention with its own forward, which the sharded attention would "
            "drop; use a plain nn.MultiheadAttention or shard the module with a plan")
    h, e = mha.num_heads, mha.embed_dim
    if h % world:
        raise ValueError(
            f"tpx.PairwiseParallel: {what} has num_heads={h}, which does not divide by the TP "
            f"size {world} (each rank must hold whole heads); use a TP size that divides {h} "
            f"(one of {_divisors(h)}) or a num_heads that divides by {world}")
    expected = ({"in_proj_weight": (3 * e, e)} if mha._qkv_same_embed_dim else
                {"q_proj_weight": (e, e), "k_proj_weight": (e, mha.kdim),
                 "v_proj_weight": (e, mha.vdim)})
    if mha.in_proj_bias is not None:
        expected["in_proj_bias"] = (3 * e,)
    if (mha.bias_k is None) != (mha.bias_v is None):
        raise ValueError(f"tpx.PairwiseParallel: {what} has one of bias_k / bias_v but not the "
                         "other (nn.MultiheadAttention's add_bias_kv sets both)")
    if mha.bias_k is not None:
        expected.update(bias_k=(1, 1, e), bias_v=(1, 1, e))
    for name, shape in expected.items():
        p = getattr(mha, name)
        if p is None or tuple(p.shape) != shape:
            got = None if p is None else tuple(p.shape)
            raise ValueError(
                f"tpx.PairwiseParallel: {what}.{name} has the shape {got}, not {shape} "
                f"(embed_dim={e}, kdim={mha.kdim}, vdim={mha.vdim}): was it changed or sharded "
                "already? Shard an unmodified nn.MultiheadAttention")
    out = mha.out_proj
    if not isinstance(out, nn.Linear) or tuple(out.weight.shape) != (e, e):
        raise ValueError(f"tpx.PairwiseParallel: {what}.out_proj must be the module's own "
                         f"[{e}, {e}] nn.Linear; got {type(out).__name__}")


def _float_mask(mask: Optional[Tensor], name: str, dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True: not attended) as an additive one (-inf), as PyTorch reads it."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise ValueError(f"tpx.ParallelMultiheadAttention: `{name}` must be a bool or floating "
                         f"tensor; got {mask.dtype}")
    return mask.to(dtype)


def _dropout_stream(p: float, device: torch.device, world: int):
    """Dropout of this rank's heads draws on tpx.random's tensor-parallel stream (when it is
    seeded), so that the ranks' heads get independent masks."""
    if p > 0 and world > 1 and tpx_random.is_seeded():
        return tpx_random.fork(device)
    return contextlib.nullcontext()


def _reject_nested(module, args) -> None:
    """Forward pre-hook of :class:`ParallelMultiheadAttention`. Nested tensors come from
    ``nn.TransformerEncoder``'s inference fast path, which drops the key padding mask and
    hands the layers nested tensors; the sharded layers do not take them. Being a hook, it
    also keeps ``nn.TransformerEncoderLayer`` off its fused fast path (which it takes only
    when no module inside has hooks), which would read the sharded weights as full ones."""
    if any(isinstance(a, Tensor) and a.is_nested for a in args[:3]):
        raise RuntimeError(
            "tpx.ParallelMultiheadAttention got a nested tensor: nn.TransformerEncoder's "
            "nested-tensor fast path is on for an encoder whose attention is sharded. Apply "
            "PairwiseParallel to the encoder itself (it turns that path off), or set "
            "encoder.use_nested_tensor = False")


class ParallelMultiheadAttention(KeepsParamSharding, SharesGroupOnCopy, nn.MultiheadAttention):
    """:class:`torch.nn.MultiheadAttention` with its heads split over a tensor-parallel group
    (what :class:`PairwiseParallel` turns an ``nn.MultiheadAttention`` into).

    With ``H = num_heads`` and ``P`` ranks, rank ``r`` holds heads ``[r H/P, (r+1) H/P)``:
    their rows of each of the q, k and v segments of ``in_proj_weight`` / ``in_proj_bias``
    (concatenated q | k | v; or their rows of ``q_proj_weight`` / ``k_proj_weight`` /
    ``v_proj_weight`` when ``kdim`` / ``vdim`` differ from ``embed_dim``), their columns of
    ``bias_k`` / ``bias_v``, and their columns of ``out_proj``, a
    :class:`tpx.RowParallelLinear` whose bias is replicated and added once.

    Placement: ``query, key, value R -> attn_output R``. The projections need no
    communication forward; each rank attends over its own heads; ``out_proj`` all-reduces:
    one all-reduce forward. Backward: the input gradients are all-reduced (once for
    self-attention, where ``query is key is value``; once per distinct input tensor
    otherwise). With ``need_weights=True`` (PyTorch's default) the attention weights of the
    heads are all-gathered (an extra collective of ``N x H x L x S`` numbers) and returned
    replicated, averaged over the heads unless ``average_attn_weights=False``, as PyTorch
    returns them; pass ``need_weights=False`` when they are not used. A ``DTensor`` input is
    redistributed to ``Replicate()`` first.

    Masks are PyTorch's: ``attn_mask`` ``[L, S]`` or ``[N * H, L, S]`` (each rank keeps its
    heads' slices), ``key_padding_mask`` ``[N, S]``, boolean or additive; ``is_causal`` as in
    PyTorch. ``num_heads`` stays the model's head count; ``local_num_heads`` is this rank's.
    Attention dropout (training, ``dropout > 0``) draws on ``tpx.random``'s tensor-parallel
    stream when ``tpx.random.manual_seed`` was called (the ranks' heads get independent
    masks); otherwise on the default generator.

    The state dict has ``nn.MultiheadAttention``'s keys, each tensor this rank's part;
    :func:`tpx.checkpoint.full_state_dict` gathers the unsharded module's tensors and
    :func:`tpx.checkpoint.load_full_state_dict` slices them back.

    Args:
        mha: the ``nn.MultiheadAttention`` to shard (every rank holds it whole; the weights
            of rank ``src_rank`` are used, as in :meth:`tpx.ColumnParallelLinear.from_linear`).
        group: ``None`` (default group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        src_rank: the rank whose weights every rank takes (default 0); ``None``: each rank
            keeps its part of its own module (which must be equal on every rank, checked).
    """

    def __init__(self, mha: nn.MultiheadAttention, group=None, *,
                 src_rank: Optional[int] = 0) -> None:
        pg = resolve_group(group)
        world, rank = pg.size(), dist.get_rank(pg)
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"tpx.ParallelMultiheadAttention expects an nn.MultiheadAttention; "
                            f"got {type(mha).__name__}")
        _check_mha(mha, world, "")
        nn.Module.__init__(self)  # not MultiheadAttention's: it would allocate full weights
        e, h = mha.embed_dim, mha.num_heads
        self.group, self.world_size, self.rank, self.src_rank = pg, world, rank, src_rank
        self.embed_dim, self.kdim, self.vdim = e, mha.kdim, mha.vdim
        self._qkv_same_embed_dim = mha._qkv_same_embed_dim
        self.num_heads, self.head_dim = h, mha.head_dim
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        self.add_zero_attn = mha.add_zero_attn
        self.local_num_heads = h // world
        self.head_start = rank * self.local_num_heads
        # Per rank, the rows it holds of a [q | k | v] projection and of one of them.
        self._rows_qkv = head_rows((e, e, e), self.head_dim, False, world)
        self._rows_one = head_rows((e,), self.head_dim, False, world)
        assert self._rows_one == [[shard_bounds(e, r, world)] for r in range(world)]
        factory = {"device": mha.out_proj.weight.device, "dtype": mha.out_proj.weight.dtype}
        specs, fulls = [], []

        def add(name: str, rows, dim: int) -> None:
            source = getattr(mha, name)
            if source is None:
                self.register_parameter(name, None)
                return
            shape = list(source.shape)
            shape[dim] = sum(b - a for a, b in rows[rank])
            param = nn.Parameter(torch.empty(shape, **factory),
                                 requires_grad=source.requires_grad)
            self.register_parameter(name, param)
            specs.append(ShardSpec(param, rows, dim))
            fulls.append(source)

        add("in_proj_weight", self._rows_qkv, 0)
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            add(name, self._rows_one, 0)
        add("in_proj_bias", self._rows_qkv, 0)
        add("bias_k", self._rows_one, 2)
        add("bias_v", self._rows_one, 2)
        config = dict(embed_dim=e, num_heads=h, kdim=self.kdim, vdim=self.vdim,
                      bias=mha.in_proj_bias is not None, add_bias_kv=mha.bias_k is not None,
                      add_zero_attn=self.add_zero_attn, dropout=self.dropout,
                      batch_first=self.batch_first, dtype=str(factory["dtype"]))
        load_initial(pg, "ParallelMultiheadAttention", config, specs, lambda: fulls,
                     src_rank=src_rank, drawn=False)
        out = mha.out_proj
        self.out_proj = RowParallelLinear(
            e, e, bias=out.bias is not None, group=pg, input_is_parallel=True,
            src_rank=src_rank, _full_weights=(out.weight, out.bias), **factory)
        self.out_proj.weight.requires_grad_(out.weight.requires_grad)
        if out.bias is not None:
            self.out_proj.bias.requires_grad_(out.bias.requires_grad)
        describe_params(self)
        self.train(mha.training)
        self.register_forward_pre_hook(_reject_nested)

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """The fused fast paths of PyTorch's transformer layers call this before they read the
        weights as full matrices; a sharded attention never takes them."""
        raise RuntimeError(
            "tpx.ParallelMultiheadAttention: a fused PyTorch fast path (the transformer layer "
            "kernel) was about to run on sharded weights. Apply PairwiseParallel to the "
            "enclosing layer or encoder (it turns the fast path off), or call "
            "torch.backends.mha.set_fastpath_enabled(False)")

    def _shards(self):
        """(parameter name, sharded dim, per rank the ranges of the full tensor it holds)."""
        if self._qkv_same_embed_dim:
            yield "in_proj_weight", 0, self._rows_qkv
        else:
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                yield name, 0, self._rows_one
        if self.in_proj_bias is not None:
            yield "in_proj_bias", 0, self._rows_qkv
        if self.bias_k is not None:
            yield "bias_k", 2, self._rows_one
            yield "bias_v", 2, self._rows_one

    def _project(self, xq: Tensor, xk: Tensor, xv: Tensor, same_qkv: bool,
                 same_kv: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """This rank's heads of q, k and v: ``x R -> S(-1)`` (the input gradients are
        all-reduced in backward)."""
        n = self.local_num_heads * self.head_dim
        pg = self.group

        def proj(x, w, b):
            return ops.replicated_matmul(x, w.t(), pg, bias=b)

        b = self.in_proj_bias
        bq, bk, bv = b.split(n) if b is not None else (None, None, None)
        if not self._qkv_same_embed_dim:
            return (proj(xq, self.q_proj_weight, bq), proj(xk, self.k_proj_weight, bk),
                    proj(xv, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if same_qkv:
            return proj(xq, w, b).split(n, dim=-1)
        q = proj(xq, w[:n], bq)
        if same_kv:
            k, v = proj(xk, w[n:], None if b is None else b[n:]).split(n, dim=-1)
            return q, k, v
        return q, proj(xk, w[n:2 * n], bk), proj(xv, w[2 * n:], bv)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        name = "tpx.ParallelMultiheadAttention"
        for arg, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: `{arg}` must be a Tensor; got {type(t).__name__}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{name}: query, key and value must all be 3-D (batched) or 2-D "
                             f"(unbatched); got {query.dim()}-D, {key.dim()}-D and "
                             f"{value.dim()}-D")
        for arg, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if t.shape[-1] != width:
                raise ValueError(f"{name}: {arg}.shape[-1] must be {width}; got {arg} of shape "
                                 f"{tuple(t.shape)}")
        ref = self.out_proj.weight
        autocast = torch.is_autocast_enabled(ref.device.type)  # the GEMMs cast both
        for arg, t in (("query", query), ("key", key), ("value", value)):
            if (t.dtype != ref.dtype and not autocast) or t.device != ref.device:
                raise ValueError(f"{name}: {arg} is {t.dtype} on {t.device} but the weights are "
                                 f"{ref.dtype} on {ref.device}; convert one of them")

    def _masks(self, attn_mask, key_padding_mask, n: int, tgt: int, src: int, unbatched: bool,
               dtype) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(attn_mask as [1 or N, this rank's heads or 1, L, S], key_padding_mask as
        [N, 1, 1, S]), additive, or None."""
        name = "tpx.ParallelMultiheadAttention"
        kpm = _float_mask(key_padding_mask, "key_padding_mask", dtype)
        if kpm is not None:
            want = (src,) if unbatched else (n, src)
            if tuple(kpm.shape) != want:
                raise ValueError(f"{name}: key_padding_mask must have the shape {want}; got "
                                 f"{tuple(kpm.shape)}")
            kpm = kpm.reshape(n, 1, 1, src)
        mask = _float_mask(attn_mask, "attn_mask", dtype)
        if mask is not None:
            h, mine = self.num_heads, slice(self.head_start,
                                            self.head_start + self.local_num_heads)
            if mask.dim() == 2:
                if tuple(mask.shape) != (tgt, src):
                    raise ValueError(f"{name}: the 2-D attn_mask must have the shape "
                                     f"{(tgt, src)}; got {tuple(mask.shape)}")
                mask = mask.view(1, 1, tgt, src)
            elif mask.dim() == 3:
                if tuple(mask.shape) != (n * h, tgt, src):
                    raise ValueError(f"{name}: the 3-D attn_mask must have the shape "
                                     f"{(n * h, tgt, src)} (batch * num_heads, L, S); got "
                                     f"{tuple(mask.shape)}")
                mask = mask.view(n, h, tgt, src)[:, mine]
            else:
                raise ValueError(f"{name}: attn_mask must be 2-D or 3-D; got {mask.dim()}-D")
        return mask, kpm

    @guarded
    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """As :meth:`torch.nn.MultiheadAttention.forward`. Placement: ``query, key, value R
        -> attn_output R``, attention weights ``R`` (gathered) or ``None``."""
        pg = self.group
        same_qk, same_kv = key is query, value is key
        query = local_input(query, Replicate(), pg, "ParallelMultiheadAttention")
        key = query if same_qk else local_input(key, Replicate(), pg,
                                                "ParallelMultiheadAttention")
        value = key if same_kv else local_input(value, Replicate(), pg,
                                                "ParallelMultiheadAttention")
        self._check_inputs(query, key, value)
        unbatched = query.dim() == 2

        def batch_major(x):
            if unbatched:
                return x.unsqueeze(0)
            return x if self.batch_first else x.transpose(0, 1)

        xq = batch_major(query)
        xk = xq if same_qk else batch_major(key)
        xv = xk if same_kv else batch_major(value)
        n, tgt = xq.shape[0], xq.shape[1]
        src = xk.shape[1]
        if xk.shape[:2] != xv.shape[:2] or xk.shape[0] != n:
            raise ValueError("tpx.ParallelMultiheadAttention: query, key and value must have the "
                             "same batch size, and key and value the same length; got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if is_causal and attn_mask is None:
            raise RuntimeError("tpx.ParallelMultiheadAttention: is_causal=True needs attn_mask "
                               "(the causal mask it hints at), as in PyTorch; "
                               "nn.Transformer.generate_square_subsequent_mask makes one")
        q, k, v = self._project(xq, xk, xv, same_qk and same_kv, same_kv)
        # Masks in the dtype of q (which autocast may have lowered).
        mask, kpm = self._masks(attn_mask, key_padding_mask, n, tgt, src, unbatched, q.dtype)
        causal = False
        if is_causal and kpm is None and not need_weights:
            mask, causal = None, True
        heads, hd = self.local_num_heads, self.head_dim
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, heads * hd)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, heads * hd)], dim=1)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        q = q.reshape(n, tgt, heads, hd).transpose(1, 2)
        k = k.reshape(n, k.shape[1], heads, hd).transpose(1, 2)
        v = v.reshape(n, v.shape[1], heads, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, heads, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(n, heads, 1, hd)], dim=2)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if kpm is not None:
            mask = kpm if mask is None else mask + kpm
        p = self.dropout if self.training else 0.0
        weights = None
        with _dropout_stream(p, q.device, self.world_size):
            if need_weights:
                scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-2, -1))
                if mask is not None:
                    scores = scores + mask
                weights = torch.softmax(scores, dim=-1)
                if p > 0:
                    weights = F.dropout(weights, p=p)
                out = torch.matmul(weights, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                     is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(n, tgt, heads * hd))
        if need_weights:
            # Every rank's heads, in order: [N, H, L, S] replicated.
            weights = mappings.gather_dim(weights, 1, [heads] * self.world_size,
                                              self.head_start, pg)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads} (local "
                f"{self.head_start}:{self.head_start + self.local_num_heads}), "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}, "
                f"dropout={self.dropout}, world_size={self.world_size}")


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
    module.register_forward_pre_hook(_fastpath_off)
    module.register_forward_hook(_fastpath_back, always_call=True)
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

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


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

    def apply(self, module: nn.Module, pg: dist.ProcessGroup,
              src_rank: Optional[int] = 0) -> nn.Module:
        """Shards ``module``; returns it (an ``nn.MultiheadAttention`` given directly: the
        :class:`ParallelMultiheadAttention` replacing it, which ``parallelize_module`` turns
        the given object into). Everything is checked before anything is changed."""
        world = pg.size()
        if isinstance(module, nn.MultiheadAttention):
            _check_mha(module, world, "")
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
            _check_mha(mha, world, path)
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
                         .apply(col, pg, src_rank)))
            work.append((r_path, row, _LegacyLinear(False, Shard(-1), last_out, self._name)
                         .apply(row, pg, src_rank)))
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

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

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
