"""A pretrained Hugging Face model straight into TP: built on the meta device, sharded, then each
rank's part read from the safetensors files (``tpx.from_pretrained``)."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from .hf import load_hf_checkpoint, safetensors_files


def _resolve(name_or_path: Union[str, os.PathLike], cache_dir=None) -> str:
    """A checkpoint directory: ``name_or_path`` itself, or the snapshot of that Hub id in the
    local Hugging Face cache (nothing is downloaded)."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=path, local_files_only=True, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - one message for every way it is not there
        raise FileNotFoundError(
            f"tpx.from_pretrained: {path!r} is neither a directory nor a model in the local "
            f"Hugging Face cache ({type(e).__name__}); download it first (huggingface-cli "
            "download <id>, or transformers' from_pretrained on one process), then pass its id "
            "or directory") from None


def _files_dtype(path: str) -> Optional[torch.dtype]:
    """The dtype of the first floating-point tensor of the files (what transformers'
    ``dtype="auto"`` takes when the config names none)."""
    from safetensors import safe_open

    from .lazy import SAFETENSORS_DTYPES

    for file in safetensors_files(path, "from_pretrained"):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                dtype = SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if dtype is not None and dtype.is_floating_point:
                    return dtype
    return None


def _dtype(dtype, config, path: str) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(named, str):
            named = getattr(torch, named, None)
        if isinstance(named, torch.dtype):
            return named
        return _files_dtype(path) or torch.get_default_dtype()
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"tpx.from_pretrained: `dtype` must be a torch.dtype, its name, 'auto' or "
                     f"None; got {dtype!r}")


def _default_device(device_mesh) -> torch.device:
    """CUDA (this process's current device) when the TP group runs on NCCL, else the CPU."""
    if torch.cuda.is_available():
        group = device_mesh if isinstance(device_mesh, dist.ProcessGroup) else None
        try:
            backend = dist.get_backend(group) if dist.is_initialized() else None
        except Exception:  # noqa: BLE001 - a mesh: its device type says it
            backend = None
        mesh_type = getattr(device_mesh, "device_type", None)
        if backend == "nccl" or mesh_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def from_pretrained(pretrained_model_name_or_path: Union[str, os.PathLike], *,
                    model_class=None, config=None, dtype="auto", torch_dtype=None,
                    device_mesh=None, plan=None, layout: str = "1d",
                    sequence_parallel: bool = False, loss_parallel: bool = False,
                    experts: str = "tp", device=None, strict: bool = True,
                    attn_implementation: Optional[str] = None, cache_dir=None,
                    output_loading_info: bool = False, **model_kwargs):
    """A pretrained Hugging Face model, sharded over TP, each rank reading only its part of
    the checkpoint: ``tpx.from_pretrained("meta-llama/Llama-3.1-8B", dtype=torch.bfloat16)``
    on every rank gives what ``transformers.AutoModelForCausalLM.from_pretrained`` gives on one
    device, sharded as ``tpx.parallelize_module(model, device_mesh, plan)`` shards it.

    The model is built on the meta device, sharded (``plan``, by default
    ``tpx.plans.auto(model, layout=, sequence_parallel=, loss_parallel=, experts=)``),
    materialized on ``device`` (``to_empty``: each rank allocates its shards and the tensors it
    keeps whole) and filled by :func:`tpx.checkpoint.load_hf_checkpoint`: the safetensors files
    are memory-mapped and each rank reads its slice of each tensor, through the conversions
    transformers applies on load (per-expert tensors into fused experts, renamed keys). No rank
    holds more than its part of the model plus the slice being read. Rotary tables and other
    non-persistent buffers are set as transformers sets them, tied weights stay tied, the
    generation config is read, and the model is returned in eval mode, as
    ``from_pretrained`` returns it.

    Arguments, named as transformers names them:

    - ``pretrained_model_name_or_path``: a directory written by ``save_pretrained``, or
      a Hub id already in the local cache (``cache_dir``: another cache than the default;
      nothing is downloaded: every rank would fetch it).
    - ``model_class``: the class to build (default ``transformers.AutoModelForCausalLM``; any
      auto class or model class); ``config``: a config to use instead of the directory's;
      ``dtype`` (``torch_dtype`` is its older name): ``"auto"`` (the default: the config's
      dtype, else the files'), a ``torch.dtype`` or its name; ``attn_implementation`` and
      other ``model_kwargs`` go to the model's constructor.
    - ``device_mesh``: the TP group or 1-D ``DeviceMesh`` (default: the whole world), or a mesh
      from ``tpx.init_mesh(layout)`` for the multi-dimensional layouts; ``plan``: a plan of your
      own instead of ``tpx.plans.auto``'s; ``device``: where the shards live (default: the
      current CUDA device when the group runs on NCCL, else the CPU).
    - ``strict``: a parameter the files do not hold raises ``ValueError`` before anything is
      loaded (``False``: it keeps its initialization, and the first forward raises unless it is
      set by then); ``output_loading_info``: also return
      ``{"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}`` as transformers
      does.

    Collective: every rank of the group calls it with the same arguments."""
    import transformers

    from ..parallel import parallelize_module, plans

    if torch_dtype is not None:
        if dtype != "auto" and dtype != torch_dtype:
            raise ValueError("tpx.from_pretrained: pass `dtype` (or its older name "
                             "`torch_dtype`), not both")
        dtype = torch_dtype
    path = _resolve(pretrained_model_name_or_path, cache_dir)
    safetensors_files(path, "from_pretrained")  # no weights: raise before building anything
    if config is None:
        config = transformers.AutoConfig.from_pretrained(path)
    dtype = _dtype(dtype, config, path)
    cls = model_class or transformers.AutoModelForCausalLM
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        if hasattr(cls, "from_config"):  # an auto class
            model = cls.from_config(config, dtype=dtype, **model_kwargs)
        else:
            model = cls._from_config(config, dtype=dtype, **model_kwargs)
    if plan is None:
        plan = plans.auto(model, layout=layout, sequence_parallel=sequence_parallel,
                          loss_parallel=loss_parallel, experts=experts)
    parallelize_module(model, device_mesh, plan)
    model.to_empty(device=torch.device(device) if device is not None
                   else _default_device(device_mesh))
    info = load_hf_checkpoint(model, path, strict=strict)
    model.eval()
    try:
        model.config.name_or_path = os.fspath(pretrained_model_name_or_path)
    except AttributeError:
        pass
    if (getattr(model, "can_generate", lambda: False)()
            and os.path.exists(os.path.join(path, "generation_config.json"))):
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    if output_loading_info:
        return model, {"missing_keys": list(info.missing_keys),
                       "unexpected_keys": list(info.unexpected_keys),
                       "mismatched_keys": [], "error_msgs": []}
    return model
