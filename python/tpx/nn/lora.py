"""LoRA adapters (peft) on tpx's column- and row-parallel linear layers.

A LoRA layer adds ``scaling * B(A(dropout(x)))`` to a linear layer's output (``A``: ``[r, in]``,
``B``: ``[out, r]``). Under tensor parallelism the two factors follow the base layer:

=================  ====================  =====================  ===============================
base layer         ``A`` ``[r, in]``     ``B`` ``[out, r]``     the one collective
=================  ====================  =====================  ===============================
column-parallel    ``Replicate()``       ``Shard(0)`` (the      backward all-reduce of the input
(x R -> y S(-1))                         base's output rows)    gradient, which also carries the
                                                                partial gradient of ``A(x)``
row-parallel       ``Shard(1)`` (the     ``Replicate()``        forward all-reduce of the partial
(x S(-1) -> y R)   base's input columns)                        output, which also carries the
                                                                partial sums ``A_r x_r``
=================  ====================  =====================  ===============================

so the LoRA branch adds ``r`` columns to the base layer's collective and no collective of its
own (where a column layer's input needs no gradient, the base layer has no backward
all-reduce and the adapter's ``r`` columns go alone), and ``B @ A`` (what ``merge`` adds) is
already the base weight's local block. Under sequence parallelism ``A`` rides in the base
layer's all-gather / reduce-scatter GEMM as extra rows of its weight, and the factor that sees
only part of the data has its (small) gradient all-reduced; LoRA dropout is not supported there.

Both orders work:

* **peft first**: ``tpx.plans.auto(peft_model)`` names the wrapped projections; the column and
  row styles shard peft's ``lora.Linear`` by sharding its ``base_layer`` and its adapters, and
  the layer becomes a :class:`ColumnParallelLoraLinear` / :class:`RowParallelLoraLinear` (still
  a peft ``lora.Linear``: ``merge``, ``unmerge``, ``set_adapter``, ``disable_adapter`` and
  ``merge_and_unload`` are peft's own).
* **tpx first**: ``get_peft_model`` wraps tpx's layers with the same classes, with no other
  call: importing this module teaches peft's dispatch (``LoraModel._create_new_module``) tpx's
  layers (``parallelize_module`` imports it when peft is imported, or right after peft's own
  import). :func:`register` (peft's custom-module API) still works.

On the 2-D and 2.5-D layouts (tpx first) :class:`tpx.nn.multidim.lora.MeshLoraLinear` wraps
their linear layers (its factors: layers of the same layout); the 3-D layout's are refused.

Adapters are created full-sized (as on one device, from the same random stream) and each rank
keeps its part of the base layer's ``src_rank``'s draw, as tpx's layers are initialised.
Parameters are ``DTensor`` s with the placements above (a fused projection whose segments are
split separately keeps plain local tensors, described for ``tpx.checkpoint``), and
``state_dict()`` / ``load_state_dict()`` speak the unsharded adapter's names and shapes.

Saving: importing this module wraps peft's ``PeftModel.save_pretrained`` once, for models whose
layers tpx shards only: called on every rank it writes peft's files with every rank writing
its part (``tpx.checkpoint.save_adapters``). With ``state_dict=`` (a full adapter gathered by
``tpx.checkpoint.full_state_dict``), and for every other model, it is peft's own call.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from peft.tuners.lora import LoraConfig
    from peft.tuners.lora.layer import Linear as _PeftLoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
except ImportError as e:  # pragma: no cover - only imported when peft is in use
    raise ImportError("tpx.nn.lora needs peft (pip install peft)") from e

from . import lora_targets as _targets
from .. import mappings
from .. import ops
from .. import random as tpx_random
from ..comm.guard import guarded
from ..comm.groups import SharesGroupOnCopy
from ..layout.initial import load_initial, ShardSpec
from ..kept_whole import is_default_replica, replicate_kept_whole
from ..layout.sharding import KeepsParamSharding, describe_params, sharded_by_tpx, sharded_save
from ..layout.param_dtensors import local_of, local_params, read_for_input_grad, watch_params
from ..layout.dtensor_io import DTensor, Replicate, Shard, local_input
from .linear import ColumnParallelLinear, RowParallelLinear
from .multidim.linear import Linear2D, Linear3D
from .multidim.lora import MeshLoraLinear

__all__ = ["ColumnParallelLoraLinear", "MeshLoraLinear", "RowParallelLoraLinear", "register",
           "shard_lora_layer", "is_peft_layer"]


def is_peft_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer one of peft's tuners put in place of a model's module."""
    return isinstance(module, BaseTunerLayer)


