"""Hugging Face safetensors checkpoints read into a sharded model, slice by slice: each rank
reads only its part of each tensor, through the layout conversions transformers applies on
load (per-expert tensors stacked into fused experts, gate and up concatenated, renamed and
legacy keys), and what the files do not hold is set as transformers sets it."""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import re
import warnings
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

from .full import mesh_params, sharded_params
from .hf_init import set_unloaded, tied_keys
from .lazy import (Lazy, NotSliceable, Source, TensorSource, map_pickled, map_safetensors,
                   read_local)
from .quantized import check_no_raw_float8, check_quantization, dequantized_sources
from ..layout.dtensor_io import DTensor
from ..layout.param_dtensors import local_ranges
from ..layout.sharding import raw_state_dict
from ..meta_init import unwritten

# ---------------------------------------------------------------------------------------------
# The files.

WEIGHTS_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def checkpoint_files(path: Union[str, os.PathLike],
                     what: str = "tpx.checkpoint.load_hf_checkpoint") -> List[str]:
    """The weight files of a checkpoint, as transformers picks them: ``path`` itself (a
    ``.safetensors`` or ``.bin`` file); else the ``.safetensors`` files (those
    ``model.safetensors.index.json`` names, or every one in the directory); else the
    ``pytorch_model.bin`` files (those ``pytorch_model.bin.index.json`` names, or
    ``pytorch_model.bin``, or every ``.bin`` file). ``FileNotFoundError`` naming ``what``
    when there are none."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    for index, pattern in zip(WEIGHTS_INDEX, ("*.safetensors", "*.bin")):
        index = os.path.join(path, index)
        if os.path.exists(index):
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(path, n) for n in names]
        single = os.path.join(path, "pytorch_model.bin")
        if pattern == "*.bin" and os.path.exists(single):
            return [single]
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if pattern == "*.bin":  # not the optimizer's or the trainer's files
            files = [f for f in files if os.path.basename(f).startswith(("pytorch_model",
                                                                         "model"))]
        if files:
            return files
    raise FileNotFoundError(
        f"{what}: no weights in {path!r}: neither .safetensors files (model.safetensors, or "
        "shards with model.safetensors.index.json) nor pytorch_model.bin (or shards with "
        "pytorch_model.bin.index.json). Pass the directory save_pretrained wrote")


def open_weights(file: str, stack: contextlib.ExitStack, what: str) -> List[Tuple[str, Lazy]]:
    """The tensors of one weight file as ``(key, lazy tensor)``, nothing read yet: a
    safetensors file through ``safe_open`` and its memory map, a ``.bin`` file memory-mapped
    by ``torch.load`` (``weights_only``)."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        f = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
        mapped = map_safetensors(file)
        return [(k, Source(f.get_slice(k), k, file, mapped.get(k))) for k in f.keys()]
    return [(k, TensorSource(t, k, file)) for k, t in map_pickled(file, what).items()]


