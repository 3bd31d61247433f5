"""peft's adapters of a model whose layers tpx shards, written as peft writes them, every rank
writing the parts it holds: ``peft_model.save_pretrained(dir)`` called on every rank.

The files are peft's: for each adapter, ``adapter_model.safetensors`` (the tensors peft's
``get_peft_model_state_dict`` selects, under its names, in the adapter's dtype) and
``adapter_config.json`` (in a sub-folder named after the adapter unless it is "default"), and
the model card ``README.md``. peft chooses what is written (its own function runs on the
model's state dict, whose tensors tpx's writer then places in the file); tpx writes the bytes:
rank 0 creates the file, each rank writes the rows of each tensor it owns, so no rank gathers a
tensor. Plain ``PeftModel.from_pretrained`` reads the directory on one device,
``PeftModel.from_pretrained`` / ``load_adapter`` on a model tpx sharded at any degree."""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .hf import local_reads
from .hf_write import Placeholder, SavedFiles, model_tensors, sync_errors, write_files
from ..comm.entry import collective_call
from ..comm.groups import resolve_group

_WHO = "tpx.checkpoint.save_adapters"


def _adapter_files(model, targets, shapes, adapter: str, save_embedding_layers):
    """peft's tensors of one adapter as placeholders of the model's tensors; raises if peft
    gives a tensor that is not one of the model's (it computed it)."""
    from peft.utils import get_peft_model_state_dict

    key_of: Dict[int, str] = {}
    for k, t in targets.items():
        key_of.setdefault(id(t), k)
    chosen = get_peft_model_state_dict(model, state_dict=dict(targets), adapter_name=adapter,
                                       save_embedding_layers=save_embedding_layers)
    files = {}
    for name, t in chosen.items():
        key = key_of.get(id(t))
        if key is None or not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{_WHO}: peft's {name!r} of adapter {adapter!r} is not a tensor of the model "
                "(peft computed it), so it has no owner among the ranks. Write the full "
                "adapter instead: full = tpx.checkpoint.full_state_dict(model, "
                "rank0_only=True) on every rank, then model.save_pretrained(path, "
                "state_dict=full) on rank 0. Nothing was written")
        files[name] = Placeholder(key, shapes[key], targets[key].dtype)
    return files


@torch.no_grad()
@collective_call(f"peft's save_pretrained ({_WHO})", lambda *a, group=None, **k: resolve_group(group),
                 lambda model, save_directory, *a, **k: os.fspath(save_directory))
def save_adapters(model: nn.Module, save_directory, *, safe_serialization: bool = True,
                  selected_adapters: Optional[Sequence[str]] = None,
                  save_embedding_layers="auto", is_main_process: bool = True,
                  path_initial_model_for_weight_conversion=None, group=None,
                  **kwargs) -> Dict[str, SavedFiles]:
    """Writes the adapters of ``model`` (a peft ``PeftModel`` whose layers tpx shards, in
    either order) under ``save_directory`` as peft's ``save_pretrained`` does, with every
    rank of ``group`` (default: the whole world) writing the parts of the tensors it holds.
    peft's ``save_pretrained`` of such a model calls this; call it on every rank.

    Takes peft's options: ``selected_adapters`` (default: all), ``save_embedding_layers``
    (an embedding sharded over the vocabulary is written by its owners too).
    ``is_main_process`` is accepted and ignored (every rank writes its part; rank 0 writes
    the configs and the model card). Refused before anything is written:
    ``safe_serialization=False`` and ``path_initial_model_for_weight_conversion`` (PiSSA /
    OLoRA conversion: use a full state dict, as the error says). Returns, for each adapter,
    the files written (:class:`tpx.checkpoint.hf_write.SavedFiles`, with the bytes of tensor
    data this rank wrote)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(f"{_WHO}: `model` must be a peft PeftModel; got {type(model).__name__}")
    path = os.fspath(save_directory)
    if os.path.isfile(path):
        raise ValueError(f"{_WHO}: save_directory ({path}) must be a directory, not a file")
    if kwargs:
        raise TypeError(f"{_WHO}: unexpected options {sorted(kwargs)} (peft's push-to-hub "
                        "options are not taken here); nothing was written")
    full = ("full = tpx.checkpoint.full_state_dict(model, rank0_only=True) on every rank, "
            "then model.save_pretrained(path, state_dict=full, ...) on rank 0")
    if safe_serialization is False:
        raise ValueError(f"{_WHO}: safe_serialization=False (a pickled adapter_model.bin) is "
                         f"written from the full adapter: {full}. Nothing was written")
    if path_initial_model_for_weight_conversion is not None:
        raise ValueError(f"{_WHO}: path_initial_model_for_weight_conversion converts the "
                         f"adapter from its full weights: {full}. Nothing was written")
    names = list(model.peft_config) if selected_adapters is None else list(selected_adapters)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown:
        raise ValueError(f"{_WHO}: selected_adapters names {unknown}; the model's adapters "
                         f"are {list(model.peft_config)}")

    pg = resolve_group(group)
    targets, layouts = model_tensors(model, _WHO)
    shapes = {k: v[0] for k, v in local_reads(model, targets, layouts).items()}
    plans = [(n, _adapter_files(model, targets, shapes, n, save_embedding_layers))
             for n in names]  # every adapter checked before anything is written

    rank = dist.get_rank(pg)
    error = None
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            model.create_or_update_model_card(path)
        except Exception as e:  # noqa: BLE001 - raised on every rank by sync_errors
            error = e
    sync_errors(pg, error, "writing the model card", _WHO)
    out: Dict[str, SavedFiles] = {}
    for name, files in plans:
        target = path if name == "default" else os.path.join(path, name)
        plan, written = write_files(model, targets, files, target, math.inf, pg,
                                    single="adapter_model.safetensors", what=_WHO,
                                    layouts=layouts)
        if rank == 0:
            try:
                _write_config(model, name, target)
            except Exception as e:  # noqa: BLE001
                error = e
        sync_errors(pg, error, "writing the adapter's config", _WHO)
        out[name] = SavedFiles(p[0] for p in plan)
        out[name].bytes_written = written
    return out


def _write_config(model, name: str, target: str) -> None:
    """``adapter_config.json`` as peft writes it: the base model's name filled in, inference
    mode on in the file (not in the model), the auto-class mapping where no task type is set."""
    config = model.peft_config[name]
    if config.base_model_name_or_path is None:
        holder = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = holder.__dict__.get("name_or_path", None) or None
    mapping = None
    if config.task_type is None:
        cls = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        mapping = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    inference = config.inference_mode
    config.inference_mode = True
    try:
        config.save_pretrained(target, auto_mapping_dict=mapping)
    finally:
        config.inference_mode = inference


__all__: List[str] = ["save_adapters"]