class _LoraFactor(KeepsParamSharding, SharesGroupOnCopy, nn.Linear):
    """One factor (``lora_A`` or ``lora_B``) of one adapter, holding this rank's part: an
    ``nn.Linear`` (as peft expects) whose parameters are laid out as ``_shards()`` says and
    which is never called itself (the LoRA layer computes with its local tensors)."""

    _tpx_dtensor_params = True

    def __init__(self, like: nn.Linear, local_shape, layout, group, full_shape) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = full_shape[1], full_shape[0]
        factory = {"device": like.weight.device, "dtype": like.weight.dtype}
        self.weight = nn.Parameter(torch.empty(local_shape, **factory),
                                   requires_grad=like.weight.requires_grad)
        if like.bias is not None:
            n = local_shape[0]
            self.bias = nn.Parameter(torch.empty(n, **factory),
                                     requires_grad=like.bias.requires_grad)
        else:
            self.register_parameter("bias", None)
        self.group = group
        self._layout = layout  # [(name, dim, rows per rank)]: the sharded parameters

    def _shards(self):
        for name, dim, rows in self._layout:
            if getattr(self, name, None) is not None:
                yield name, dim, rows

    @guarded
    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("tpx: a sharded LoRA factor is not called on its own; the LoRA layer "
                           "that holds it computes the adapter")


def _install_save() -> None:
    """peft's ``save_pretrained`` of a model whose layers tpx shards (in either order) writes
    the adapters with every rank writing its part (``tpx.checkpoint.save_adapters``, called on
    every rank); with ``state_dict=`` (a full adapter) and on any other model it is peft's own,
    unchanged."""
    import functools
    import inspect

    from peft import PeftModel

    own = PeftModel.save_pretrained
    if getattr(own, "_tpx_wrapped", False):
        return
    signature = inspect.signature(own)

    @functools.wraps(own)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if kwargs.get("state_dict") is not None or not sharded_by_tpx(self):
            return own(self, save_directory, *args, **kwargs)
        options = dict(signature.bind(self, save_directory, *args, **kwargs).arguments)
        for name in ("self", "save_directory"):
            options.pop(name)
        options.update(options.pop("kwargs", {}))
        return sharded_save("adapters")(self, save_directory, **options)

    save_pretrained._tpx_wrapped = True
    PeftModel.save_pretrained = save_pretrained


_install_save()


