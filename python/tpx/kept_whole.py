"""The parameters a 1-D plan keeps whole (norms, routers, a module the plan does not name), as
``Replicate()`` ``DTensor`` s on the TP mesh by default, so that every parameter of a
parallelized tree is a ``DTensor`` and the lines of an ordinary training script take them as
they are: torch's ``clip_grad_norm_`` / ``clip_grad_value_``, foreach and fused optimizers,
DCP. Their modules compute on the local tensors (each module that owns such a parameter swaps
the local tensors in for its own forward, as :class:`~tpx.parallel.module_styles.NoParallel`
does), the gradients land on the ``DTensor`` s, whole on every rank.

``parallelize_module`` may be called on a model block by block, the root before or after the
blocks (PyTorch's tests and torchtitan's shard the root first, or the blocks first). A call
leaves alone the blocks of a ``ModuleList`` / ``ModuleDict`` its plan does not reach (a later
call shards them; code in between may change them, as torchtitan's gpt-oss does). A call first makes
the replicas earlier calls left in its tree plain again (the plan may shard them), applies its
plan, then makes what is still kept whole a replica again: the same ``DTensor`` object where
the parameter was not touched, so an optimizer built between calls keeps stepping it.

A parameter of a tpx layer in a layout no ``DTensor`` states (fused segments split separately,
KV heads held by several ranks) stays this rank's plain tensor, described for tpx's own
checkpoints and clipping."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Dict

from torch import nn

from .layout.dtensor_io import DTensor
from .layout.param_dtensors import REPLICATED, compute_on_locals, replicate_params_of
from .layout.sharding import guard_state_dict, lays_out_params

__all__ = ["is_default_replica", "planned_owners", "replicate_kept_whole",
           "unreplicate_kept_whole"]

_MARK = "_tpx_kept_whole"           # on a replica this module made
_HOOKS = "_tpx_kept_whole_hooks"    # on its owner: the handles of the swapping hooks
_LISTS = "_tpx_kept_whole_lists"   # on an owner: the hooks' lists naming it (copied with it)


def is_default_replica(p) -> bool:
    """Whether ``p`` is a parameter :func:`replicate_kept_whole` made a ``Replicate()``
    ``DTensor``."""
    return bool(getattr(p, _MARK, False))


def planned_owners(module: nn.Module, named) -> set:
    """Ids of the modules whose parameters a call with plan entries on the modules ``named``
    (their names in ``module``) keeps whole as replicas: every module on the way from
    ``module`` to a named one, and every subtree that hangs off that way, except the blocks
    of a ``ModuleList`` / ``ModuleDict`` that no entry reaches (a later call may shard
    them: PyTorch's and torchtitan's code parallelize the root and the blocks in separate
    calls, and may change a block's parameters in between)."""
    on_way = {id(module)}
    for name in named:
        parts = name.split(".") if name else []
        m = module
        for part in parts:
            m = m.get_submodule(part)
            on_way.add(id(m))
    out = set()

    def walk(m: nn.Module, in_container: bool) -> None:
        if id(m) in on_way:
            out.add(id(m))
        elif isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            pass  # a container: its blocks decide
        elif in_container:
            return  # a block no entry reaches
        else:
            out.update(id(x) for x in m.modules())
            return
        container = isinstance(m, (nn.ModuleList, nn.ModuleDict))
        for child in m.children():
            walk(child, container)

    walk(module, False)
    return out


def replicate_kept_whole(module: nn.Module, group, keep=frozenset(),
                         reuse: Dict[int, nn.Parameter] = None, owners=None) -> None:
    """Every plain parameter of ``module``'s tree outside tpx's layers becomes a
    ``Replicate()`` ``DTensor`` on the 1-D mesh over ``group`` sharing its storage, and its
    owner and the owner's parent compute on the local tensor (the swaps nest). Tied parameters
    get one ``DTensor``. ``keep``: ids of parameters left as they are (tied to a module outside the call). ``reuse``: what
    :func:`unreplicate_kept_whole` returned: a plain parameter still in place gets its
    replica object back. ``group=None``: only that. ``owners``: ids of the modules whose
    parameters may become replicas (:func:`planned_owners`; default: all)."""
    reuse = reuse or {}
    made: Dict[int, nn.Parameter] = {}
    parent_of: Dict[int, nn.Module] = {}
    for m in module.modules():
        for child in m.children():
            parent_of.setdefault(id(child), m)
    by_parent: Dict[int, list] = {}
    by_owner: Dict[int, list] = {}
    # a tpx layer's parameter that a module above also holds (BERT's cls.predictions.bias is
    # its decoder's bias) is that layer's shard, not a replica
    laid_out = {id(p) for m in module.modules() if lays_out_params(m)
                for p in m.parameters(recurse=False)}
    for owner in module.modules():
        if lays_out_params(owner):
            continue
        owned = []
        for name, p in list(owner._parameters.items()):
            if p is None or isinstance(p, DTensor) or id(p) in keep or id(p) in laid_out:
                continue
            new = made.get(id(p))
            if new is None and owners is not None and id(owner) not in owners \
                    and id(p) not in reuse:
                continue
            if new is None:
                old = reuse.get(id(p))
                if old is not None and old._local_tensor.data_ptr() == p.data_ptr():
                    old.requires_grad_(p.requires_grad)
                    owner._parameters[name] = new = old
                elif group is None:
                    continue
                else:
                    new = replicate_params_of(owner, name, group)
                    setattr(new, _MARK, True)
                made[id(p)] = new
            else:
                owner._parameters[name] = new
            owned.append((owner, name))
        if owned:
            by_owner[id(owner)] = owned
            _hook(owner, owned)
            guard_state_dict(owner)  # load_state_dict takes the full tensors too
            parent = parent_of.get(id(owner))
            if parent is not None and not lays_out_params(parent):
                by_parent.setdefault(id(parent), [parent, []])[1].extend(owned)
    # A module's forward may read its child's parameter itself (a convolution's weight passed
    # to a function, Qwen3-Next's and Mamba's mixers): the parent swaps its children's in too.
    for parent, owned in by_parent.values():
        _hook(parent, owned, watch=False)
    # A forward may read a parameter further down its tree (Gemma 4's multimodal forward
    # reads ``self.language_model.embed_tokens.weight[pad_token_id]``): it swaps that in too.
    # A method other than forward may read a child's parameter (Gemma 3n's AltUp.correct,
    # called from the decoder layer's forward): the module's parent swaps it in too.
    for m in module.modules():
        for path in _deep_reads(type(m)):
            try:
                sub = m.get_submodule(path)
            except AttributeError:
                continue
            if id(sub) in by_owner and parent_of.get(id(sub)) is not m:
                _hook(m, by_owner[id(sub)], watch=False)
        parent = parent_of.get(id(m))
        for path in _method_reads(type(m)) if parent is not None else ():
            try:
                sub = m.get_submodule(path)
            except AttributeError:
                continue
            if id(sub) in by_owner:
                _hook(parent, by_owner[id(sub)], watch=False)


_READS = r"self\.((?:\w+\.)*\w+)\.(?:weight|bias)\b"


@functools.lru_cache(maxsize=None)
def _deep_reads(cls: type) -> tuple:
    """The submodule paths of two or more steps whose ``weight`` / ``bias`` the forward of
    ``cls`` reads itself (``self.a.b.weight``)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ()
    return tuple(sorted({p for p in re.findall(_READS, src) if "." in p}))


@functools.lru_cache(maxsize=None)
def _method_reads(cls: type) -> tuple:
    """The submodule paths whose ``weight`` / ``bias`` a method of ``cls`` other than
    ``forward``, defined in a model's own code (not torch's), reads (``self.a.weight``)."""
    out = set()
    for name, fn in vars(cls).items():
        if name == "forward" or not inspect.isfunction(fn):
            continue
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        out.update(re.findall(_READS, src))
    return tuple(sorted(out))


def _hook(module: nn.Module, owned, watch: bool = True) -> None:
    """``module``'s forward computes on the local tensors of the ``DTensor`` parameters
    ``owned`` names (a replica, or FSDP2's unsharded parameter in its place at the call). A
    later call that makes an owner's parameters plain again takes the owner out of every
    such list (:func:`unreplicate_kept_whole`), so a parameter it then shards computes as its
    layer was written. ``watch``: as :func:`~tpx.layout.param_dtensors.compute_on_locals`'s."""
    for o in {id(o): o for o, _ in owned}.values():
        o.__dict__.setdefault(_LISTS, []).append(owned)
    module.__dict__.setdefault(_HOOKS, []).extend(
        compute_on_locals(module, owned, watch=watch, only_dtensors=True))


def unreplicate_kept_whole(module: nn.Module) -> Dict[int, nn.Parameter]:
    """Makes the replicas :func:`replicate_kept_whole` made in ``module``'s tree plain
    parameters again (on their local tensors; tied ones stay tied) and removes their owners'
    hooks. Returns ``{id(plain parameter): its replica}`` for
    :func:`replicate_kept_whole`'s ``reuse``."""
    out: Dict[int, nn.Parameter] = {}
    plain_of: Dict[int, nn.Parameter] = {}
    for owner in module.modules():
        for handle in owner.__dict__.pop(_HOOKS, ()):
            handle.remove()
        for owned in owner.__dict__.pop(_LISTS, ()):  # a parent's hook outside this tree names it
            owned[:] = [(o, n) for o, n in owned if o is not owner]
        for name, p in list(owner._parameters.items()):
            if p is None or not is_default_replica(p):
                continue
            q = plain_of.get(id(p))
            if q is None:
                q = nn.Parameter(p._local_tensor.detach(), requires_grad=p.requires_grad)
                for key, value in vars(p).items():
                    if key.startswith("_tpx") and key not in (_MARK, REPLICATED):
                        setattr(q, key, value)
                if p.grad is not None:
                    q.grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                plain_of[id(p)] = q
                out[id(q)] = p
            owner._parameters[name] = q
    return out


WHOLE_WARNING_SHARE = 0.25  # of the model's parameters held whole on every rank


def warn_if_mostly_whole(module: nn.Module, world: int, shown: int = 3) -> None:
    """Warns when the plan left over a quarter of ``module``'s parameters whole on every rank
    (each rank then holds far more than 1/``world`` of the model), naming the largest whole
    modules, as parameter-name patterns with their share of the model."""
    import re
    import warnings

    total = whole = 0
    by: Dict[str, int] = {}
    for name, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        n = p.numel()
        total += n
        # a plain tensor with a layout description is this rank's part (an uneven split)
        if local.numel() == n and n and getattr(p, "_tpx_sharding", None) is None:
            whole += n
            owner = re.sub(r"\.\d+\.", ".*.", name.rpartition(".")[0] or name)
            by[owner] = by.get(owner, 0) + n
    if not total or whole <= WHOLE_WARNING_SHARE * total:
        return
    largest = sorted(by.items(), key=lambda kv: -kv[1])[:shown]
    warnings.warn(
        f"tpx.parallelize_module: the plan leaves {whole / total:.0%} of "
        f"{type(module).__name__}'s parameters whole on every rank, so each of the {world} ranks "
        f"holds {(whole + (total - whole) / world) / total:.0%} of the model; the largest whole "
        "modules: " + ", ".join(f"{k} ({v / total:.0%})" for k, v in largest)
        + ". Add entries for them to the plan (tpx.parallel.style's ColwiseParallel / "
        "RowwiseParallel) to split them", UserWarning, stacklevel=3)
