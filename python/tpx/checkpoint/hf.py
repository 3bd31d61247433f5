"""Hugging Face safetensors checkpoints loaded into a sharded model, read slice by slice
(each rank reads only its part of each tensor)."""

from __future__ import annotations

import glob
import json
import os
import warnings
from typing import Dict, List, Tuple, Union

import torch
from torch import nn

from .full import mesh_params, sharded_params
from ..sharding import raw_state_dict
from ..param_dtensors import local_of


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors checkpoints, read slice by slice.

def _safetensors_files(path: Union[str, os.PathLike]) -> List[str]:
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
        raise FileNotFoundError(f"tpx.checkpoint.load_hf_checkpoint: no .safetensors file in "
                                f"{path!r}")
    return files


class HFLoadResult(list):
    """What :func:`load_hf_checkpoint` did not use: the list itself holds the keys of the files
    that the model has no use for (``unexpected_keys``); ``missing_keys`` are the model's
    parameters and buffers that the files did not hold, left at their current values."""

    def __init__(self, unexpected_keys: List[str], missing_keys: List[str]) -> None:
        super().__init__(unexpected_keys)
        self.missing_keys = list(missing_keys)

    @property
    def unexpected_keys(self) -> List[str]:
        return list(self)

    def __repr__(self) -> str:
        return f"HFLoadResult(missing_keys={self.missing_keys}, unexpected_keys={list(self)})"


def _hf_key_mapping(model: nn.Module):
    """``rename(file_key, model_keys) -> (model_key, conversion)``: the name a checkpoint key has
    in ``model`` by transformers' own loading rules, the ones ``from_pretrained`` applies: the
    checkpoint conversion mapping of the model's classes (GPT-NeoX: ``embed_out.`` ->
    ``lm_head.``), the legacy renamings, the base-model prefix added or dropped.
    ``conversion`` names the transformers conversion when the tensor is transformed on load
    (merged, split, permuted), not only renamed. Identity for a model that is not a
    transformers ``PreTrainedModel``, or a transformers without these rules."""
    def same(key, targets):
        return key, None

    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:
        return same
    if not isinstance(model, PreTrainedModel):
        return same
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key, targets):
        if key in targets:
            return key, None
        return rename_source_key(key, renamings, converters, prefix, targets)

    return rename


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: Union[str, os.PathLike], *,
                       strict: bool = True) -> HFLoadResult:
    """Loads a Hugging Face checkpoint (a ``.safetensors`` file, or a directory of them with or
    without ``model.safetensors.index.json``, as ``save_pretrained`` writes it) into a model
    sharded by tpx. The files are memory-mapped and each rank reads only its own slices of
    the sharded tensors (``safe_open(...).get_slice``): no rank ever holds a full copy of a
    sharded weight (a multi-dimensional layer reads its block).

    The files' keys become the model's ``state_dict()`` keys by transformers' own loading
    rules (what ``from_pretrained`` applies): the checkpoint conversion mapping of the model's
    classes (GPT-NeoX's ``save_pretrained`` writes ``embed_out.weight`` for the model's
    ``lm_head.weight``), the legacy renamings, the base-model prefix added or dropped. A key
    that transformers transforms on load (tensors merged or split) raises ``ValueError``: load
    such a model with ``from_pretrained``, then shard it. Tied parameters absent from the
    files (GPT-2's ``lm_head.weight``) are filled through their tie.

    ``strict=True``: a parameter or buffer of the model that the files do not hold (nor one
    tied to it) raises ``ValueError`` before anything is loaded. ``strict=False``: those keep
    their current values and a warning names them. Returns an :class:`HFLoadResult`: the list
    of the files' keys the model has no use for, with ``.missing_keys`` (the model's keys left
    untouched). No communication: each rank reads on its own.
    """
    from safetensors import safe_open

    sharded = {sh.key: sh for sh in sharded_params(model)}
    blocks = {ms.key: ms for ms in mesh_params(model)}
    with raw_state_dict():
        targets = dict(model.state_dict(keep_vars=True))
    rename = _hf_key_mapping(model)
    # Every file key's name in the model first: nothing changes before the checks below.
    reads: Dict[str, List[Tuple[str, str]]] = {}
    unused: List[str] = []
    found = set()
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for file_key in f.keys():
                key, conversion = rename(file_key, targets)
                if key not in targets:
                    unused.append(file_key)
                    continue
                if conversion is not None:
                    raise ValueError(
                        f"tpx.checkpoint.load_hf_checkpoint: {file_key} in {file} becomes "
                        f"{key} through a conversion that transformers applies on load "
                        f"({conversion!r}: the tensor is transformed, not only renamed), which "
                        "tpx does not read slice by slice; load the model with "
                        "from_pretrained, then shard it with tpx.parallelize_module")
                reads.setdefault(file, []).append((file_key, key))
                found.add(id(targets[key]))
    missing = [k for k, t in targets.items() if id(t) not in found]
    where = os.fspath(path)
    more = " ..." if len(missing) > 8 else ""
    if missing and strict:
        raise ValueError(
            f"tpx.checkpoint.load_hf_checkpoint: {where!r} does not hold {missing[:8]}{more} "
            f"(nor keys that transformers maps to them); nothing was loaded. Load a checkpoint "
            f"of this model, or pass strict=False to load the rest and leave these at their "
            f"current values")
    if missing:
        warnings.warn(
            f"tpx.checkpoint.load_hf_checkpoint(strict=False): {len(missing)} parameters or "
            f"buffers of the model are not in {where!r} and keep their current values: "
            f"{missing[:8]}{more}" + (f"; keys of the files not used: {unused[:8]}"
                                      f"{' ...' if len(unused) > 8 else ''}" if unused else ""),
            stacklevel=2)
    for file, keys in reads.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for file_key, key in keys:
                dst = targets[key]
                if key in sharded:
                    sh = sharded[key]
                    sl, d = f.get_slice(file_key), sh.orig_dim()
                    full_shape = sl.get_shape()
                    if len(full_shape) <= d or full_shape[d] != sh.full_size():
                        raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {file_key} in "
                                         f"{file} has shape {tuple(full_shape)}; the model "
                                         f"expects {sh.full_size()} entries along dim {d}")
                    pieces = [sl[s:e] if d == 0 else sl[:, s:e]
                              for s, e in sh.rows[sh.rank]]
                    value = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
                    if sh.transposed:
                        value = value.t()
                elif key in blocks:
                    ms = blocks[key]
                    sl = f.get_slice(file_key)
                    ms.check_full_shape(f"load_hf_checkpoint ({file})", sl.get_shape())
                    value = sl[ms.index()]
                else:
                    value = f.get_tensor(file_key)
                dst = local_of(dst)
                if tuple(value.shape) != tuple(dst.shape):
                    raise ValueError(f"tpx.checkpoint.load_hf_checkpoint: {file_key} has shape "
                                     f"{tuple(value.shape)} in {file}; the model expects "
                                     f"{tuple(dst.shape)} for {key} on this rank")
                dst.copy_(value)
    return HFLoadResult(unused, missing)
