"""What every parallel style shares: the :class:`TPContext` a style is applied with, the
:class:`ParallelStyle` base (one interface, ``apply(module, ctx)``), how a style is applied
(PyTorch's through PyTorch's own implementation), the placement checks, and
:func:`redistribute` (a tensor moved between R and S(d) at a module boundary)."""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Dict, Optional

import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm.guard import guarded
from ..comm.groups import mesh_for_group, resolve_group, shard_bounds, shard_sizes
from ..mesh import check_mesh, mesh_layout
from ..layout.dtensor_io import DTensor, Partial, Replicate, Shard, gathered_local, wrap_output

__all__ = ["ParallelStyle", "TPContext", "apply_style", "check_placement", "is_style",
           "redistribute", "torch_style"]

MESH_LAYOUTS = ("2d", "2.5d", "3d")


class TPContext:
    """What a style is applied with (``parallelize_module`` builds it once per call).

    ``group``: the TP process group (over a multi-dimensional mesh: all of its ranks).
    ``mesh``: the ``DeviceMesh`` given (a 1-D mesh over ``group``, a 2-D / 2.5-D / 3-D mesh
    from ``tpx.init_mesh``), or None when a process group was given. ``src_rank``: the rank
    of ``group`` whose module supplies the weights (None: every rank keeps its own).
    ``layout``: ``"1d"``, or the mesh's ``"2d"`` / ``"2.5d"`` / ``"3d"``.

    The group of a 1-D context is resolved when it is first read: a style that refuses its
    module does so before it needs the group."""

    __slots__ = ("_group", "_target", "mesh", "src_rank", "layout")

    def __init__(self, group=None, mesh=None, src_rank: Optional[int] = 0,
                 layout: str = "1d") -> None:
        self._group = group if isinstance(group, dist.ProcessGroup) else None
        self._target = group
        self.mesh, self.src_rank, self.layout = mesh, src_rank, layout

    @classmethod
    def of(cls, target=None, src_rank: Optional[int] = 0) -> "TPContext":
        """The context over ``target``: a ``TPContext`` (returned as it is), ``None`` (the
        default group), a ``ProcessGroup``, or a ``DeviceMesh`` (1-D, or a mesh from
        ``tpx.init_mesh``)."""
        if isinstance(target, TPContext):
            return target
        layout = mesh_layout(target) if hasattr(target, "mesh_dim_names") else None
        if layout in MESH_LAYOUTS:
            resolve_group(None)  # the same error as elsewhere when torch.distributed is not up
            return cls(_all_ranks_group(target, layout), target, src_rank, layout)
        mesh = target if getattr(target, "ndim", None) == 1 else None
        return cls(target, mesh, src_rank, "1d")

    @property
    def group(self) -> dist.ProcessGroup:
        if self._group is None:
            self._group = resolve_group(self._target)
        return self._group

    @property
    def world(self) -> int:
        return self.group.size()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def mesh_on(self, device_type: str):
        """The mesh the styles build ``DTensor`` s on: the multi-dimensional mesh, or the 1-D
        mesh over ``group`` on ``device_type`` (the mesh given, when it is one)."""
        if self.layout != "1d":
            return self.mesh
        return mesh_for_group(self.group, device_type, self.mesh)

    def __repr__(self) -> str:
        return (f"TPContext(layout={self.layout!r}, mesh={self.mesh!r}, "
                f"src_rank={self.src_rank!r})")


def _all_ranks_group(mesh, layout: str) -> dist.ProcessGroup:
    """A process group over every rank of ``mesh`` (checked against its layout first)."""
    from ..nn.multidim.blocks import tp_mesh_group

    return tp_mesh_group(check_mesh(mesh, layout, "parallelize_module"))


def check_placement(style: str, name: str, value, allowed: tuple) -> None:
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


