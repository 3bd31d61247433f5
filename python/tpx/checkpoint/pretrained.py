"""A pretrained Hugging Face model straight into TP: built on the meta device, sharded, then each
rank's part read from the checkpoint's files, safetensors or ``pytorch_model.bin``
(``tpx.from_pretrained``)."""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from .hf import checkpoint_files, load_hf_checkpoint, open_weights
from .quantized import check_quantization
from ..comm.entry import collective_call
from ..meta_init import watch as watch_meta


_WHO = "tpx.from_pretrained"


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
    """The dtype of the first floating-point tensor of the files that is not quantized (what
    transformers' ``dtype="auto"`` takes when the config names none)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        for file in checkpoint_files(path, _WHO):
            for _, t in open_weights(file, stack, _WHO):
                if t.dtype.is_floating_point and t.dtype.itemsize > 1:
                    return t.dtype
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


@collective_call("tpx.from_pretrained", lambda *a, device_mesh=None, **k: device_mesh,
                 lambda path, *a, **k: os.fspath(path))
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
    keeps whole) and filled by :func:`tpx.checkpoint.load_hf_checkpoint`: the files (safetensors,
    else ``pytorch_model.bin``, one or sharded with its index) are memory-mapped and each rank reads its slice of each tensor, through the conversions
    transformers applies on load (per-expert tensors into fused experts, renamed keys). No rank
    holds more than its part of the model plus the slice being read. Quantized checkpoints
    (block FP8, MXFP4: :mod:`tpx.checkpoint.quantized`) are read block by block, each rank the
    blocks of its slice, and dequantized to ``dtype``; another quantization method raises
    naming it. Rotary tables and other
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
    - ``strict``: a parameter the files do not hold (nor a tied one) raises ``ValueError``
      naming it on every rank before anything is loaded (``False``: a warning names it, and
      the model's ``_init_weights`` sets it as transformers sets it, from torch's default
      generator: seed every rank alike; one that no initialization sets is refused by the
      first forward until it is set); ``output_loading_info``: also return
      ``{"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"}`` as transformers
      does.

    Collective: every rank of the group calls it with the same arguments (a rank that does
    not come within ``TPX_ENTRY_GRACE`` seconds is an error on the others, before anything is
    read)."""
    import transformers

    from ..parallel import parallelize_module, plans

    if torch_dtype is not None:
        if dtype != "auto" and dtype != torch_dtype:
            raise ValueError("tpx.from_pretrained: pass `dtype` (or its older name "
                             "`torch_dtype`), not both")
        dtype = torch_dtype
    path = _resolve(pretrained_model_name_or_path, cache_dir)
    checkpoint_files(path, _WHO)  # no weights: raise before building anything
    if config is None:
        config = transformers.AutoConfig.from_pretrained(path)
    quantized = check_quantization(config, _WHO) is not None
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
    watch_meta(model)  # an empty plan too: nothing to_empty leaves reaches a forward
    shared = _shared_tensors(model)
    model.to_empty(device=torch.device(device) if device is not None
                   else _default_device(device_mesh))
    _hold_again(shared)
    info = load_hf_checkpoint(model, path, strict=strict, _who=_WHO)
    if quantized and "quantization_config" in vars(model.config):
        del model.config.quantization_config  # read dequantized: no longer a quantized model
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


def _shared_tensors(model) -> list:
    """Every tensor that several places of ``model`` hold (tied embeddings), as the places
    that hold it: ``(module, "_parameters" | "_buffers", name)``."""
    places: dict = {}
    for m in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in m.__dict__[kind].items():
                if t is not None:
                    places.setdefault(id(t), []).append((m, kind, name))
    return [p for p in places.values() if len(p) > 1]


def _hold_again(shared: list) -> None:
    """The tensors of :func:`_shared_tensors` held again by all their places, as before
    ``to_empty``: it gives a plain parameter of the meta device a new tensor at each place that
    holds it (torch's ``_apply``), which unties the tied ones (the ``DTensor`` s of a sharded
    tie are swapped in place, and stay tied)."""
    for places in shared:
        m, kind, name = places[0]
        t = m.__dict__[kind][name]
        for m, kind, name in places[1:]:
            m.__dict__[kind][name] = t
