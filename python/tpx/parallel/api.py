"""``parallelize_module``: shard an existing model in place from a plan."""

from __future__ import annotations

import fnmatch
from typing import Dict, List, Tuple, Union

from torch import nn

from ..group import GroupLike, resolve_group
from .style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(module: nn.Module, group_or_mesh: GroupLike,
                       plan: Union[ParallelStyle, Dict[str, ParallelStyle]], *,
                       strict: bool = True) -> nn.Module:
    """Shards ``module`` in place over a TP group (``None``, a ``ProcessGroup`` or a 1-D
    ``DeviceMesh``) and returns it, as ``torch.distributed.tensor.parallel.parallelize_module``.

    ``plan`` is a style (applied to ``module`` itself) or a dict from module-name patterns
    (``fnmatch`` wildcards: ``"layers.*.attention.wq"``) to styles. Patterns are matched
    against the names of ``module.named_modules()`` before anything is replaced. Under
    ``strict=True`` a pattern that matches no module is a ``ValueError``.
    """
    pg = resolve_group(group_or_mesh)
    if isinstance(plan, ParallelStyle):
        return plan.apply(module, pg)
    if not isinstance(plan, dict):
        raise TypeError("tpx.parallelize_module: `plan` must be a ParallelStyle or a dict from "
                        f"module-name patterns to styles; got {type(plan).__name__}")
    names = [name for name, _ in module.named_modules() if name]
    # Parameters shared by several modules (tied embeddings: GPT-2's wte and lm_head) are tied
    # again after sharding, when the sharded modules hold the same block.
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for p_name, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(p), []).append((mod_name, p_name))
    ties = [o for o in owners.values() if len({m for m, _ in o}) > 1]
    work = []
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"tpx.parallelize_module: plan[{pattern!r}] must be a ParallelStyle "
                            f"(ColwiseParallel(), ...); got {type(style).__name__}")
        matches = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matches and strict:
            raise ValueError(f"tpx.parallelize_module: the plan pattern {pattern!r} matches no "
                             f"module (some module names: {names[:8]}); fix the pattern or pass "
                             "strict=False")
        work += [(n, style) for n in matches]
    for name, style in work:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        try:
            new = style.apply(old, pg)
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise type(e)(msg if name in msg else f"tpx.parallelize_module: {name!r} "
                          f"({type(old).__name__}) with {style!r}: {msg}") from e
        if new is not old:
            setattr(parent, child, new)
    for tie in ties:
        _retie(module, tie)
    return module


def _retie(module: nn.Module, owners: List[Tuple[str, str]]) -> None:
    params = [getattr(module.get_submodule(m), p) for m, p in owners]
    if all(p is params[0] for p in params):
        return  # no owner was replaced
    keep = next((p for (m, _), p in zip(owners, params)
                 if hasattr(module.get_submodule(m), "_shards")), params[0])
    for (m, p_name), p in zip(owners, params):
        if p.shape != keep.shape:
            names = ", ".join(f"{m}.{n}" for m, n in owners)
            raise ValueError(
                f"tpx.parallelize_module: the tied parameters {names} are sharded differently "
                f"({tuple(keep.shape)} vs {tuple(p.shape)} on this rank); shard the embedding "
                "rowwise and the LM head colwise (both split the vocabulary), or untie them")
        setattr(module.get_submodule(m), p_name, keep)
