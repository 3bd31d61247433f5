"""``parallelize_module``: shard an existing model in place from a plan."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import warnings
from typing import Dict, List, Optional, Tuple, Union

import torch.distributed as dist
from torch import Tensor, nn

from ..comm.agree import check_same_on_ranks
from ..comm.entry import every_rank
from ..comm.groups import DeviceMesh, GroupLike, resolve_group
from ..layout.initial import broadcast_, check_src_rank
from ..layout.dtensor_io import DTensor
from . import simulated
from . import style as _style
from .. import config
from ..replicas import watch_replicas
from ..meta_init import watch as watch_meta
from ..layout.sharding import lays_out_params, params_laid_out_by, sharding_of
from ..layout.param_dtensors import REPLICATED
from .integrations import guard_save_pretrained, offer_lora_layers
from ..kept_whole import (
    is_default_replica, planned_owners, replicate_kept_whole, unreplicate_kept_whole,
    warn_if_mostly_whole)
from .base import ModelPlan, check_layout
from .style import ParallelStyle, TPContext, apply_style

__all__ = ["parallelize_module"]


def _tp_group(device_mesh: GroupLike, tp_mesh_dim: Optional[int]) -> dist.ProcessGroup:
    if tp_mesh_dim is None:
        return resolve_group(device_mesh)
    warnings.warn(
        "tpx.parallelize_module: `tp_mesh_dim` is deprecated (as in PyTorch); pass the 1-D "
        "TP mesh itself instead, e.g. device_mesh['tp'] (a mesh dimension named 'tp').",
        DeprecationWarning, stacklevel=3)
    if (not isinstance(tp_mesh_dim, int) or isinstance(tp_mesh_dim, bool)):
        raise ValueError(f"tpx.parallelize_module: `tp_mesh_dim` must be an int; got "
                         f"{tp_mesh_dim!r}")
    if DeviceMesh and isinstance(device_mesh, DeviceMesh):
        if not -device_mesh.ndim <= tp_mesh_dim < device_mesh.ndim:
            raise ValueError(f"tpx.parallelize_module: tp_mesh_dim={tp_mesh_dim} is not a "
                             f"dimension of the {device_mesh.ndim}-D device_mesh")
        resolve_group(None)  # the same error as elsewhere when torch.distributed is not set up
        return device_mesh.get_group(mesh_dim=tp_mesh_dim % device_mesh.ndim)
    if tp_mesh_dim not in (0, -1):
        raise ValueError(f"tpx.parallelize_module: tp_mesh_dim={tp_mesh_dim} needs an N-D "
                         "DeviceMesh; a process group (or None) has one dimension: pass 0")
    return resolve_group(device_mesh)


def _structure(module: nn.Module) -> str:
    """A digest of the names, shapes and dtypes of a module's parameters and buffers. The
    parameters of layers sharded already (whose local shapes differ across ranks when a size
    does not divide) count by their layer's type and dtype only. Sorted by name: the order in
    which a model registers its tensors may follow a set's iteration order, which differs
    between processes with different hash seeds."""
    sharded = {id(p) for m in module.modules() for p in params_laid_out_by(m)}

    def shape(t):
        return "sharded" if id(t) in sharded else tuple(t.shape)
    parts = [(n, shape(t), str(t.dtype)) for n, t in module.named_parameters()]
    parts += [(n, tuple(t.shape), str(t.dtype)) for n, t in module.named_buffers()]
    return hashlib.sha1(repr(sorted(parts)).encode()).hexdigest()


_UNSET = object()  # an argument not given


def parallelize_module(module: nn.Module, device_mesh: GroupLike = None,
                       parallelize_plan: Union[ParallelStyle, Dict[str, ParallelStyle], None] = None,
                       tp_mesh_dim: Optional[int] = None, *, src_rank: Optional[int] = 0,
                       strict: bool = False, src_data_rank=_UNSET) -> nn.Module:
    """Shards ``module`` in place over a TP group (``None``, a ``ProcessGroup`` or a 1-D
    ``DeviceMesh``, e.g. ``DeviceMesh("cpu", torch.arange(world))``) and returns it, as
    ``torch.distributed.tensor.parallel.parallelize_module``.

    ``parallelize_plan`` is a style (applied to ``module`` itself) or a dict from module-name
    patterns (``fnmatch`` wildcards: ``"layers.*.attention.wq"``) to styles. Patterns are
    matched against the names of ``module.named_modules()`` before anything is replaced; the
    key ``""`` names ``module`` itself. A pattern that matches no module is skipped with a
    warning, as PyTorch skips it (the entries that match are applied, all or nothing); under
    ``strict=True`` it is a ``ValueError`` and nothing changes. No plan (``None`` or ``{}``)
    warns and returns ``module`` unchanged, as PyTorch's.

    ``src_rank`` (default 0; PyTorch's name ``src_data_rank`` is taken too): the rank of the TP group whose
    module is used. Sharded parameters are cut from its full tensors (each rank receives its
    shard); every other parameter and buffer of ``module`` (norms, a layer the plan leaves
    whole) is broadcast from it, so the ranks need not be seeded alike. ``src_rank=None``: no
    communication of weights; every rank keeps its part of its own module, which must then be
    equal on every rank (sharded weights are compared by checksum).

    ``tp_mesh_dim`` (deprecated, from earlier PyTorch releases): the dimension of an N-D
    ``device_mesh`` to shard over; pass ``device_mesh["tp"]`` instead.

    Beyond 1-D: with a mesh from ``tpx.init_mesh("2d" | "2.5d" | "3d")`` the plan holds the
    mesh styles (:class:`~tpx.parallel.mesh_styles.MeshParallel`, ``MeshAttention``,
    ``MeshInput``; ``tpx.plans.auto(model, layout=...)`` writes it), the key ``""`` naming
    the model itself. ``src_rank`` is then a rank of the mesh (its index in
    ``mesh.mesh.flatten()``; the global rank for a mesh from ``tpx.init_mesh``).

    Every entry of the plan is checked (its pattern, its style against the module and the
    layout) before anything changes; a plan that fails at any entry leaves ``module`` as it
    was. Each style is applied with one :class:`~tpx.parallel.TPContext` (group, mesh,
    ``src_rank``, layout).
    """
    if src_data_rank is not _UNSET:
        if src_rank not in (0, src_data_rank):
            raise TypeError(f"tpx.parallelize_module: src_rank={src_rank} and "
                            f"src_data_rank={src_data_rank} disagree; pass one of them (they "
                            "are the same argument: PyTorch's name and tpx's)")
        src_rank = src_data_rank
    if simulated.active():
        # PyTorch's simulated ranks: PyTorch's implementation of the same styles
        # (tpx.parallel.simulated); tpx's engine needs real process groups.
        return simulated.parallelize_module(module, device_mesh, parallelize_plan, src_rank)
    target = device_mesh if tp_mesh_dim is None else _tp_group(device_mesh, tp_mesh_dim)
    ctx = TPContext.of(target, src_rank)
    pg = ctx.group  # an unusable group or mesh is the first error
    plan = parallelize_plan
    if plan is None or (isinstance(plan, dict) and not plan):
        import warnings

        warnings.warn("tpx.parallelize_module: no parallelize_plan was given (None or an "
                      "empty dict), so this call changes nothing; pass a ParallelStyle or a "
                      "dict from module-name patterns to styles (tpx.plans.auto(model) writes "
                      "one)", UserWarning, stacklevel=2)
        return module
    if ctx.layout != "1d" and not isinstance(plan, dict):
        raise TypeError("tpx.parallelize_module: over a multi-dimensional mesh the plan must be a "
                        "dict from module-name patterns to mesh styles (tpx.plans.auto(model, "
                        f"layout={ctx.layout!r})); got {type(plan).__name__}")
    if not (_style.is_style(plan) or isinstance(plan, dict)):
        raise TypeError("tpx.parallelize_module: `parallelize_plan` must be a ParallelStyle (tpx's "
                        "or PyTorch's) or a dict from module-name patterns to styles; got "
                        f"{type(plan).__name__}")
    with every_rank("tpx.parallelize_module", group=pg):
        return _shard(module, target, ctx, plan, src_rank, strict)


def _shard(module: nn.Module, target, ctx: TPContext, plan, src_rank: Optional[int],
           strict: bool) -> nn.Module:
    """:func:`parallelize_module` once its arguments are checked and every rank has entered."""
    pg = ctx.group
    # A plan of the whole model (tpx.plans.auto's): every parameter it leaves whole becomes a
    # replica, in the blocks no entry reaches too.
    whole_model = isinstance(plan, ModelPlan)
    if whole_model and ctx.layout == "1d":
        plan.fit_to(module, ctx.world)  # what this TP size cannot split stays whole, said
    prove = getattr(plan, "prove_before_use", None)
    if isinstance(plan, dict) and callable(prove):
        # A plan tpx derived from the model (tpx.parallel.derive.DerivedPlan): proved on a
        # copy first; it raises, and nothing is changed, where the copy differs.
        prove(module, target, src_rank)
        plan = dict(plan)
    entries = [("", plan)] if _style.is_style(plan) else list(plan.items())
    check_same_on_ranks(pg, "parallelize_module", dict(
        src_rank=src_rank, layout=ctx.layout,
        mesh=tuple(ctx.mesh.shape) if ctx.layout != "1d" else None,
        plan=[(k, _describe(v)) for k, v in entries], module=_structure(module)))
    check_src_rank("parallelize_module", src_rank, ctx.world)
    before = dict(module.named_parameters(remove_duplicate=False))
    work = _match(module, entries, strict, ctx)
    # Parameters an earlier call kept whole as Replicate() DTensors are plain again while the
    # plan is applied (this call may shard them), and made DTensors again after.
    replicas = unreplicate_kept_whole(module)
    try:
        keep = _apply_plan(module, ctx, work)
    except BaseException:
        replicate_kept_whole(module, None, reuse=replicas)
        raise
    if ctx.layout == "1d":
        replicate_kept_whole(module, ctx.group, keep, reuse=replicas,
                             owners=None if whole_model else
                             planned_owners(module, [n for n, _ in work]))
    else:
        replicate_kept_whole(module, None, reuse=replicas)
    _keep_parameter_objects(module, before, keep)
    if ctx.layout == "1d":
        _warn_plain_layouts(module)
        if whole_model and ctx.world > 1:
            warn_if_mostly_whole(module, ctx.world)
    guard_save_pretrained(module)
    offer_lora_layers(module)
    if src_rank is not None and ctx.world > 1:
        # The sharded layers took their blocks from the source rank; everything else (a
        # module the plan leaves whole, buffers such as rotary tables) is broadcast from it.
        broadcast_(pg, src_rank, _unsharded_tensors(module))
    if ctx.layout == "1d" and config.watch_replicas() and ctx.world > 1:
        watch_replicas(module, pg)  # TPX_CHECK_REPLICAS=1: after every backward
    watch_meta(module)  # built on the meta device: nothing to_empty leaves reaches a forward
    return module


def _describe(style) -> str:
    """A style as the ranks compare it: its ``repr`` without the objects' addresses (a
    default ``repr``, its own or a chained style's, holds one, which differs between
    processes)."""
    return re.sub(r" (object )?at 0x[0-9a-fA-F]+", "", repr(style))


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def check_can_become_module(old: nn.Module, new: nn.Module, what: str) -> None:
    """Raises (before anything changes) when ``old`` cannot be turned into ``new`` in place."""
    def slots(cls):
        return [c for c in cls.__mro__ if "__slots__" in c.__dict__ and c.__slots__]
    if (not hasattr(old, "__dict__") or slots(type(old)) or slots(type(new))
            or type(old).__basicsize__ != type(new).__basicsize__):
        raise ValueError(
            f"tpx.parallelize_module: {what} ({type(old).__name__}) cannot be changed in place "
            f"into a {type(new).__name__} (its class defines __slots__ or a different object "
            "layout); nothing was changed. Shard a plain nn.Linear / nn.Embedding")


def become_module(old: nn.Module, new: nn.Module) -> None:
    """Turns the object ``old`` into ``new`` in place: every reference to ``old`` (the caller's,
    a parent's, a list's) now holds the parallel module. Hooks registered on ``old`` are kept
    (before the style's own), and so is its train/eval mode."""
    new.train(old.training)
    for name in _HOOK_DICTS:
        mine, theirs = old.__dict__.get(name), new.__dict__.get(name)
        if mine and theirs is not None:
            merged = type(theirs)()
            merged.update(mine)
            merged.update(theirs)
            new.__dict__[name] = merged
    old.__class__ = new.__class__
    old.__dict__ = new.__dict__


def _keep_parameter_objects(module: nn.Module, before: Dict[str, nn.Parameter],
                            keep: set = frozenset()) -> None:
    """The sharded modules take over the ``Parameter`` objects of the modules they replace
    (now holding the shard), so that an optimizer built before ``parallelize_module`` (as the
    examples of earlier PyTorch releases do) steps the sharded weights, and ``requires_grad``
    (a frozen weight) is kept. Attributes tpx attaches to a new parameter (``_tpx*``) move with
    it. ``keep``: ids of parameters that also belong to a module the call left whole (a tie
    across calls): those stay full, with their owner, and the sharded module keeps its own."""
    moved: Dict[int, Tuple[nn.Parameter, nn.Parameter]] = {}
    for path, new in list(module.named_parameters(remove_duplicate=False)):
        old = before.get(path)
        owner_name, _, attr = path.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        # (a parameter a style made a DTensor, its own layer's or a Replicate() one)
        plain = not isinstance(old, DTensor) or is_default_replica(old)
        sharded = lays_out_params(owner) or (isinstance(new, DTensor) and plain)
        if old is None or old is new or not sharded or id(old) in keep:
            continue
        if isinstance(new, DTensor) and plain:
            # A plain Parameter cannot become a DTensor in place: the optimizers that hold the
            # old object are given the new one instead.
            new.requires_grad_(old.requires_grad)
            moved[id(old)] = (old, new)
            continue
        if old.data is not new.data:
            requires_grad = old.requires_grad
            old.data = new.data
            old.requires_grad_(requires_grad)
            if old.grad is not None and old.grad.shape != new.shape:
                old.grad = None
        for key, value in vars(new).items():
            if key.startswith("_tpx"):
                setattr(old, key, value)
        setattr(owner, attr, old)
    old = new = None  # (no reference of this frame's own to a parameter from here on)
    if moved and _held_elsewhere(moved, before):
        _rebind_optimizers(moved)


def _held_elsewhere(moved: Dict[int, Tuple[nn.Parameter, nn.Parameter]],
                    before: Dict[str, nn.Parameter]) -> bool:
    """Whether anything but ``before`` and ``moved`` refers to a plain parameter a ``DTensor``
    replaced: an optimizer built before ``parallelize_module``, or anything else, in which case
    :func:`_rebind_optimizers` looks for the optimizers. Most calls have none to look for, and
    the search is one pass over every object of the process (0.05 - 0.3 s a call, measured),
    which a model parallelized block by block pays once a block.

    Told by CPython's reference counts: those of the parameters beyond what ``before`` and
    ``moved`` hold, against those of a control object held by the same two kinds of
    containers and nothing else, counted by the same code. A reference this module itself
    still holds can only make the answer True (a search that finds nothing). Without
    reference counts (another Python), True."""
    import sys

    if not hasattr(sys, "getrefcount"):
        return True
    control = object()
    control_moved = {id(control): (control, None)}
    control_before = {"": control}
    del control
    return _extra_references(moved, before) > _extra_references(control_moved, control_before)


def _extra_references(moved: dict, before: dict) -> int:
    """The most references any old object of ``moved`` has beyond those of ``before``."""
    import collections
    import sys

    in_before = collections.Counter(id(v) for v in before.values())  # ids: no references
    return max(sys.getrefcount(old) - in_before[id(old)] for old, _ in moved.values())


def _rebind_optimizers(moved: Dict[int, Tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Every ``torch.optim.Optimizer`` alive that holds a parameter ``parallelize_module``
    replaced by its ``DTensor`` (an optimizer built before the call, as the examples of
    earlier PyTorch releases do) steps the ``DTensor`` from now on: the parameter is swapped
    in its param group (and its state, if any, moves with it)."""
    for obj in _live_optimizers():
        for group in obj.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                pair = moved.get(id(p))
                if pair is not None and pair[0] is p:
                    params[i] = pair[1]
                    if p in obj.state:
                        obj.state[pair[1]] = obj.state.pop(p)


def _live_optimizers() -> list:
    """Every ``torch.optim.Optimizer`` instance alive in this process. An instance of a Python
    class refers to its class for the garbage collector, so the referrers of the optimizer
    classes, found in one pass of the collector's C code, hold every instance: twice as fast
    as a Python loop over ``gc.get_objects()``, which mattered for a model parallelized block
    by block (one call of ``parallelize_module`` per block)."""
    import gc

    import torch

    classes = {torch.optim.Optimizer}
    todo = [torch.optim.Optimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in classes:
                classes.add(sub)
                todo.append(sub)
    return [obj for obj in gc.get_referrers(*classes) if type(obj) in classes]


def _unsharded_tensors(module: nn.Module) -> List[Tensor]:
    """Parameters and buffers of ``module`` outside tpx's sharded modules (whose weights came
    from the source rank when they were built), each once, ordered by name: every rank lists
    them in the same order whatever order the model registered them in (a model may register
    buffers in a set's iteration order, which follows each process's hash seed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # type: ignore[assignment,misc]
    skip = {id(p) for m in module.modules() for p in params_laid_out_by(m)}
    found: List[Tuple[str, Tensor]] = []
    for prefix, m in module.named_modules():
        if lays_out_params(m) and type(m).__module__.startswith("tpx."):
            continue  # tpx's own layer: its tensors came from the source rank already
        named = list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
        for name, t in named:
            if DTensor and isinstance(t, DTensor) and getattr(t, REPLICATED, False):
                t = t._local_tensor  # replicated by a tpx style: its value from the source
            if (t is None or id(t) in skip or t.device.type == "meta"
                    or (DTensor and isinstance(t, DTensor))):
                continue
            skip.add(id(t))
            found.append((f"{prefix}.{name}" if prefix else name, t))
    return [t for _, t in sorted(found, key=lambda item: item[0])]


# Styles that take a peft layer (LoRA on a projection): they shard it with its adapters, or
# leave its parameters alone.
_PEFT_AWARE = (_style.ColwiseParallel, _style.RowwiseParallel, _style.PrepareModuleInput,
               _style.PrepareModuleInputOutput,
               _style.PrepareModuleOutput)


def _peft_aware(style: ParallelStyle) -> bool:
    chained = getattr(style, "styles", None)  # plans' chains: one of them shards the layer
    if isinstance(chained, (list, tuple)):
        return any(_peft_aware(s) for s in chained)
    return isinstance(style, _PEFT_AWARE)


class _Undo:
    """What applying a style may change in place on a module tree, recorded so that it can be
    put back: each module's attributes, its dicts of parameters, buffers, children and hooks
    (restored in place: hook handles and autograd refer to those dict objects), and the
    gradient hooks of its parameters. A style that fails half way, or a plan whose later entry
    fails, then leaves the model as it was (PyTorch's styles and tpx's hook styles change the
    module they are given; tpx's layer styles build a new one)."""

    def __init__(self, module: nn.Module) -> None:
        self._saved = []
        for m in module.modules():
            attrs = dict(m.__dict__)
            dicts = [(d, dict(d)) for d in attrs.values() if isinstance(d, dict)]
            hooks = [(p, None if p._backward_hooks is None else dict(p._backward_hooks))
                     for p in m._parameters.values() if isinstance(p, Tensor)]
            self._saved.append((m, attrs, dicts, hooks))

    def restore(self) -> None:
        for m, attrs, dicts, hooks in reversed(self._saved):
            for key in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[key]
            m.__dict__.update(attrs)
            for d, content in dicts:
                d.clear()
                d.update(content)
            for p, saved in hooks:
                if p._backward_hooks is not None:
                    extra = [k for k in p._backward_hooks if saved is None or k not in saved]
                    for k in extra:
                        del p._backward_hooks[k]


def _match(module: nn.Module, entries, strict: bool, ctx: TPContext) -> list:
    """``(module name, style)`` for every module each plan entry names, in the plan's order;
    raises for an entry that is not a style, a style that does not take the layout, or (under
    ``strict``) a pattern that names no module."""
    names = [name for name, _ in module.named_modules() if name]
    work = []
    for pattern, style in entries:
        if not _style.is_style(style):
            raise TypeError(f"tpx.parallelize_module: plan[{pattern!r}] must be a ParallelStyle "
                            f"(ColwiseParallel(), ..., tpx's or PyTorch's); got "
                            f"{type(style).__name__}")
        check_layout(style, ctx, pattern)
        # The key "" names the model itself.
        matches = ([""] if pattern == "" else
                   [n for n in names if fnmatch.fnmatchcase(n, pattern)])
        if not matches and strict:
            raise ValueError(f"tpx.parallelize_module: the plan pattern {pattern!r} matches no "
                             f"module (some module names: {names[:8]}); fix the pattern or pass "
                             "strict=False")
        if not matches:
            import warnings

            warnings.warn(f"tpx.parallelize_module: the plan pattern {pattern!r} matches no "
                          f"module of {type(module).__name__} (some module names: "
                          f"{names[:8]}); this entry is skipped (strict=True raises)",
                          UserWarning, stacklevel=3)
        work += [(n, style) for n in matches]
    return work


def _apply_plan(module: nn.Module, ctx: TPContext, work) -> set:
    """Applies each ``(name, style)`` of ``work``; returns the ids of parameters tied to a
    module the plan left whole.

    Every style first validates its module; then every replacement is built (the modules of
    ``module`` are not touched while the styles build their sharded layers; what a style
    changes in place is recorded and put back if a later entry fails); only then is each
    replaced module changed in place into its replacement."""
    # Parameters shared by several modules (tied embeddings: GPT-2's wte and lm_head) are tied
    # again after sharding, when the sharded modules hold the same block.
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    ties = [o for o in owners.values() if len({m for m, _ in o}) > 1]
    for name, style in work:
        old = module if name == "" else module.get_submodule(name)
        _check_entry(module, name, old, style)
        if hasattr(style, "validate"):
            try:
                style.validate(old, ctx)
            except (ValueError, TypeError) as e:
                _reraise_in_entry(e, name, old, style)
    if ctx.layout != "1d":
        named = {n for n, _ in work}
        for tie in ties:
            if sum(1 for m, _ in tie if m in named) > 1:
                raise ValueError(
                    "tpx.parallelize_module: the tied parameters "
                    f"{', '.join(f'{m}.{n}' for m, n in tie)} are sharded by separate entries "
                    f"of a {ctx.layout!r} plan, whose layers split them in different blocks; "
                    "untie them (tie_word_embeddings=False) or use a 1-D plan. Nothing was "
                    "changed")
    replaced: List[Tuple[str, nn.Module, nn.Module]] = []
    undo = []
    try:
        for name, style in work:
            old = module if name == "" else module.get_submodule(name)
            undo.append(_Undo(old))
            try:
                new = apply_style(style, old, ctx)
                if new is not old:
                    check_can_become_module(old, new, repr(name) if name else "the module given")
            except (ValueError, TypeError) as e:
                _reraise_in_entry(e, name, old, style)
            if new is not old:
                replaced.append((name, old, new))
    except BaseException:
        for u in reversed(undo):  # what the styles changed in place, back as it was
            u.restore()
        raise
    # A parameter shared with a module the plan leaves whole (a tie PyTorch users break and
    # make again across calls) stays full with that module; the sharded one gets its own.
    gone = {name for name, _, _ in replaced}

    def inside(m: str) -> bool:
        return any(m == g or m.startswith(g + ".") for g in gone)

    def alias(tie) -> bool:  # held whole only by modules above a sharded one (BERT's LM
        # head bias: cls.predictions.bias is cls.predictions.decoder.bias): tied again
        ins = [m for m, _ in tie if inside(m)]
        return all(o == "" or any(i.startswith(o + ".") for i in ins)
                   for o, _ in tie if not inside(o))

    keep, partial = set(), []
    for tie in ties:
        if all(inside(m) for m, _ in tie) or not any(inside(m) for m, _ in tie) or alias(tie):
            continue
        partial.append(tie)
        keep.add(id(getattr(module.get_submodule(tie[0][0]), tie[0][1])))
    for _, old, new in replaced:
        become_module(old, new)
    for tie in ties:
        if tie not in partial:
            _retie(module, tie)
    return keep


def _check_entry(module: nn.Module, name: str, old: nn.Module, style) -> None:
    """A plan entry on a peft (LoRA) layer must be one tpx shards with its adapters."""
    parent_name, _, child = name.rpartition(".")
    if child == "base_layer" and _style.is_peft_layer(module.get_submodule(parent_name)):
        raise ValueError(
            f"tpx.parallelize_module: the plan names {name!r}, the base layer of a peft "
            f"(LoRA) layer; name the LoRA layer itself ({parent_name!r}): tpx shards its "
            "base layer and its adapters together. Nothing was changed")
    if _style.is_peft_layer(old) and not _peft_aware(style):
        raise ValueError(
            f"tpx.parallelize_module: {name!r} is peft's {type(old).__module__}."
            f"{type(old).__name__} (an adapter on what the plan shards with {style!r}); "
            "tpx shards LoRA on linear projections (column and row styles) only. Leave "
            "this module out of the adapter's target_modules. Nothing was changed")


def _reraise_in_entry(e: Exception, name: str, old: nn.Module, style) -> None:
    """Raises ``e`` with the plan entry it came from in its message (unless it names it
    already)."""
    msg = str(e)
    if name in msg:
        raise e
    raise type(e)(f"tpx.parallelize_module: {name!r} ({type(old).__name__}) with {style!r}: "
                  f"{msg}") from e


def _warn_plain_layouts(module: nn.Module) -> None:
    """Warns, naming them, about the parameters a tpx layer holds in a layout no ``DTensor``
    states (fused segments split separately along dim 0, KV rows held by several ranks): they
    stay this rank's plain tensors, and torch's foreach kernels refuse a list mixing them with
    ``DTensor`` s."""
    plain = [name for name, p in module.named_parameters()
             if not isinstance(p, DTensor) and sharding_of(p) is not None]
    if not plain:
        return
    shown = ", ".join(plain[:4]) + (f" and {len(plain) - 4} more" if len(plain) > 4 else "")
    warnings.warn(
        f"tpx.parallelize_module: {len(plain)} parameter(s) stay this rank's plain tensors, in a "
        f"layout no DTensor states (fused segments split separately along dim 0, or KV rows "
        f"held by several ranks): {shown}. torch's foreach kernels refuse a list mixing them "
        "with DTensors: clip with tpx.clip_grad_norm_ (torch.nn.utils.clip_grad_norm_ raises "
        "'mixed torch.Tensor and DTensor') and give the optimizer foreach=False; save with "
        "save_pretrained or tpx.checkpoint (docs/training.md)", UserWarning, stacklevel=3)


def _retie(module: nn.Module, owners: List[Tuple[str, str]]) -> None:
    params = [getattr(module.get_submodule(m), p) for m, p in owners]
    if all(p is params[0] for p in params):
        return  # no owner was replaced
    keep = next((p for (m, _), p in zip(owners, params)
                 if lays_out_params(module.get_submodule(m))), params[0])
    for (m, p_name), p in zip(owners, params):
        if p.shape != keep.shape:
            names = ", ".join(f"{m}.{n}" for m, n in owners)
            raise ValueError(
                f"tpx.parallelize_module: the tied parameters {names} are sharded differently "
                f"({tuple(keep.shape)} vs {tuple(p.shape)} on this rank); shard the embedding "
                "rowwise and the LM head colwise (both split the vocabulary), or untie them")
        setattr(module.get_submodule(m), p_name, keep)