class HFLoadResult(list):
    """What :func:`load_hf_checkpoint` did not use: the list itself holds the keys of the files
    that the model has no use for (``unexpected_keys``); ``missing_keys`` are the model's
    parameters and buffers that the files did not hold, as transformers reports them (a tied
    parameter filled through its tie is not missing, nor a key the model's
    ``_keys_to_ignore_on_load_missing`` names); ``initialized`` those of them (and the ignored
    ones) that were fresh from ``to_empty`` and were set by the model's ``_init_weights``, as
    ``from_pretrained`` sets them; ``recomputed`` the buffers the files do not hold
    (non-persistent ones: rotary tables) that were set as transformers sets them when it loads
    the model."""

    def __init__(self, unexpected_keys: List[str], missing_keys: List[str],
                 recomputed: Sequence[str] = (), initialized: Sequence[str] = ()) -> None:
        super().__init__(unexpected_keys)
        self.missing_keys = list(missing_keys)
        self.recomputed = list(recomputed)
        self.initialized = list(initialized)

    @property
    def unexpected_keys(self) -> List[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"HFLoadResult(missing_keys={self.missing_keys}, unexpected_keys={list(self)})"


# ---------------------------------------------------------------------------------------------
# File keys -> the model's tensors, as lazy tensors.

class _FullShapes:
    """``model`` as transformers' converters see it, with each parameter at its FULL shape
    (``Split`` sizes its pieces, ``Transpose(check_dims=True)`` compares shapes, by
    ``model.get_parameter``); everything else is the model's."""

    def __init__(self, model: nn.Module, shapes: Dict[str, torch.Size]) -> None:
        self._model, self._shapes = model, shapes

    def get_parameter(self, name: str):
        shape = self._shapes.get(name)
        if shape is None:
            return self._model.get_parameter(name)
        return torch.empty(shape, device="meta")

    def __getattr__(self, name):
        return getattr(self._model, name)


def _transformers_rules(model: nn.Module):
    """``(renamings, converters, prefix)`` of the conversions transformers applies when it
    loads ``model`` (``get_model_conversion_mapping``), or ``None`` for a model that is not a
    transformers ``PreTrainedModel`` (or a transformers without these rules)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)],
            getattr(model, "base_model_prefix", None) or None)


def _conversion_name(conv) -> str:
    ops = getattr(conv, "operations", None) or []
    return (f"{type(conv).__name__}({conv.source_patterns} -> {conv.target_patterns}: "
            f"{', '.join(type(o).__name__ for o in ops)})")


def plan_reads(model: nn.Module, opened: List[List[Tuple[str, Lazy]]],
               targets: Dict[str, torch.Tensor], shapes: Dict[str, torch.Size], what: str):
    """The model's keys as lazy tensors of the files (``opened``: each file's
    :func:`open_weights`): ``(lazy, unused)``, ``lazy`` mapping a
    model key to the :class:`Lazy` it loads from, ``unused`` the file keys the model has no
    use for. Keys are renamed and tensors converted by transformers' own rules for the model
    (the ones ``from_pretrained`` applies), the conversions run on lazy tensors: nothing is
    read here. A conversion that cannot be read slice by slice raises ``ValueError`` naming
    it."""
    rules = _transformers_rules(model)
    sources: List[Tuple[str, Lazy]] = [kv for tensors in opened for kv in tensors]
    who = what if what.startswith("tpx.") else f"tpx.checkpoint.{what}"
    sources = dequantized_sources(
        sources, check_quantization(getattr(model, "config", None), who), who)
    lazy: Dict[str, Lazy] = {}
    unused: List[str] = []
    if rules is None:
        for file_key, src in sources:
            if file_key in targets:
                lazy[file_key] = src
            else:
                unused.append(file_key)
        check_no_raw_float8(lazy, who)
        return lazy, unused

    from transformers.core_model_loading import dot_natural_key, rename_source_key

    # transformers' own order (experts.10 after experts.9): the order a converter stacks in
    sources.sort(key=lambda kv: dot_natural_key(kv[0]))
    renamings, converters, prefix = rules
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: Dict[str, object] = {}  # first target key -> its converter (a copy per target)
    for file_key, src in sources:
        key, pattern = rename_source_key(file_key, renamings, converters, prefix, targets)
        if key not in targets and file_key in targets:
            key, pattern = file_key, None
        if key not in targets:
            unused.append(file_key)
            continue
        if pattern is None:
            lazy[key] = src
            continue
        conv = pending.get(key)
        if conv is None:
            conv = pending[key] = copy.deepcopy(by_pattern[pattern])
        conv.add_tensor(key, file_key, pattern, src)
    view = _FullShapes(model, shapes)
    for key, conv in pending.items():
        try:
            out = conv.convert(key, model=view, config=getattr(model, "config", None))
        except NotSliceable as e:
            raise ValueError(
                f"{who}: {key} is made by transformers' conversion "
                f"{_conversion_name(conv)}, which tpx does not read slice by slice ({e}); "
                "nothing was loaded") from None
        except Exception as e:  # noqa: BLE001 - a conversion that fails names itself
            raise ValueError(
                f"{who}: transformers' conversion {_conversion_name(conv)} "
                f"failed on the files' tensors for {key}: {type(e).__name__}: {e}; nothing "
                "was loaded") from None
        for name, value in out.items():
            value = value[0] if isinstance(value, list) else value
            if not isinstance(value, Lazy):
                raise ValueError(f"{who}: transformers' conversion "
                                 f"{_conversion_name(conv)} gave {type(value).__name__} for "
                                 f"{name}; nothing was loaded")
            if name in targets:
                lazy[name] = value
            else:
                unused.append(name)
    check_no_raw_float8(lazy, who)
    return lazy, unused


# ---------------------------------------------------------------------------------------------
# What each rank reads.

def local_reads(model: nn.Module, targets: Dict[str, torch.Tensor], layouts: bool = True):
    """For each model key: ``(full shape in the original orientation, per-dim ranges of the
    full tensor this rank holds, the local tensor seen in the original orientation)``.
    ``layouts=False``: read every tensor's layout from its ``DTensor`` placements alone, not
    from tpx's layers (FSDP2 splits them further: ``targets`` is then its state dict)."""
    out = {}
    for sh in (sharded_params(model) if layouts else ()):
        if sh.key not in targets:
            continue
        local = sh.local()
        view = local.t() if sh.transposed else local
        full = list(view.shape)
        d = sh.orig_dim()
        full[d] = sh.full_size()
        ranges = [[(0, n)] for n in view.shape]
        ranges[d] = list(sh.rows[sh.rank])
        out[sh.key] = (torch.Size(full), ranges, view)
    for ms in (mesh_params(model) if layouts else ()):
        if ms.key in targets and ms.key not in out:
            out[ms.key] = (torch.Size(ms.spec.full_shape),
                           [[r] for r in ms.spec.ranges(ms.info)], ms.local())
    for key, t in targets.items():
        if key in out or not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            out[key] = (t.shape, local_ranges(t), t._local_tensor)
        else:
            out[key] = (t.shape, [[(0, n)] for n in t.shape], t)
    return out


