"""What a Hugging Face checkpoint does not hold, set as transformers' ``from_pretrained`` sets
it after it reads the files: the non-persistent buffers (rotary tables) and the tensors no file
held, by the model's own ``_init_weights``, in transformers' order, on a model tpx sharded
(:func:`tpx.checkpoint.load_hf_checkpoint` calls it)."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .lazy import TensorSource, read_local
from ..layout.dtensor_io import DTensor
from ..layout.param_dtensors import local_of


def _owners(model: nn.Module):
    """``(name, module, owning PreTrainedModel)`` of every module, each child before its parent
    (the order of transformers' ``initialize_weights``): the owner is the nearest transformers
    model above it (the one whose ``_init_weights`` transformers calls on it)."""
    from transformers import PreTrainedModel

    def walk(prefix, module, owner):
        if isinstance(module, PreTrainedModel):
            owner = module
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child, owner)
        yield prefix, module, owner

    yield from walk("", model, model if isinstance(model, PreTrainedModel) else None)


@torch.no_grad()
@contextlib.contextmanager
def _locals_of(module: nn.Module):
    """Within the block, ``module``'s ``DTensor`` parameters are their local tensors, marked as
    loaded as the ``DTensor`` s are (a model's ``_init_weights`` computes with its parameters
    before it asks whether they were loaded: Hunyuan's ``zeros_like(module.base)``)."""
    saved = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for n, p in saved.items():
        local = p._local_tensor
        if "_is_hf_initialized" in p.__dict__:
            local._is_hf_initialized = p.__dict__["_is_hf_initialized"]
        module._parameters[n] = local
    try:
        yield
    finally:
        for n, p in saved.items():
            module._parameters[n].__dict__.pop("_is_hf_initialized", None)
            module._parameters[n] = p


def _stand_in(module: nn.Module, full: Dict[str, torch.Tensor]) -> Optional[nn.Module]:
    """``module`` as ``_init_weights`` sees it on one device, holding the full tensors ``full``
    (by name) in place of this rank's parts and its other tensors as they are: a shallow copy
    of a module of the model's own class; for a tpx layer, the torch module it stands for
    (``nn.Linear``, ``nn.Embedding``); ``None`` for a tpx layer of another kind."""
    names = list(module._parameters)
    if type(module).__module__.startswith("tpx."):
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            stand = nn.Linear(module.in_features, module.out_features, device="meta",
                              bias=getattr(module, "bias", None) is not None)
        elif hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim"):
            stand = nn.Embedding(module.num_embeddings, module.embedding_dim, device="meta",
                                 padding_idx=getattr(module, "padding_idx", None))
        else:
            return None
        names = list(stand._parameters)
    else:
        stand = object.__new__(type(module))
        stand.__dict__.update(module.__dict__)
    stand.__dict__["_parameters"] = {n: full.get(n, module._parameters.get(n)) for n in names}
    stand.__dict__["_buffers"] = {n: full.get(n, b) for n, b in module._buffers.items()}
    return stand


def _copy_part(full: torch.Tensor, ranges, dst: torch.Tensor) -> None:
    """Copies the blocks ``ranges`` (per dim, in local order) of the full tensor ``full`` into
    ``dst``, as :func:`tpx.checkpoint.lazy.read_local` reads them from the files."""
    read_local(TensorSource(full, "", ""), ranges, dst)


def _mark(tensors, value) -> list:
    """Sets (``value`` True) or clears (``None``) transformers' loaded mark on ``tensors``;
    returns what each held before."""
    before = [(t, t.__dict__.get("_is_hf_initialized")) for t in tensors]
    for t in tensors:
        if value is None:
            t.__dict__.pop("_is_hf_initialized", None)
        else:
            t._is_hf_initialized = value
    return before


def _unmark(before: list) -> None:
    for t, flag in before:
        if flag is None:
            t.__dict__.pop("_is_hf_initialized", None)
        else:
            t._is_hf_initialized = flag


@torch.no_grad()
def set_unloaded(model: nn.Module, missing=None) -> Tuple[List[str], List[str]]:
    """Sets the non-persistent buffers of a transformers model and the tensors ``missing``
    names (key -> ``(tensor, its local_reads entry)``: ones no file held, fresh from
    ``to_empty``) as ``from_pretrained`` sets them after it loads the files: the owning
    model's ``_init_weights`` on every module, children first as transformers runs it (a model
    may set a buffer of a child), with every other parameter and buffer marked as loaded, so
    that only these are written (transformers' ``init`` functions skip marked tensors); a
    parameter tied to another is set through the module of its tie's source only. A missing
    tensor this rank holds a part of, or one of a tpx layer, is drawn whole in a stand-in of
    its module (:func:`_stand_in`) and this rank's part copied in: the values one device
    draws from the same random state. Returns the names of the buffers that were set and the
    keys of ``missing`` that were set."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return [], []
    if not isinstance(model, PreTrainedModel):
        return [], []
    try:
        from transformers import initialization as hf_init
        guard = hf_init.guard_torch_init_functions()
    except (ImportError, AttributeError):
        guard = contextlib.nullcontext()
    unset = {}  # id -> (name, tensor, version of its local tensor before)
    for prefix, module in model.named_modules():
        for n in module._non_persistent_buffers_set:
            buf = module._buffers.get(n)
            if buf is not None and id(buf) not in unset and buf.device.type != "meta":
                unset[id(buf)] = (f"{prefix}.{n}" if prefix else n, buf, buf._version)
    buffers = set(unset)
    reads = {}
    for key, (t, read) in (missing or {}).items():
        if id(t) not in unset:
            unset[id(t)] = (key, t, local_of(t)._version)
            reads[id(t)] = read
    if not unset:
        return [], []
    # The modules whose missing tensors are drawn whole (sharded ones, a tpx layer's).
    full: Dict[int, torch.Tensor] = {}
    stand_ins = {}
    for module in model.modules():
        own = {n: t for kind in (module._parameters, module._buffers) for n, t in kind.items()
               if t is not None and id(t) in reads}
        if not own or not (type(module).__module__.startswith("tpx.") or any(
                tuple(reads[id(t)][0]) != tuple(reads[id(t)][2].shape) for t in own.values())):
            continue
        for t in own.values():
            if id(t) not in full:
                local = local_of(t)
                full[id(t)] = torch.empty(reads[id(t)][0], dtype=local.dtype, device=local.device)
        stand = _stand_in(module, {n: full[id(t)] for n, t in own.items()})
        if stand is not None:
            stand_ins[id(module)] = stand
    tied = {target for target, source in tied_keys(model).items()
            if _tensor(model, target) is _tensor(model, source)}
    kept = {id(t): t for t in list(model.parameters()) + list(model.buffers())
            if id(t) not in unset}
    # The stand-ins take their modules' places while transformers' order runs: a model's
    # _init_weights may set a child's tensor (GPT-2's c_proj), which is then the full one too.
    places = [(parent, n, child) for parent in model.modules()
              for n, child in parent._modules.items() if id(child) in stand_ins]
    real = {id(stand_ins[id(child)]): child for _, _, child in places}
    flags = _mark(kept.values(), True)
    _mark([t for _, t, _ in unset.values()] + list(full.values()), None)
    for parent, n, child in places:
        parent._modules[n] = stand_ins[id(child)]
    try:
        with guard:
            for prefix, module, owner in _owners(model):
                original = real.get(id(module), module)
                values = getattr(original, "_tpx_buffer_values", None)
                if values:  # a tpx module in place of one whose buffers transformers sets
                    for n, value in values.items():
                        buf = original._buffers.get(n)
                        if buf is not None and buf.device.type != "meta":
                            buf.fill_(value)
                if owner is None or (values and module is original):
                    continue
                # transformers marks a tied parameter loaded: its source's module sets it
                ties = [t for n, t in original._parameters.items() if t is not None
                        and id(t) in unset and (f"{prefix}.{n}" if prefix else n) in tied]
                ties_before = _mark(ties + [full[id(t)] for t in ties if id(t) in full], True)
                try:
                    if module is not original:
                        owner._init_weights(module)
                    else:
                        with _locals_of(module):
                            owner._init_weights(module)
                finally:
                    _unmark(ties_before)
    finally:
        for parent, n, child in places:
            parent._modules[n] = child
        _unmark(flags)
    for i, t in full.items():
        if t._version:
            _copy_part(t, reads[i][1], reads[i][2])
    written = [(i, name) for i, (name, t, before) in unset.items()
               if local_of(t)._version != before]
    return ([name for i, name in written if i in buffers],
            [name for i, name in written if i not in buffers])


def _tensor(model: nn.Module, name: str):
    prefix, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    return module._parameters.get(attr, module._buffers.get(attr))


def tied_keys(model: nn.Module) -> Dict[str, str]:
    """``{target: source}`` of the parameters transformers ties in ``model`` (its
    ``all_tied_weights_keys``, which ``from_pretrained`` ties by); empty for another model."""
    ties = getattr(model, "all_tied_weights_keys", None)
    return dict(ties) if isinstance(ties, dict) else {}
