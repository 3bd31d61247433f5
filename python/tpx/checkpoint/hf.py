"""Hugging Face safetensors checkpoints read into a sharded model, slice by slice: each rank
reads only its part of each tensor, through the layout conversions transformers applies on
load (per-expert tensors stacked into fused experts, gate and up concatenated, renamed and
legacy keys), and what the files do not hold is set as transformers sets it."""

from __future__ import annotations

import contextlib
import copy
import glob
import itertools
import json
import os
import warnings
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

from .full import mesh_params, sharded_params
from .lazy import Lazy, NotSliceable, Source, map_safetensors
from ..layout.dtensor_io import DTensor
from ..layout.param_dtensors import local_ranges
from ..layout.sharding import raw_state_dict

Ranges = List[List[Tuple[int, int]]]


# ---------------------------------------------------------------------------------------------
# The files.

def safetensors_files(path: Union[str, os.PathLike], what: str = "load_hf_checkpoint"
                      ) -> List[str]:
    """The ``.safetensors`` files of a checkpoint: ``path`` itself (a file), the files its
    ``model.safetensors.index.json`` names, or every ``.safetensors`` file in the directory."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"tpx.checkpoint.{what}: no .safetensors file in {path!r}")
    return files


class HFLoadResult(list):
    """What :func:`load_hf_checkpoint` did not use: the list itself holds the keys of the files
    that the model has no use for (``unexpected_keys``); ``missing_keys`` are the model's
    parameters and buffers that the files did not hold, left at their current values;
    ``recomputed`` the buffers the files do not hold (non-persistent ones: rotary tables) that
    were set as transformers sets them when it loads the model."""

    def __init__(self, unexpected_keys: List[str], missing_keys: List[str],
                 recomputed: Sequence[str] = ()) -> None:
        super().__init__(unexpected_keys)
        self.missing_keys = list(missing_keys)
        self.recomputed = list(recomputed)

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


def plan_reads(model: nn.Module, files: List[str], opened, targets: Dict[str, torch.Tensor],
               shapes: Dict[str, torch.Size], what: str):
    """The model's keys as lazy tensors of the files: ``(lazy, unused)``, ``lazy`` mapping a
    model key to the :class:`Lazy` it loads from, ``unused`` the file keys the model has no
    use for. Keys are renamed and tensors converted by transformers' own rules for the model
    (the ones ``from_pretrained`` applies), the conversions run on lazy tensors: nothing is
    read here. A conversion that cannot be read slice by slice raises ``ValueError`` naming
    it."""
    rules = _transformers_rules(model)
    sources: List[Tuple[str, Source]] = []
    for file, f in zip(files, opened):
        mapped = map_safetensors(file)
        for file_key in f.keys():
            sources.append((file_key, Source(f.get_slice(file_key), file_key, file,
                                             mapped.get(file_key))))
    lazy: Dict[str, Lazy] = {}
    unused: List[str] = []
    if rules is None:
        for file_key, src in sources:
            if file_key in targets:
                lazy[file_key] = src
            else:
                unused.append(file_key)
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
                f"tpx.checkpoint.{what}: {key} is made by transformers' conversion "
                f"{_conversion_name(conv)}, which tpx does not read slice by slice ({e}); "
                "nothing was loaded") from None
        except Exception as e:  # noqa: BLE001 - a conversion that fails names itself
            raise ValueError(
                f"tpx.checkpoint.{what}: transformers' conversion {_conversion_name(conv)} "
                f"failed on the files' tensors for {key}: {type(e).__name__}: {e}; nothing "
                "was loaded") from None
        for name, value in out.items():
            value = value[0] if isinstance(value, list) else value
            if not isinstance(value, Lazy):
                raise ValueError(f"tpx.checkpoint.{what}: transformers' conversion "
                                 f"{_conversion_name(conv)} gave {type(value).__name__} for "
                                 f"{name}; nothing was loaded")
            if name in targets:
                lazy[name] = value
            else:
                unused.append(name)
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


def read_local(src: Lazy, ranges: Ranges, dst: torch.Tensor) -> None:
    """Reads the blocks ``ranges`` (per dim, in local order) of ``src`` into ``dst``."""
    per_dim = []
    for rs in ranges:
        offs, o = [], 0
        for s, e in rs:
            offs.append((s, e, o))
            o += e - s
        per_dim.append(offs)
    if not per_dim:  # a scalar
        src.read_into((), dst)
        return
    for combo in itertools.product(*per_dim):
        view = dst
        for d, (s, e, o) in enumerate(combo):
            view = view.narrow(d, o, e - s)
        src.read_into(tuple((s, e) for s, e, _ in combo), view)


# ---------------------------------------------------------------------------------------------
# What the files do not hold.

def _owners(model: nn.Module):
    """``(name, module, owning PreTrainedModel)`` of every module: the nearest transformers
    model above it (the one whose ``_init_weights`` transformers calls on it)."""
    from transformers import PreTrainedModel

    def walk(prefix, module, owner):
        if isinstance(module, PreTrainedModel):
            owner = module
        yield prefix, module, owner
        for name, child in module.named_children():
            yield from walk(f"{prefix}.{name}" if prefix else name, child, owner)

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


def init_unsaved_buffers(model: nn.Module) -> List[str]:
    """Sets the non-persistent buffers of a transformers model (rotary tables, position ids,
    Falcon-H1's muP vector) as ``from_pretrained`` sets them after it loads the files: the
    owning model's ``_init_weights`` on every module (a model may set a buffer of a child),
    with every parameter and saved buffer marked as loaded, so that only the non-persistent
    buffers are written (transformers' ``init`` functions skip marked tensors). Returns the
    names of the buffers that were set; nothing for a model that is not a transformers
    ``PreTrainedModel``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    try:
        from transformers import initialization as hf_init
        guard = hf_init.guard_torch_init_functions()
    except (ImportError, AttributeError):
        guard = contextlib.nullcontext()
    unsaved = {}  # id -> (name, buffer, version before)
    for prefix, module in model.named_modules():
        for n in module._non_persistent_buffers_set:
            buf = module._buffers.get(n)
            if buf is not None and id(buf) not in unsaved and buf.device.type != "meta":
                unsaved[id(buf)] = (f"{prefix}.{n}" if prefix else n, buf, buf._version)
    if not unsaved:
        return []
    kept = {id(t): t for t in list(model.parameters()) + list(model.buffers())
            if id(t) not in unsaved}
    flags = [(t, t.__dict__.get("_is_hf_initialized")) for t in kept.values()]
    for t in kept.values():
        t._is_hf_initialized = True
    for _, buf, _ in unsaved.values():
        buf.__dict__.pop("_is_hf_initialized", None)
    try:
        with guard:
            for prefix, module, owner in _owners(model):
                values = getattr(module, "_tpx_buffer_values", None)
                if values:  # a tpx module in place of one whose buffers transformers sets
                    for n, value in values.items():
                        buf = module._buffers.get(n)
                        if buf is not None and buf.device.type != "meta":
                            buf.fill_(value)
                elif owner is not None:
                    with _locals_of(module):
                        owner._init_weights(module)
    finally:
        for t, flag in flags:
            if flag is None:
                t.__dict__.pop("_is_hf_initialized", None)
            else:
                t._is_hf_initialized = flag
    return [name for name, buf, before in unsaved.values() if buf._version != before]


# ---------------------------------------------------------------------------------------------
# The call.

@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                       strict: bool = True) -> HFLoadResult:
    """Loads a Hugging Face checkpoint (a ``.safetensors`` file, or a directory of them with or
    without ``model.safetensors.index.json``, as ``save_pretrained`` writes it) into a model
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

    What the files do not hold: tied parameters are filled through their tie; the
    non-persistent buffers of a transformers model (rotary tables) are set as
    ``from_pretrained`` sets them (the model's ``_init_weights``), so a model built on the meta
    device and materialized with ``to_empty`` is complete after this call.

    ``strict=True``: a parameter or saved buffer of the model that the files do not hold (nor
    one tied to it) raises ``ValueError`` before anything is loaded; so does a tensor whose
    shape differs from the model's. ``strict=False``: missing ones keep their current values
    and a warning names them. Returns an :class:`HFLoadResult`: the list of the files' keys the
    model has no use for, with ``.missing_keys`` (the model's keys left untouched). No
    communication: each rank reads on its own.
    """
    from safetensors import safe_open

    files = safetensors_files(path)
    with raw_state_dict():
        targets = dict(model.state_dict(keep_vars=True))
    reads = local_reads(model, targets)
    shapes = {k: v[0] for k, v in reads.items()}
    where = os.fspath(path)
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(f, framework="pt", device="cpu"))
                  for f in files]
        lazy, unused = plan_reads(model, files, opened, targets, shapes, "load_hf_checkpoint")
        # Every check before anything changes.
        found = {id(targets[k]) for k in lazy}
        missing = [k for k, t in targets.items() if id(t) not in found]
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
        more = " ..." if len(missing) > 8 else ""
        if missing and strict:
            raise ValueError(
                f"tpx.checkpoint.load_hf_checkpoint: {where!r} does not hold {missing[:8]}{more} "
                f"(nor keys that transformers maps to them); nothing was loaded. Load a "
                f"checkpoint of this model, or pass strict=False to load the rest and leave "
                f"these at their current values")
        if missing:
            warnings.warn(
                f"tpx.checkpoint.load_hf_checkpoint(strict=False): {len(missing)} parameters or "
                f"buffers of the model are not in {where!r} and keep their current values: "
                f"{missing[:8]}{more}" + (f"; keys of the files not used: {unused[:8]}"
                                          f"{' ...' if len(unused) > 8 else ''}" if unused else ""),
                stacklevel=2)
        for key, src in lazy.items():
            _, ranges, dst = reads[key]
            read_local(src, ranges, dst)
    recomputed = init_unsaved_buffers(model)
    return HFLoadResult(unused, missing, recomputed)
