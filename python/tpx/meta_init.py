"""A model tpx sharded while it was on the meta device: no parameter or buffer that ``to_empty``
left uninitialized reaches a forward.

``to_empty`` gives every tensor of the meta device real memory holding whatever was there. The
model is right only once each of them is written: loaded (``tpx.checkpoint.load_hf_checkpoint``,
``tpx.checkpoint.load``, ``load_state_dict``), initialized in place (``init_weights``,
``reset_parameters``), or replaced by a new tensor (torchtitan's rotary table). :func:`watch`
(``parallelize_module`` calls it when the module holds meta tensors) marks each tensor
``to_empty`` makes from a meta one; the module's first forward raises, naming them, if a marked
tensor was never written since (its version counter still 0), and stops watching once none
is left."""

from __future__ import annotations

import types
from typing import Iterator, List, Tuple

import torch
from torch import nn

from .layout.param_dtensors import local_of

_MARK = "_tpx_from_empty"   # on a tensor ``to_empty`` made from a meta one
_HOOK = "_tpx_meta_hook"    # on a watched module: the id of its forward pre-hook


def _slots(module: nn.Module) -> Iterator[Tuple[str, nn.Module, str, str]]:
    """``(qualified name, owner, "_parameters" | "_buffers", name)`` of every tensor."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, t in m.__dict__[kind].items():
                if t is not None:
                    yield (f"{prefix}.{name}" if prefix else name), m, kind, name


def _on_meta(t) -> bool:
    return local_of(t).device.type == "meta"


def watch(module: nn.Module) -> None:
    """Watches ``module`` when it holds tensors on the meta device (module docstring)."""
    if _HOOK in module.__dict__:
        return
    if not any(_on_meta(m.__dict__[k][n]) for _, m, k, n in _slots(module)):
        return
    module._apply = types.MethodType(_apply, module)
    handle = module.register_forward_pre_hook(_check_first_forward)
    module.__dict__[_HOOK] = handle.id


def _apply(self: nn.Module, fn, recurse: bool = True):
    """``nn.Module._apply`` (what ``to_empty``, ``to`` and ``cuda`` run), marking each tensor
    that leaves the meta device: only ``to_empty`` can, and it leaves the memory as it was.
    (Named as the method it stands in for: a pickled model unpickles with the class's.)"""
    on_meta = [(m, k, n) for _, m, k, n in _slots(self) if _on_meta(m.__dict__[k][n])]
    out = type(self)._apply(self, fn, recurse)
    for m, k, n in on_meta:
        t = m.__dict__[k].get(n)
        if t is not None and not _on_meta(t):
            setattr(local_of(t), _MARK, True)
    return out


def unwritten(module: nn.Module) -> List[str]:
    """Names of the tensors of ``module`` that ``to_empty`` made from meta ones and that were
    never written since."""
    out = []
    for qual, m, k, n in _slots(module):
        t = m.__dict__[k][n]
        local = local_of(t)
        if local.__dict__.get(_MARK):
            try:
                # A DTensor's in-place ops count on the DTensor, not on its local tensor; tpx's
                # loaders write the local tensor.
                if t._version == 0 and local._version == 0:
                    out.append(qual)
            except RuntimeError:  # an inference tensor keeps no version: not known
                pass
    return out


def _stop(module: nn.Module) -> None:
    hook = module.__dict__.pop(_HOOK, None)
    if hook is not None:
        module._forward_pre_hooks.pop(hook, None)
    module.__dict__.pop("_apply", None)


def _check_first_forward(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return  # checked by the first eager call (a compiled forward traces nothing of this)
    if any(_on_meta(m.__dict__[k][n]) for _, m, k, n in _slots(module)):
        return  # still on the meta device (a shape-only run): checked at a later call
    bad = unwritten(module)
    if bad:
        more = " ..." if len(bad) > 8 else ""
        raise RuntimeError(
            f"tpx: {len(bad)} parameters or buffers of this {type(module).__name__} were built "
            f"on the meta device, given memory by to_empty and never written since (they hold "
            f"whatever that memory held): {bad[:8]}{more}. Load or initialize them before the "
            "first forward: tpx.from_pretrained(path) does all of it; after to_empty, "
            "tpx.checkpoint.load_hf_checkpoint(model, path) (which also sets a Hugging Face "
            "model's rotary tables), tpx.checkpoint.load, load_state_dict, or the model's own "
            "initialization")
    _stop(module)
