"""Mamba mixers split over the TP group: Mamba-2's by heads (:class:`Mamba2Parallel`),
Mamba-1's by channels (:class:`Mamba1Parallel`, at the end of this file).

The mixer of Mamba-2 and of the hybrids built on it (Bamba, Falcon-H1, Nemotron-H,
GraniteMoE-hybrid, Zamba 2; transformers names them ``*Mixer``) projects the hidden states
once, ``in_proj -> [z | x | B | C | dt]``, runs a depthwise causal convolution over
``[x | B | C]``, a selective scan per head (``H`` heads of ``head_dim`` features reading one of
``n_groups`` groups of ``B``/``C``, ``ssm_state_size`` each), the gated norm of
``tpx.nn.ssm``, and ``out_proj``. Split by heads, every part a rank computes is its own:

* ``in_proj`` a column-parallel layer holding this rank's rows of ``z``, ``x`` and ``dt`` (its
  heads) and of ``B`` and ``C`` (the groups its heads read, on several ranks where there are
  fewer groups than ranks: their gradients summed over the ranks holding them);
* the convolution's channels, ``A_log``, ``D``, ``dt_bias`` and the norm's weight: this
  rank's rows (``x`` by heads, ``B``/``C`` by groups, the per-head vectors by heads);
* ``out_proj`` row-parallel over this rank's features (one all-reduce, as attention's output);
* the mixer's own sizes (``intermediate_size``, ``num_heads``, ``n_groups``, ``conv_dim``)
  set to this rank's, so its own forward runs on the local tensors unchanged.

Heads are dealt as :func:`tpx.comm.groups.head_split` deals attention heads over their KV
heads (groups play the KV heads): counts that do not divide the TP size give blocks that
differ by one head. A fused kernel that computes the whole mixer from its weights in one call
(``mamba_ssm``'s ``mamba_split_conv1d_scan_combined``) would read the local weights as the
whole ones; a call that skips the row-parallel output projection raises instead of returning
what it computed.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import mappings
from ..comm.groups import balanced_bounds, copied_with_module, head_split
from ..layout.initial import shard_in_place
from ..layout.sharding import describe_params
from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..nn.ssm import GatedRMSNormParallel
from .style import ParallelStyle, TPContext

__all__ = ["Mamba1Parallel", "Mamba2Parallel", "is_mamba1_mixer", "is_mamba2_mixer",
           "mamba2_rows", "column_linear", "row_linear"]

_PARTS = ("in_proj", "out_proj", "conv1d", "A_log", "D", "dt_bias")
_SIZES = ("intermediate_size", "conv_dim", "num_heads", "n_groups", "ssm_state_size",
          "head_dim")

Ranges = List[Tuple[int, int]]


def is_mamba2_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has a Mamba-2 mixer's parts and sizes (module docstring)."""
    return (all(hasattr(module, a) for a in _PARTS + _SIZES)
            and isinstance(module.in_proj, nn.Linear) and isinstance(module.out_proj, nn.Linear)
            and isinstance(module.conv1d, nn.Conv1d)
            and module.conv1d.groups == module.conv1d.in_channels)


def _sizes(module: nn.Module) -> Tuple[int, int, int, int, int]:
    """``(I, H, G, N, head_dim)``, checked against the parts' shapes."""
    what = f"tpx.Mamba2Parallel on {type(module).__name__}"
    if not is_mamba2_mixer(module):
        raise ValueError(f"{what}: not a Mamba-2 mixer (it needs {', '.join(_PARTS)}, a "
                         f"depthwise Conv1d and the sizes {', '.join(_SIZES)})")
    i, h, g, n, hd = (int(getattr(module, a)) for a in ("intermediate_size", "num_heads",
                                                       "n_groups", "ssm_state_size",
                                                       "head_dim"))
    conv = i + 2 * g * n
    checks = [(h * hd == i, f"num_heads * head_dim = {h * hd}, not intermediate_size {i}"),
              (module.conv_dim == conv, f"conv_dim {module.conv_dim}, not I + 2 G N = {conv}"),
              (module.in_proj.out_features == i + conv + h,
               f"in_proj has {module.in_proj.out_features} outputs, not 2 I + 2 G N + H = "
               f"{i + conv + h}"),
              (module.out_proj.in_features == i, f"out_proj reads {module.out_proj.in_features} "
               f"features, not {i}"),
              (module.conv1d.in_channels == conv, f"conv1d has {module.conv1d.in_channels} "
               f"channels, not {conv}")]
    checks += [(tuple(getattr(module, p).shape) == (h,), f"{p} has shape "
                f"{tuple(getattr(module, p).shape)}, not ({h},)") for p in ("A_log", "D",
                                                                          "dt_bias")]
    bad = [why for ok, why in checks if not ok]
    if bad:
        raise ValueError(f"{what}: the mixer's sizes do not fit its parts: {'; '.join(bad)}")
    return i, h, g, n, hd


