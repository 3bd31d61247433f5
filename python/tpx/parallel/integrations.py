"""What other libraries see of a model tpx sharded: transformers' and peft's
``save_pretrained`` write it with every rank writing its part; peft's dispatch wraps tpx's
linear layers with tpx's LoRA layers (no ``register`` step), peft imported before or after."""

from __future__ import annotations

from torch import nn

from ..layout.sharding import sharded_by_tpx, sharded_save

__all__ = ["guard_save_pretrained", "offer_lora_layers"]


def guard_save_pretrained(module: nn.Module) -> None:
    """A Hugging Face model sharded by tpx: ``save_pretrained(path)`` on every rank writes the
    checkpoint with every rank writing its part (``tpx.checkpoint.save_pretrained``; a peft
    model: its adapters, ``tpx.checkpoint.save_adapters``); with ``state_dict=`` (a full state
    dict) it is transformers' or peft's own."""
    import types

    save = getattr(type(module), "save_pretrained", None)
    if save is None or "save_pretrained" in vars(module) or not sharded_by_tpx(module):
        return
    if type(module).__module__.startswith("peft."):
        from ..nn import lora  # noqa: F401 - wraps peft's save_pretrained for sharded models
        return

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        if state_dict is not None:
            return save(self, save_directory, *args, state_dict=state_dict, **kwargs)
        if getattr(self, "_hf_peft_config_loaded", False):
            raise ValueError(
                "tpx: save_pretrained of adapters added with transformers' add_adapter on a "
                "model sharded by tpx needs their full weights: on every rank, full = "
                "tpx.checkpoint.full_state_dict(model, rank0_only=True); then on rank 0, "
                "model.save_pretrained(path, state_dict=full). (Adapters of peft's "
                "get_peft_model are written by every rank.) Nothing was written")
        if args:
            raise TypeError("tpx: save_pretrained of a model sharded by tpx takes its options "
                            "by name (max_shard_size=...)")
        known = {"max_shard_size", "is_main_process", "safe_serialization"}
        other = sorted(set(kwargs) - known)
        if other or kwargs.get("safe_serialization", True) is False:
            raise ValueError(
                f"tpx: save_pretrained of a model sharded by tpx writes safetensors files with "
                f"every rank writing its part and takes max_shard_size only; got "
                f"{other or 'safe_serialization=False'}. Nothing was written")
        return sharded_save("model")(self, save_directory,
                                     max_shard_size=kwargs.get("max_shard_size", "50GB"))

    module.save_pretrained = types.MethodType(save_pretrained, module)


def offer_lora_layers(module: nn.Module) -> None:
    """A model tpx sharded: peft's ``get_peft_model`` wraps its column- and row-parallel
    layers with tpx's LoRA layers (``tpx.nn.lora`` teaches peft's dispatch) with no
    ``register`` step, and refuses the multi-dimensional layouts' layers naming tpx. peft imported already: ``tpx.nn.lora`` is imported now; installed but not imported
    yet: once, right after peft's own import (a finder on ``sys.meta_path`` that removes
    itself when it fires). Nothing when peft is not installed."""
    import sys

    if not sharded_by_tpx(module):
        return
    if "peft" in sys.modules:
        _import_lora()
    elif not any(isinstance(f, _AfterPeftImport) for f in sys.meta_path):
        import importlib.util

        if importlib.util.find_spec("peft") is not None:
            sys.meta_path.insert(0, _AfterPeftImport())


def _import_lora() -> None:
    try:
        from ..nn import lora  # noqa: F401 - teaches peft's dispatch tpx's layers
    except Exception as e:  # noqa: BLE001 - never break the user's import of peft
        import warnings

        warnings.warn(f"tpx: tpx.nn.lora could not be imported ({e}); LoRA on tpx's layers "
                      "needs it imported by hand", stacklevel=3)


class _AfterPeftImport:
    """A ``sys.meta_path`` finder that, on the first import of ``peft``, removes itself, lets
    the other finders find peft, and imports ``tpx.nn.lora`` when peft's module has run."""

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util
        import sys

        if fullname != "peft":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _import_lora()

        spec.loader.exec_module = exec_module
        return spec