# ---------------------------------------------------------------------------------------------
# What the files do not hold.

def init_unsaved_buffers(model: nn.Module) -> List[str]:
    """Sets the non-persistent buffers of a transformers model (rotary tables, position ids,
    Falcon-H1's muP vector) as ``from_pretrained`` sets them after it loads the files: the
    owning model's ``_init_weights`` on every module (a model may set a buffer of a child),
    with every parameter and saved buffer marked as loaded, so that only the non-persistent
    buffers are written (transformers' ``init`` functions skip marked tensors). Returns the
    names of the buffers that were set; nothing for a model that is not a transformers
    ``PreTrainedModel``."""
    return set_unloaded(model)[0]


# ---------------------------------------------------------------------------------------------
# The call.

@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                       strict: bool = True,
                       _who: str = "tpx.checkpoint.load_hf_checkpoint") -> HFLoadResult:
    """Loads a Hugging Face checkpoint (a ``.safetensors`` file, or a directory of them with or
    without ``model.safetensors.index.json``, as ``save_pretrained`` writes it; or the
    ``pytorch_model.bin`` files of older checkpoints, one or sharded with
    ``pytorch_model.bin.index.json``, memory-mapped) into a model
    sharded by tpx (or any model: unsharded tensors are read whole). The files are
    memory-mapped and each rank reads only its own slices of the sharded tensors
    (``safe_open(...).get_slice``): no rank ever holds a full copy of a sharded weight (a
    multi-dimensional layer reads its block, a ``DTensor`` of a style tpx did not write its
    local part), and a tensor is read straight into the parameter, in the files' dtype
    converted once (bf16 files into a bf16 model: no float32 detour).

    The files' keys and tensors become the model's by transformers' own loading rules (the
    ones ``from_pretrained`` applies, ``get_model_conversion_mapping``): renamed and legacy keys
    (GPT-NeoX's ``embed_out.weight`` is ``lm_head.weight``), the base-model prefix added or
    dropped, and the conversions that merge tensors, such as a mixture of experts saved per
    expert (``experts.0.gate_proj.weight`` ...) into the fused ``experts.gate_up_proj``, read
    slice by slice (each rank reads its rows of each expert). A conversion tpx cannot read by
    slices raises ``ValueError`` naming it, before anything is loaded.

    What the files do not hold: tied parameters are filled through their tie (transformers'
    ``all_tied_weights_keys``: a tied parameter that a plan sharded apart from its tie reads
    its part of the other's tensor); the non-persistent buffers of a transformers model
    (rotary tables) are set as ``from_pretrained`` sets them (the model's ``_init_weights``),
    so a model built on the meta device and materialized with ``to_empty`` is complete after
    this call.

    ``strict=True``: a parameter or saved buffer of the model that the files do not hold (nor
    one tied to it) raises ``ValueError`` naming it before anything is loaded, as do keys
    transformers reports missing; so does a tensor whose shape differs from the model's.
    ``strict=False``: a warning names the missing ones; those fresh from ``to_empty`` (a model
    tpx sharded on the meta device, or ``tpx.from_pretrained``'s) are set by the model's
    ``_init_weights`` as ``from_pretrained`` sets them (from torch's default generator, whole
    on every rank and each rank's part kept: seed every rank alike, as
    ``tpx.random.manual_seed`` does), the others keep their current values; one that no
    initialization sets is named and refused by the first forward. Keys the model's
    ``_keys_to_ignore_on_load_missing`` names are set so too, and not reported. Returns an
    :class:`HFLoadResult`: the list of the files' keys the model has no use for, with
    ``.missing_keys`` (as transformers reports them) and ``.initialized``. No communication:
    each rank reads on its own.
    """
    files = checkpoint_files(path, _who)
    with raw_state_dict():
        targets = dict(model.state_dict(keep_vars=True))
    reads = local_reads(model, targets)
    shapes = {k: v[0] for k, v in reads.items()}
    where = os.fspath(path)
    with contextlib.ExitStack() as stack:
        opened = [open_weights(f, stack, _who) for f in files]
        lazy, unused = plan_reads(model, opened, targets, shapes, _who)
        # Tied parameters the model holds apart (a plan that shards one of them): each is read
        # from the files' tensor of the other, as from_pretrained ties it to the one present.
        found = {id(targets[k]) for k in lazy}
        for target, source in tied_keys(model).items():
            for a, b in ((target, source), (source, target)):
                if (a in targets and b in lazy and id(targets[a]) not in found
                        and targets[a] is not targets[b]):
                    lazy[a] = lazy[b]
                    found.add(id(targets[a]))
        # Every check before anything changes.
        absent = [k for k, t in targets.items() if id(t) not in found]
        ignored = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
        ignored = re.compile("|".join(f"({p})" for p in ignored)) if ignored else None
        missing = [k for k in absent if ignored is None or ignored.search(k) is None]
        for key, src in lazy.items():
            full = shapes[key]
            if tuple(src.shape) != tuple(full):
                srcs = src.sources()
                named = (f"{srcs[0].key} in {srcs[0].file}" if len(srcs) == 1
                         else f"{len(srcs)} tensors of the files")
                raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {named} give {key} the "
                                 f"shape {tuple(src.shape)}; the model expects {tuple(full)}. "
                                 "Nothing was loaded")
        meta = [k for k in lazy if reads[k][2].device.type == "meta"]
        if meta:
            raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {meta[:4]} are on the meta "
                             "device: materialize the model first (model.to_empty(device=...)), "
                             "or use tpx.from_pretrained. Nothing was loaded")
        if missing and strict:
            raise ValueError(
                f"tpx.checkpoint.load_hf_checkpoint: {where!r} does not hold {_few(missing)} "
                "(nor keys that transformers maps to them, nor a parameter tied to them); "
                "nothing was loaded. Load a checkpoint of this model, or pass strict=False to "
                "load the rest (these then keep their values, or, fresh from to_empty, are set "
                "by the model's _init_weights as transformers' from_pretrained sets them)")
        for key, src in lazy.items():
            _, ranges, dst = reads[key]
            read_local(src, ranges, dst)
    fresh = set(unwritten(model)) if absent else set()
    recomputed, initialized = set_unloaded(
        model, {k: (targets[k], reads[k]) for k in absent if k in fresh and k in reads})
    done = {id(targets[k]) for k in initialized}
    initialized = [k for k in absent if id(targets[k]) in done]
    if missing:
        inited = [k for k in missing if id(targets[k]) in done]
        kept = [k for k in missing if k not in fresh]
        left = [k for k in missing if k in fresh and id(targets[k]) not in done]
        warnings.warn(
            f"tpx.checkpoint.load_hf_checkpoint(strict=False): {len(missing)} parameters or "
            f"buffers of the model are not in {where!r}: {_few(missing)}"
            + (f"; set by the model's _init_weights, as transformers' from_pretrained sets "
               f"them: {_few(inited)}" if inited else "")
            + (f"; keep their current values: {_few(kept)}" if kept else "")
            + (f"; still hold what to_empty left (the model's _init_weights does not set "
               f"them), which the first forward refuses until they are set: {_few(left)}"
               if left else "")
            + (f"; keys of the files not used: {_few(unused)}" if unused else ""),
            stacklevel=2)
    return HFLoadResult(unused, missing, recomputed, initialized)


def _few(keys: List[str]) -> str:
    return f"{keys[:8]}{' ...' if len(keys) > 8 else ''}"