def _install_dispatch() -> None:
    """peft's ``get_peft_model`` (and ``add_adapter`` / ``load_adapter``) on a model tpx
    sharded wraps tpx's column- and row-parallel layers with :class:`ColumnParallelLoraLinear`
    / :class:`RowParallelLoraLinear` with no :func:`register` step: peft's choice of the LoRA
    class for a target (``LoraModel._create_new_module``) is wrapped once to try tpx's layers
    first; a config that registers its own class for them keeps it, and every other target
    goes to peft's own dispatch, unchanged."""
    import functools

    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.model import LoraModel

    own = LoraModel._create_new_module
    if getattr(own, "_tpx_wrapped", False):
        return

    @functools.wraps(own)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        custom = getattr(lora_config, "_custom_modules", None) or {}
        if not any(isinstance(base, key) for key in custom):
            if isinstance(base, Linear2D):  # the 2-D and 2.5-D layouts
                return MeshLoraLinear(target, adapter_name, config=lora_config, **kwargs)
            if isinstance(base, Linear3D):
                raise ValueError(
                    f"tpx.nn.lora: LoRA on the {base._layout!r} layout's layers "
                    f"({type(base).__name__}) is not supported (their output layout is not "
                    "their input's); to train LoRA adapters, shard the model with the 1-D "
                    "layout (tpx.plans.auto(model), the default), the '2d' or the '2.5d'")
            for layer, cls in ((ColumnParallelLinear, ColumnParallelLoraLinear),
                               (RowParallelLinear, RowParallelLoraLinear)):
                if isinstance(base, layer):
                    return cls(target, adapter_name, config=lora_config, **kwargs)
        return own(lora_config, adapter_name, target, **kwargs)

    _create_new_module._tpx_wrapped = True
    LoraModel._create_new_module = staticmethod(_create_new_module)

    # An adapter on a module the TP plan kept whole (its weight a Replicate() DTensor, as every
    # parameter tpx keeps whole): its factors become Replicate() DTensors on the same mesh.
    update = LoraLayer.update_layer

    @functools.wraps(update)
    def update_layer(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        weight = getattr(self.get_base_layer(), "weight", None)
        if is_default_replica(weight):
            replicate_kept_whole(self, weight.device_mesh.get_group())
        return out

    LoraLayer.update_layer = update_layer


def _full(lin: nn.Linear):
    return (local_of(lin.weight).detach(),
            None if lin.bias is None else local_of(lin.bias).detach())


class _ParallelLora:
    """What the column- and row-parallel LoRA layers share: checks of what tpx supports, the
    sharding of one adapter, and peft's forward protocol."""

    _kind = ""
    _base_class: type = nn.Module

    def __init__(self, base_layer, adapter_name: str, config=None, **kwargs) -> None:
        """peft's constructor (``get_peft_model`` on a model tpx sharded, through
        :func:`register`)."""
        if not isinstance(base_layer, self._base_class):
            raise TypeError(f"tpx.{type(self).__name__} wraps a tpx."
                            f"{self._base_class.__name__}; got {type(base_layer).__name__}")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.fan_in_fan_out = False  # tpx's layer stores [out, in] whatever the model did

    # -- construction -------------------------------------------------------------------------

    def _get_in_out_features(self, module: nn.Module):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            return module.in_features, module.out_features  # the full sizes
        return super()._get_in_out_features(module)

    def _tpx_check_adapter(self, adapter: str) -> None:
        if self.use_dora.get(adapter, False):
            variant = "DoRA (use_dora=True)"
        elif adapter in getattr(self, "lora_variant", {}):
            variant = type(self.lora_variant[adapter]).__name__
        else:
            return
        raise NotImplementedError(
            f"tpx: the LoRA variant {variant} (adapter {adapter!r}) is not supported under "
            "tensor parallelism; tpx shards plain LoRA (use_dora=False, no other variant "
            "option). Nothing was changed")

    def _tpx_shard_adapter(self, adapter: str, src_rank: Optional[int]) -> None:
        """Replaces the full-sized factors of ``adapter`` (every rank's own, of which rank
        ``src_rank``'s are kept) by this rank's parts."""
        self._tpx_check_adapter(adapter)
        base = self.base_layer
        pg, rank = base.group, base.rank
        A, B = self.lora_A[adapter], self.lora_B[adapter]
        r = A.weight.shape[0]
        a_full, b_full = (r, base.in_features), (base.out_features, r)
        if tuple(local_of(A.weight).shape) != a_full or tuple(local_of(B.weight).shape) != b_full:
            raise ValueError(f"tpx: the LoRA factors of adapter {adapter!r} have the shapes "
                             f"{tuple(A.weight.shape)} and {tuple(B.weight.shape)}, not the "
                             f"full {a_full} and {b_full} of the base layer")
        if self._kind == "column":
            rows = base.out_rows
            local_b = sum(e - s for s, e in rows[rank])
            new_a = _LoraFactor(A, a_full, [], pg, a_full)
            new_b = _LoraFactor(B, (local_b, r), [("weight", 0, rows), ("bias", 0, rows)], pg,
                                b_full)
            specs = [ShardSpec(new_a.weight), ShardSpec(new_b.weight, rows, 0)]
            if new_b.bias is not None:
                specs.append(ShardSpec(new_b.bias, rows, 0))
        else:
            cols = [[c] for c in base.in_cols]  # the base layer's columns (whole heads)
            s, e = cols[rank][0]
            new_a = _LoraFactor(A, (r, e - s), [("weight", 1, cols)], pg, a_full)
            new_b = _LoraFactor(B, b_full, [], pg, b_full)
            specs = [ShardSpec(new_a.weight, cols, 1), ShardSpec(new_b.weight)]
            if new_b.bias is not None:
                specs.append(ShardSpec(new_b.bias))
        fulls = [_full(A)[0], *[t for t in _full(B) if t is not None]]
        config = dict(adapter=adapter, kind=self._kind, r=r, in_features=base.in_features,
                      out_features=base.out_features, lora_bias=B.bias is not None,
                      dtype=str(A.weight.dtype))
        load_initial(pg, f"LoRA adapter {adapter!r}", config, specs, lambda: fulls,
                     src_rank=src_rank, drawn=False)
        for f in (new_a, new_b):
            describe_params(f)
        self.lora_A[adapter], self.lora_B[adapter] = new_a, new_b

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """peft's ``update_layer`` (a new adapter: drawn full-sized, as on one device), then
        this rank keeps its part of the base layer's source rank's draw."""
        if config.use_dora or self.resolve_lora_variant(config=config) is not None:
            raise NotImplementedError(
                "tpx: this LoraConfig asks for a LoRA variant (DoRA or another) that is not "
                "supported under tensor parallelism; tpx shards plain LoRA. Nothing was changed")
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        self._tpx_shard_adapter(adapter_name, getattr(self.base_layer, "src_rank", 0))

    # -- merging ------------------------------------------------------------------------------

    def get_delta_weight(self, adapter) -> Tensor:
        """``scaling * B @ A`` for this rank's block of the base weight, in the form the base
        weight is stored (a ``DTensor`` of its placements, or its local tensor)."""
        a = local_of(self.lora_A[adapter].weight)
        b = local_of(self.lora_B[adapter].weight)
        dtype = b.dtype
        if b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            a, b = a.float(), b.float()
        delta = ((b @ a) * self.scaling[adapter]).to(dtype)
        weight = self.base_layer.weight
        if isinstance(weight, DTensor):
            return DTensor.from_local(delta, weight.device_mesh, weight.placements,
                                      run_check=False, shape=weight.shape, stride=weight.stride())
        return delta

    # -- forward ------------------------------------------------------------------------------

    def _tpx_active(self) -> List[str]:
        return [a for a in self.active_adapters if a in self.lora_A]

    @guarded
    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            raise NotImplementedError(
                "tpx: peft's mixed-adapter batches (adapter_names=...) are not supported under "
                "tensor parallelism; activate one adapter set with set_adapter() per batch")
        if args or kwargs:
            raise TypeError(f"tpx.{type(self).__name__}: unexpected arguments "
                            f"{list(kwargs) or len(args)} to a linear layer")
        if self.merged:
            return self.base_layer(x)
        active = self._tpx_active()
        if not active:
            return self.base_layer(x)
        y = self._tpx_forward(x, active)
        # The base weight and the A factors are read for the input's gradient; a B factor for
        # its input's, x A^T, which needs one when x or that A does.
        base = self.base_layer.weight
        watched = [w for w in [base] + [self.lora_A[a].weight for a in active]
                   if read_for_input_grad(x, w)]
        for a in active:
            wa, wb = self.lora_A[a].weight, self.lora_B[a].weight
            if read_for_input_grad(x if x.requires_grad else wa, wb):
                watched.append(wb)
        return watch_params(y, *watched)

    def _dropout(self, adapter: str, x: Tensor) -> Tensor:
        dtype = self.lora_A[adapter].weight.dtype
        return self.lora_dropout[adapter](self._cast_input_dtype(x, dtype))

    def __repr__(self) -> str:
        return "tpx." + nn.Module.__repr__(self)


class ColumnParallelLoraLinear(_ParallelLora, _PeftLoraLinear):
    """peft's ``lora.Linear`` over a :class:`tpx.ColumnParallelLinear`.

    Placements: ``x R -> y S(-1)`` (``y R`` with ``gather_output=True``), as the base layer.
    ``lora_A.<adapter>.weight`` ``[r, in]`` ``Replicate()``; ``lora_B.<adapter>.weight``
    ``[out, r]`` (and its bias) ``Shard(0)``, rows split as the base weight's. One all-reduce
    in backward (the base layer's, with ``r`` more columns per active adapter)."""

    _kind = "column"

    _base_class = ColumnParallelLinear

    def _tpx_forward(self, x: Tensor, active: List[str]) -> Tensor:
        base = self.base_layer
        pg = base.group
        if base.sequence_parallel:
            return self._tpx_forward_sequence_parallel(x, active)
        x = local_input(x, Replicate(), pg, type(self).__name__)
        base._check_input(x, base.in_features, "in_features")
        twin = mappings.partial_grad_input(x, pg)
        weight, bias = base._row_params(base.weight, base.bias)
        if twin is not None:
            # x was gathered from sequence shards by a plan style: the input gradients of the
            # base layer and of A are left partial and reduce-scattered once for all the
            # layers reading x; A's own gradient, a partial sum, is all-reduced (r x in).
            hs = []
            for a in active:
                (wa,) = local_params(self.lora_A[a].weight)
                hs.append(F.linear(self._dropout(a, twin), mappings.all_reduce_grad(wa, pg)))
            return self._tpx_add_lora(F.linear(twin, weight, bias), active, hs)
        # h = A(dropout(x)) on the replicated input (the replicated random stream draws the
        # same mask on every rank); each rank's B block makes its gradient a partial sum,
        # reduced with the input gradient's partial sums in one all-reduce.
        hs = []
        for a in active:
            (wa,) = local_params(self.lora_A[a].weight)
            hs.append(F.linear(self._dropout(a, x), wa))
        needs = [t for t in (x, *hs) if t.requires_grad]
        if needs and pg.size() > 1:
            reduced = iter(mappings.all_reduce_grads(needs, pg))
            x = next(reduced) if x.requires_grad else x
            hs = [next(reduced) if h.requires_grad else h for h in hs]
        return self._tpx_add_lora(F.linear(x, weight, bias), active, hs)

    def _tpx_add_lora(self, y: Tensor, active: List[str], hs: List[Tensor]) -> Tensor:
        """``y`` (this rank's output features) plus ``scaling * B_r h`` of each adapter; then
        gathered when the base layer gathers its output."""
        base = self.base_layer
        pg = base.group
        out_dtype = y.dtype
        for a, h in zip(active, hs):
            wb, bb = base._row_params(self.lora_B[a].weight, self.lora_B[a].bias)
            y = y + F.linear(h.to(wb.dtype), wb, bb) * self.scaling[a]
        y = y.to(out_dtype)
        if base.gather_output:
            y = mappings.gather_last_dim(y, base.out_sizes, base.out_start, pg)
        return y


    def _tpx_forward_sequence_parallel(self, x: Tensor, active: List[str]) -> Tensor:
        """Sequence-parallel input: ``A`` rides in the base layer's all-gather GEMM as extra
        rows of its weight (``[W_r; A] x``: the base output and ``h = A x`` on the whole
        sequence in one op), so the input gradient's reduce-scatter carries ``A``'s partial
        input gradient too; ``A``'s own gradient, a partial sum, is all-reduced (``r x in``)."""
        base = self.base_layer
        pg = base.group
        _no_dropout(self, active, "sequence parallelism")
        x = local_input(x, Shard(base.sequence_dim), pg, type(self).__name__)
        base._check_input(x, base.in_features, "in_features")
        weight, bias = base._row_params(base.weight, base.bias)
        factors = []
        for a in active:
            (wa,) = local_params(self.lora_A[a].weight)
            factors.append(mappings.all_reduce_grad(wa, pg).to(weight.dtype))
        w_cat = torch.cat([weight, *factors], 0)
        b_cat = None if bias is None else torch.cat([bias, bias.new_zeros(sum(
            f.shape[0] for f in factors))])
        _, y_cat = ops.all_gather_matmul(x, w_cat.t(), base._seq_dim(x), pg, base.chunks,
                                         bias=b_cat, return_gathered=False)
        pieces = y_cat.split([weight.shape[0], *[f.shape[0] for f in factors]], -1)
        return self._tpx_add_lora(pieces[0], active, list(pieces[1:]))


def _no_dropout(layer, active: List[str], why: str) -> None:
    for a in active:
        drop = layer.lora_dropout[a]
        if layer.training and isinstance(drop, nn.Dropout) and drop.p > 0:
            raise NotImplementedError(
                f"tpx: LoRA dropout (lora_dropout={drop.p}, adapter {a!r}) with {why} is not "
                "supported yet: the adapter rides in the base layer's GEMM, which reads the input "
                "without dropout. Use lora_dropout=0, or shard without sequence parallelism")


class RowParallelLoraLinear(_ParallelLora, _PeftLoraLinear):
    """peft's ``lora.Linear`` over a :class:`tpx.RowParallelLinear`.

    Placements: ``x S(-1) -> y R`` (``R -> R`` with ``input_is_parallel=False``), as the base
    layer. ``lora_A.<adapter>.weight`` ``[r, in]`` ``Shard(1)``, columns split as the base
    weight's; ``lora_B.<adapter>.weight`` ``[out, r]`` (and its bias) ``Replicate()``. One
    all-reduce in forward (the base layer's, with ``r`` more columns per active adapter).
    Dropout on the sharded input draws from the tensor-parallel random stream
    (``tpx.random.manual_seed``)."""

    _kind = "row"

    _base_class = RowParallelLinear

    def _tpx_forward(self, x: Tensor, active: List[str]) -> Tensor:
        base = self.base_layer
        pg = base.group
        if base.sequence_parallel:
            return self._tpx_forward_sequence_parallel(x, active)
        x = base._local_columns(x, type(self).__name__)
        weight, bias = local_params(base.weight, base.bias)
        parts = [F.linear(x, weight)]
        for a in active:
            (wa,) = local_params(self.lora_A[a].weight)
            drop = self.lora_dropout[a]
            sharded_random = (self.training and isinstance(drop, nn.Dropout) and drop.p > 0
                              and pg.size() > 1)
            with tpx_random.fork() if sharded_random else contextlib.nullcontext():
                parts.append(F.linear(self._dropout(a, x), wa))
        summed = _sum_packed(parts, pg)
        y = summed[0] if bias is None else summed[0] + bias
        out_dtype = y.dtype
        for a, h in zip(active, summed[1:]):
            wb, bb = local_params(self.lora_B[a].weight, self.lora_B[a].bias)
            y = y + F.linear(h, wb, bb) * self.scaling[a]
        return y.to(out_dtype)


    def _tpx_forward_sequence_parallel(self, x: Tensor, active: List[str]) -> Tensor:
        """Sequence-parallel output: ``A_r`` rides in the base layer's GEMM + reduce-scatter as
        extra rows of its weight (``[W_r; A_r] x_r``, summed and scattered along the sequence:
        this rank's block of the output and of ``h = A x`` in one op); ``B``, replicated, then
        sees this rank's block of the sequence only, so its gradient is all-reduced
        (``out x r``)."""
        base = self.base_layer
        pg = base.group
        _no_dropout(self, active, "sequence parallelism")
        x = base._local_columns(x, type(self).__name__)
        d = base._scatter_dim(x)
        weight, bias = local_params(base.weight, base.bias)
        factors = [local_params(self.lora_A[a].weight)[0].to(weight.dtype) for a in active]
        w_cat = torch.cat([weight, *factors], 0)
        b_cat = None if bias is None else torch.cat([bias, bias.new_zeros(sum(
            f.shape[0] for f in factors))])
        y_cat = ops.matmul_reduce_scatter(x, w_cat.t(), d, pg, base.chunks, bias=b_cat)
        pieces = y_cat.split([weight.shape[0], *[f.shape[0] for f in factors]], -1)
        y = pieces[0]
        out_dtype = y.dtype
        for a, h in zip(active, pieces[1:]):
            wb, bb = local_params(self.lora_B[a].weight, self.lora_B[a].bias)
            wb = mappings.all_reduce_grad(wb, pg)
            if bb is not None:
                bb = mappings.all_reduce_grad(bb, pg)
            y = y + F.linear(h.to(wb.dtype), wb, bb) * self.scaling[a]
        return y.to(out_dtype)


def _sum_packed(parts: List[Tensor], pg) -> List[Tensor]:
    """Each of ``parts`` (partial sums of the same leading shape) summed over ``pg`` with one
    all-reduce per dtype: concatenated along the last dim, reduced, split again."""
    if pg.size() == 1:
        return parts
    out: List[Optional[Tensor]] = [None] * len(parts)
    for dtype in dict.fromkeys(p.dtype for p in parts):
        idx = [i for i, p in enumerate(parts) if p.dtype == dtype]
        packed = torch.cat([parts[i] for i in idx], -1)
        summed = mappings.all_reduce_sum(packed, pg)
        for i, piece in zip(idx, summed.split([parts[i].shape[-1] for i in idx], -1)):
            out[i] = piece
    return out  # type: ignore[return-value]


_CLASSES = {"column": ColumnParallelLoraLinear, "row": RowParallelLoraLinear}


def register(config: "LoraConfig") -> "LoraConfig":
    """Lets peft put LoRA on tpx's layers (a model sharded by tpx before ``get_peft_model``):
    registers :class:`ColumnParallelLoraLinear` / :class:`RowParallelLoraLinear` for
    :class:`tpx.ColumnParallelLinear` / :class:`tpx.RowParallelLinear` through peft's
    custom-module API (``LoraConfig._register_custom_module``) and returns ``config``.
    ``get_peft_model(model, tpx.nn.lora.register(LoraConfig(...)))`` then wraps the targeted
    tpx layers; new adapters are drawn full-sized on every rank and each rank keeps its part of
    the base layer's source rank's draw (a collective: every rank adds the same adapters)."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"tpx.nn.lora.register: `config` must be a peft LoraConfig; got "
                        f"{type(config).__name__} (tpx shards LoRA only)")
    config._register_custom_module({ColumnParallelLinear: ColumnParallelLoraLinear,
                                    RowParallelLinear: RowParallelLoraLinear})
    return config


def shard_lora_layer(style, module: nn.Module, ctx) -> nn.Module:
    """A column or row style applied to peft's ``lora.Linear`` in ``ctx`` (the style's
    ``TPContext``): the base layer sharded by ``style``, the adapters as its placements say; returns the new layer (the module given is
    not changed). Any other peft layer raises, naming it."""
    style_name = type(style).__name__
    if type(module) is not _PeftLoraLinear:
        if isinstance(module, _ParallelLora):
            raise ValueError(f"tpx.{style_name}: this LoRA layer is sharded already")
        raise ValueError(
            f"tpx.{style_name}: the module is peft's {type(module).__module__}."
            f"{type(module).__name__}; under tensor parallelism tpx shards LoRA on linear "
            "layers (peft's lora.Linear) only. Leave this module out of the tuner's targets, "
            "or out of the TP plan")
    for adapter in module.lora_A:
        _ParallelLora._tpx_check_adapter(module, adapter)
    if module.lora_embedding_A or module.lora_magnitude_vector:
        raise ValueError(f"tpx.{style_name}: this LoRA layer holds embedding or DoRA adapters, "
                         "which tpx does not shard")
    base = module.base_layer
    if is_peft_layer(base):
        raise ValueError(f"tpx.{style_name}: nested peft layers are not supported")
    new_base = style.apply(base, ctx)
    kind = ("column" if isinstance(new_base, ColumnParallelLinear) else
            "row" if isinstance(new_base, RowParallelLinear) else None)
    if kind is None:
        raise ValueError(f"tpx.{style_name}: LoRA over a {type(new_base).__name__} is not "
                         "supported; tpx shards LoRA on column- and row-parallel linear layers")
    if getattr(module, "merged", False):
        raise ValueError(f"tpx.{style_name}: the LoRA layer has merged adapters "
                         f"{module.merged_adapters}; unmerge them (or merge_and_unload) first")
    cls = _CLASSES[kind]
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for attr in ("_parameters", "_buffers", "_modules"):
        new.__dict__[attr] = dict(module.__dict__[attr])
    new._modules["base_layer"] = new_base
    new._modules["lora_A"] = nn.ModuleDict(dict(module.lora_A.items()))
    new._modules["lora_B"] = nn.ModuleDict(dict(module.lora_B.items()))
    new.fan_in_fan_out = False
    for adapter in list(new.lora_A):
        new._tpx_shard_adapter(adapter, ctx.src_rank)
    return new


_install_dispatch()
_targets.install()  # target_modules="all-linear" names tpx's layers too