def mamba2_rows(module: nn.Module, world: int) -> dict:
    """Per rank, the rows of each part it holds: ``in_proj`` (rows of its weight), ``conv``
    (channels), ``heads`` (of ``A_log``, ``D``, ``dt_bias``), ``features`` (of ``z``/``x``:
    the norm's weight, ``out_proj``'s input columns) and ``groups`` (first, end).
    ``ValueError`` (before anything changes) where the heads cannot be dealt."""
    i, h, g, n, hd = _sizes(module)
    try:
        split = head_split(h, g, world)
    except ValueError as e:
        raise ValueError(f"tpx.Mamba2Parallel on {type(module).__name__}: {h} heads in {g} "
                         f"groups at TP size {world}: {e}") from None
    out = dict(in_proj=[], conv=[], heads=[], features=[], groups=[])
    for (h0, h1), (g0, g1) in split:
        f = (h0 * hd, h1 * hd)
        b = (g0 * n, g1 * n)
        out["in_proj"].append([f, (i + f[0], i + f[1]), (2 * i + b[0], 2 * i + b[1]),
                               (2 * i + g * n + b[0], 2 * i + g * n + b[1]),
                               (2 * i + 2 * g * n + h0, 2 * i + 2 * g * n + h1)])
        out["conv"].append([f, (i + b[0], i + b[1]), (i + g * n + b[0], i + g * n + b[1])])
        out["heads"].append([(h0, h1)])
        out["features"].append(f)
        out["groups"].append((g0, g1))
    return out