class ModelPlan(dict):
    """A plan for a whole model, as ``tpx.plans.auto`` returns it (a ``dict`` of module
    names to styles, usable as any plan). ``tpx.parallelize_module`` makes every parameter
    such a plan does not split a ``Replicate()`` ``DTensor``, in the blocks of a
    ``ModuleList`` that no entry reaches too (a dense first layer before MoE layers, a plan
    that names the embedding only), so that torch's ``clip_grad_norm_`` and foreach / fused
    optimizers take every parameter. A plain ``dict`` (a plan written by hand) leaves such
    blocks plain: PyTorch's and torchtitan's code parallelize the root and the blocks in
    separate calls.

    :meth:`fit_to` leaves whole what a given TP size cannot split (``tpx.parallelize_module``
    calls it before it applies the plan)."""

    def unsplittable_entries(self, world: int) -> Dict[str, str]:
        """The entries that cannot be applied over ``world`` ranks, and why: each attention
        module whose heads cannot be dealt over them (6 heads at TP 8; KV heads that leave
        a rank without a query head), with every entry under it."""
        out: Dict[str, str] = {}
        for key, style in self.items():
            for part in getattr(style, "styles", (style,)):
                if not callable(getattr(part, "local_heads", None)):
                    continue
                try:
                    for rank in range(world):
                        part.local_heads(world, rank)
                except ValueError as e:
                    out[key] = str(e)
                    out.update({k: str(e) for k in self if k.startswith(key + ".")})
        return out

    def fit_to(self, model: nn.Module, world: int) -> Dict[str, str]:
        """Leaves whole, on every rank, what cannot be split over ``world`` ranks
        (:meth:`unsplittable_entries`) instead of refusing the model: those entries are
        removed, with one warning naming the modules and the share of the model's parameters
        they keep whole, and recorded in ``kept_whole``. Returns the modules left whole (the
        outermost of each removed group of entries), and why."""
        dropped = self.unsplittable_entries(world)
        if not dropped:
            return {}
        shown = self._shown(dropped)
        share = _share_of(model, list(dropped))
        for key in dropped:
            self.pop(key, None)
        self.unsplit = dict(getattr(self, "unsplit", {}), **dropped)  # entry -> why
        self.kept_whole = dict(getattr(self, "kept_whole", {}) or {}, **shown)
        names, first = list(shown), next(iter(shown))
        warnings.warn(
            f"tpx.plans.auto: {len(names)} module(s) of {type(model).__name__} cannot be split "
            f"over TP size {world} ({first}: {shown[first]}), so they stay whole on every rank: "
            f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''} "
            f"({share:.1%} of the model's parameters). A TP size they divide splits them",
            UserWarning, stacklevel=4)
        return shown

    def _shown(self, dropped: Dict[str, str]) -> Dict[str, str]:
        """The removed entries a warning names: those not inside another one."""
        return {k: why for k, why in dropped.items()
                if not any(k.startswith(o + ".") for o in dropped)}


def _share_of(model: nn.Module, keys) -> float:
    """The share of ``model``'s parameter elements under the modules ``keys`` names (names
    or ``fnmatch`` patterns)."""
    import fnmatch

    total = sum(p.numel() for p in model.parameters())
    seen, n = set(), 0
    for name, mod in model.named_modules():
        if any(name == k or fnmatch.fnmatchcase(name, k) for k in keys):
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
    return n / total if total else 0.0