class Mamba2Parallel(ParallelStyle):
    """A Mamba-2 mixer split by heads over the TP group (module docstring).

    Placement: input ``R`` (its gradient summed over the group), output ``R`` (the
    row-parallel ``out_proj``'s all-reduce); parameters this rank's rows (plain tensors
    described for ``tpx.checkpoint``: ``in_proj`` and the convolution hold segments along
    dim 0, which no ``DTensor`` placement states)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        world, rank = pg.size(), dist.get_rank(pg)
        rows = mamba2_rows(module, world)  # raises before anything changes
        norm = getattr(module, "norm", None)
        if isinstance(norm, nn.Identity):  # Falcon-H1 without its norm (mamba_rms_norm=False)
            norm = None
        if norm is not None and not (hasattr(norm, "group_size") or (
                hasattr(norm, "n_groups") and hasattr(norm, "norm_before_gate"))):
            raise ValueError(f"tpx.Mamba2Parallel on {type(module).__name__}: its norm "
                             f"{type(norm).__name__} is not a gated RMS norm tpx knows")
        i, h, g, n, hd = _sizes(module)
        what = f"Mamba2Parallel({type(module).__name__})"
        module.in_proj = column_linear(module.in_proj, rows["in_proj"], ctx)
        module.out_proj = row_linear(module.out_proj, rows["features"], ctx)
        conv_rows, head_rows = rows["conv"], rows["heads"]
        conv = module.conv1d
        shard_in_place(conv, [("weight", 0, conv_rows)] + (
            [("bias", 0, conv_rows)] if conv.bias is not None else []), pg, ctx.src_rank, what,
            dict(heads=h, groups=g, state=n, head_dim=hd, part="conv1d"))
        shard_in_place(module, [(p, 0, head_rows) for p in ("A_log", "D", "dt_bias")], pg,
                       ctx.src_rank, what, dict(heads=h, part="heads"))
        local_conv = sum(e - s for s, e in conv_rows[rank])
        conv.in_channels = conv.out_channels = conv.groups = local_conv
        conv.group = pg
        names = tuple(n for n in ("weight", "bias") if getattr(conv, n) is not None)
        conv._shards = lambda rows=conv_rows, names=names: [(n, 0, rows) for n in names]
        module.group = pg
        module._shards = lambda rows=head_rows: [(p, 0, rows) for p in ("A_log", "D", "dt_bias")]
        describe_params(conv)
        describe_params(module)
        if norm is not None:
            module.norm = _norm(norm, rows["features"], i, g, ctx, what)
        mup = module._buffers.get("mup_vector")  # Falcon-H1: a multiplier per in_proj row
        mup_rows = rows["in_proj"][rank] if isinstance(mup, torch.Tensor) and \
            mup.shape[-1] == i + module.conv_dim + h else None
        h0, h1 = head_rows[rank][0]
        g0, g1 = rows["groups"][rank]
        module.intermediate_size, module.num_heads, module.n_groups = (h1 - h0) * hd, h1 - h0, \
            g1 - g0
        module.conv_dim = local_conv
        if hasattr(module, "groups_time_state_size"):  # Falcon-H1
            module.groups_time_state_size = (g1 - g0) * n
        if world > 1:
            _install_hooks(module, conv_rows, pg, g < world, mup_rows)
        return module

    def __repr__(self) -> str:
        return "Mamba2Parallel()"


def column_linear(linear: nn.Linear, out_rows, ctx: TPContext) -> ColumnParallelLinear:
    """``linear`` as a :class:`tpx.ColumnParallelLinear` holding the rows ``out_rows[rank]``."""
    return ColumnParallelLinear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, group=ctx.group,
        device=linear.weight.device, dtype=linear.weight.dtype, out_rows=out_rows,
        src_rank=ctx.src_rank, _full_weights=(linear.weight, linear.bias))


def row_linear(linear: nn.Linear, cols, ctx: TPContext) -> RowParallelLinear:
    """``linear`` as a :class:`tpx.RowParallelLinear` holding the columns ``cols[rank]``."""
    return RowParallelLinear(
        linear.in_features, linear.out_features, bias=linear.bias is not None, group=ctx.group,
        device=linear.weight.device, dtype=linear.weight.dtype, in_cols=cols,
        src_rank=ctx.src_rank, _full_weights=(linear.weight, linear.bias))


def _norm(norm: nn.Module, cols, features: int, groups: int, ctx: TPContext,
          what: str) -> GatedRMSNormParallel:
    """The mixer's gated norm as a :class:`GatedRMSNormParallel` over this rank's features."""
    pg = ctx.group
    falcon = not hasattr(norm, "group_size")
    group_size = (features // norm.n_groups) if falcon else int(norm.group_size)
    shard_in_place(norm, [("weight", 0, [[c] for c in cols])], pg, ctx.src_rank, what,
                   dict(features=features, group_size=group_size, part="norm"))
    new = GatedRMSNormParallel(
        norm.weight, cols=cols, features=features, group_size=group_size,
        eps=float(norm.variance_epsilon), group=pg,
        norm_before_gate=bool(getattr(norm, "norm_before_gate", False)) if falcon else False,
        cast_before_weight=not falcon)
    describe_params(new)
    return new


def _install_hooks(module: nn.Module, conv_rows, pg: dist.ProcessGroup,
                   shared_groups: bool, mup_rows) -> None:
    """The convolution's ``B``/``C`` channels held by several ranks get their gradients summed
    over them in the backward (each rank's heads saw its own part); Falcon-H1's full
    ``mup_vector`` (a buffer transformers sets whole) is read as this rank's rows; a forward
    that never ran ``out_proj`` (a fused kernel on the local weights) is refused. The input's
    gradient is summed by the column-parallel ``in_proj``, its only reader."""
    calls: list = []  # per call in flight: [out_proj ran, the convolution's own parameters]

    def pre(mod, args):
        conv = mod.conv1d
        saved = {k: v for k, v in conv._parameters.items() if v is not None}
        calls.append([False, saved, mod._buffers.get("mup_vector")])
        if shared_groups and torch.is_grad_enabled():
            for name, p in saved.items():
                conv._parameters[name] = mappings.sum_grad_over_holders(p, conv_rows, pg)
        if mup_rows is not None:
            full = mod._buffers["mup_vector"]
            mod._buffers["mup_vector"] = torch.cat([full[..., s:e] for s, e in mup_rows], -1)

    def ran_out_proj(mod, args):
        if calls:
            calls[-1][0] = True

    def post(mod, args, out):
        ran, saved, mup = calls.pop() if calls else (True, {}, None)
        mod.conv1d._parameters.update(saved)
        if mup is not None:
            mod._buffers["mup_vector"] = mup
        if not ran and out is not None:  # (None: the forward raised; that error stands)
            raise RuntimeError(
                f"tpx.Mamba2Parallel: {type(mod).__name__}'s forward returned without calling "
                "its out_proj: a fused kernel (mamba_ssm's mamba_split_conv1d_scan_combined) "
                "computed the mixer on this rank's weights as if they were the whole ones. "
                "Uninstall mamba_ssm, or run the mixer in eval mode or with a cache, which take "
                "the step-by-step path")
        return None

    module.register_forward_pre_hook(copied_with_module(pre))
    module.out_proj.register_forward_pre_hook(copied_with_module(ran_out_proj))
    module.register_forward_hook(copied_with_module(post), always_call=True)


def _ran_out_proj_check(module: nn.Module, style: str, pre=None, post=None) -> None:
    """Refuses a forward of the mixer that returns without calling its row-parallel
    ``out_proj`` (a fused kernel computing the mixer on this rank's weights as whole ones);
    ``pre`` / ``post`` run around each call too."""
    calls: list = []

    def before(mod, args):
        calls.append(False)
        if pre is not None:
            pre(mod)

    def ran(mod, args):
        if calls:
            calls[-1] = True

    def after(mod, args, out):
        ran_it = calls.pop() if calls else True
        if post is not None:
            post(mod)
        if not ran_it and out is not None:
            raise RuntimeError(
                f"tpx.{style}: {type(mod).__name__}'s forward returned without calling its "
                "out_proj: a fused kernel (mamba_ssm's mamba_inner_fn) computed the mixer on "
                "this rank's weights as if they were the whole ones. Uninstall mamba_ssm, or "
                "run the mixer in eval mode or with a cache, which take the step-by-step path")
        return None

    module.register_forward_pre_hook(copied_with_module(before))
    module.out_proj.register_forward_pre_hook(copied_with_module(ran))
    module.register_forward_hook(copied_with_module(after), always_call=True)


# ------------------------------------------------------------------ Mamba-1

_PARTS1 = ("in_proj", "x_proj", "dt_proj", "out_proj", "conv1d", "A_log", "D")
_SIZES1 = ("intermediate_size", "time_step_rank", "ssm_state_size")
_NORMS1 = ("dt_layernorm", "b_layernorm", "c_layernorm")  # Jamba's, over x_proj's outputs


def is_mamba1_mixer(module: nn.Module) -> bool:
    """Whether ``module`` has a Mamba-1 mixer's parts (Mamba's, Falcon-Mamba's, Jamba's):
    ``in_proj -> [x | z]``, a depthwise ``conv1d`` over ``x``, ``x_proj -> [dt | B | C]``,
    ``dt_proj``, ``A_log`` ``[I, N]``, ``D`` ``[I]`` and ``out_proj``, of consistent sizes."""
    if not all(hasattr(module, a) for a in _PARTS1 + _SIZES1):
        return False
    lin = [getattr(module, a) for a in ("in_proj", "x_proj", "dt_proj", "out_proj")]
    if not all(type(m) is nn.Linear for m in lin) or not isinstance(module.conv1d, nn.Conv1d):
        return False
    i, r, n = (int(getattr(module, a)) for a in _SIZES1)
    return (module.in_proj.out_features == 2 * i and module.x_proj.in_features == i
            and module.x_proj.out_features == r + 2 * n and module.dt_proj.in_features == r
            and module.dt_proj.out_features == i and module.out_proj.in_features == i
            and module.conv1d.groups == module.conv1d.in_channels == i
            and tuple(module.A_log.shape) == (i, n) and tuple(module.D.shape) == (i,))


class Mamba1Parallel(ParallelStyle):
    """A Mamba-1 mixer split by channels over the TP group, as Megatron-Core and vLLM split
    it: this rank's channels ``c`` (``I`` dealt as evenly as they go) of

    * ``in_proj`` (column-parallel: rows ``c`` of ``x`` and of ``z``), the depthwise
      ``conv1d``, ``dt_proj`` (its rows), ``A_log`` and ``D``;
    * ``x_proj`` row-parallel over them: its small output ``[dt | B | C]`` is summed over the
      group (one all-reduce of ``r + 2N`` features) and, read by every rank's channels, has
      its gradient summed too; Jamba's norms over it stay whole, their gradients summed;
    * ``out_proj`` row-parallel (one all-reduce, as attention's output).

    The mixer's ``intermediate_size`` is set to this rank's, so its own forward runs on the
    local tensors. Placement: input ``R`` (gradient summed by ``in_proj``), output ``R``;
    the parameters this rank's rows (plain tensors described for ``tpx.checkpoint``)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        from .module_styles import ReplicatedWithGradAllReduce
        from .base import apply_style

        what = f"Mamba1Parallel({type(module).__name__})"
        if not is_mamba1_mixer(module):
            raise ValueError(f"tpx.{what}: not a Mamba-1 mixer (it needs {', '.join(_PARTS1)} "
                             "of consistent sizes)")
        pg = ctx.group
        world, rank = pg.size(), dist.get_rank(pg)
        i = int(module.intermediate_size)
        if i < world:
            raise ValueError(f"tpx.{what}: {i} channels at TP size {world}: use a TP size of "
                             f"at most {i}")
        chans = [balanced_bounds(i, r, world) for r in range(world)]
        rows = [[c] for c in chans]
        module.in_proj = column_linear(module.in_proj, [[c, (i + c[0], i + c[1])] for c in chans],
                                       ctx)
        module.x_proj = row_linear(module.x_proj, chans, ctx)
        module.out_proj = row_linear(module.out_proj, chans, ctx)
        conv, dt = module.conv1d, module.dt_proj
        for mod, names, part in ((conv, ("weight", "bias"), "conv1d"),
                                 (dt, ("weight", "bias"), "dt_proj"),
                                 (module, ("A_log", "D"), "channels")):
            held = tuple(n for n in names if getattr(mod, n, None) is not None)
            shard_in_place(mod, [(n, 0, rows) for n in held], pg, ctx.src_rank, what,
                           dict(channels=i, part=part))
            mod.group = pg
            mod._shards = lambda rows=rows, held=held: [(n, 0, rows) for n in held]
            describe_params(mod)
        local = chans[rank][1] - chans[rank][0]
        conv.in_channels = conv.out_channels = conv.groups = local
        dt.out_features = local
        module.intermediate_size = local
        for name in _NORMS1:
            norm = getattr(module, name, None)
            if isinstance(norm, nn.Module) and any(True for _ in norm.parameters()):
                apply_style(ReplicatedWithGradAllReduce(), getattr(module, name), ctx)
        if world > 1:
            # [dt | B | C], whole on every rank after x_proj's all-reduce, is read by this
            # rank's channels only: its gradient is summed over the group
            module.x_proj.register_forward_hook(copied_with_module(
                lambda mod, args, out, pg=pg: mappings.all_reduce_grad(out, pg)))
            _ran_out_proj_check(module, "Mamba1Parallel")
        return module

    def __repr__(self) -> str:
        return "Mamba1Parallel()"