class ParallelStyle:
    """Base of the styles. One interface: ``apply(module, ctx)`` returns the sharded module
    (the same object, with hooks, or a tpx replacement), ``ctx`` being the
    :class:`TPContext` (group, mesh, source rank, layout). ``apply`` also accepts a process
    group, a mesh or None in place of ``ctx`` (and then ``src_rank=``), as styles were once
    applied.

    ``layouts``: the layouts the style shards over (``parallelize_module`` refuses a plan
    entry whose style does not take the mesh's layout). ``replaces``: whether ``apply``
    returns a new module built from the given one (left untouched) rather than adjusting the
    given one in place. ``validate(module, ctx)`` raises when the style cannot be applied;
    ``parallelize_module`` calls it for every entry of a plan before it changes anything.

    A subclass written for the older interface, ``apply(self, module, pg)`` or
    ``apply(self, module, pg, src_rank=0)``, keeps working: it is handed ``ctx.group`` (and
    ``ctx.src_rank``)."""

    layouts = ("1d",)
    replaces = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        fn = cls.__dict__.get("apply")
        if fn is not None and not getattr(fn, "_tpx_takes_context", False):
            cls.apply = _takes_context(fn)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:  # pragma: no cover
        raise NotImplementedError

    def validate(self, module: nn.Module, ctx: TPContext) -> None:
        """Raises if the style cannot be applied to ``module`` in ``ctx``; changes nothing."""


def check_layout(style, ctx: TPContext, entry: Optional[str] = None) -> None:
    """Raises when ``style`` does not shard over ``ctx``'s layout (``entry``: the plan key it
    came with)."""
    if ctx.layout in getattr(style, "layouts", ("1d",)):  # PyTorch's styles: 1-D
        return
    if ctx.layout == "1d":
        raise ValueError(
            f"tpx.{type(style).__name__} shards over a 2-D, 2.5-D or 3-D mesh: pass a mesh from "
            "tpx.init_mesh('2d' | '2.5d' | '3d') to tpx.parallelize_module, not a process group "
            "or a 1-D mesh")
    where = f"plan[{entry!r}]" if entry is not None else "the style"
    raise TypeError(f"tpx.parallelize_module: over a {ctx.layout!r} mesh, {where} must be a "
                    "mesh style (tpx.parallel.mesh_styles.MeshParallel, MeshAttention, "
                    f"MeshInput); got {style!r}")


def _takes_context(fn):
    """``fn`` (a style's ``apply``) called with a :class:`TPContext`, whatever its caller
    passed; one written as ``apply(self, module, pg[, src_rank])`` is given the group."""
    params = list(inspect.signature(fn).parameters)
    legacy = len(params) < 3 or params[2] != "ctx"
    takes_src = "src_rank" in params
    if legacy:
        warnings.warn(f"tpx: {fn.__qualname__}(self, module, {params[2] if len(params) > 2 else ''}"
                      "...) is the older interface of a style; write apply(self, module, ctx) "
                      "(ctx: tpx.parallel.TPContext with .group, .mesh, .src_rank)",
                      DeprecationWarning, stacklevel=3)

    @functools.wraps(fn)
    def apply(self, module, ctx=None, src_rank: Optional[int] = 0):
        ctx = TPContext.of(ctx, src_rank)
        check_layout(self, ctx)
        if not legacy:
            return fn(self, module, ctx)
        if takes_src:
            return fn(self, module, ctx.group, src_rank=ctx.src_rank)
        return fn(self, module, ctx.group)

    apply._tpx_takes_context = True
    return apply


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


def apply_style(style, module: nn.Module, ctx: TPContext) -> nn.Module:
    """``style.apply(module, ctx)``. A PyTorch ``ParallelStyle`` tpx did not write
    (``PrepareModuleInputOutput``, torchtitan's styles) is applied by PyTorch
    (``style._apply(module, mesh)``) on the 1-D mesh over ``ctx.group`` (the mesh
    ``parallelize_module`` was given, when it was one): its parameters and outputs are
    PyTorch's ``DTensor`` s, which tpx's layers take as inputs."""
    if torch_style(style):
        return apply_with_pytorch(style, module, ctx)
    return style.apply(module, ctx)


def apply_with_pytorch(style, module: nn.Module, ctx: TPContext) -> nn.Module:
    """``style`` (one of PyTorch's ``ParallelStyle`` s) applied by PyTorch
    (``style._apply(module, mesh)``) on the 1-D mesh of ``ctx``."""
    device = next((t.device.type for t in module.parameters()), None) or \
        next((t.device.type for t in module.buffers()), "cpu")
    return style._apply(module, ctx.mesh_on(device))
