"""peft's ``target_modules="all-linear"`` on a model tpx sharded: the shorthand names every
linear layer but the output head, and peft finds them by type (``nn.Linear``, ``Conv1D``),
which tpx's column- and row-parallel layers are not. Here the shorthand also names tpx's
linear layers (the head excluded as peft excludes it), so the adapters go where they go on
one device. Imported by :mod:`tpx.nn.lora`, once."""

from __future__ import annotations

import functools

from torch import nn

__all__ = ["install"]


def _tpx_linear_names(model: nn.Module, peft_config) -> set:
    from peft.tuners.tuners_utils import BaseTunerLayer

    from .linear import ColumnParallelLinear, RowParallelLinear

    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        try:
            head = get_head()
        except (AttributeError, NotImplementedError):
            head = None
    inside = set()  # the layers of adapters already applied (lora_A, ...)
    for prefix, module in model.named_modules():
        if isinstance(module, BaseTunerLayer):
            inside.update(f"{prefix}.{s}" for s, _ in module.named_modules() if s)
    return {name for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m is not head
            and name not in inside}


def install() -> None:
    """Wraps peft's resolution of ``"all-linear"`` (once)."""
    from peft.tuners import tuners_utils
    from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

    own = tuners_utils._maybe_include_all_linear_layers
    if getattr(own, "_tpx_wrapped", False):
        return

    @functools.wraps(own)
    def resolve(peft_config, model):
        targets = getattr(peft_config, "target_modules", None)
        shorthand = (isinstance(targets, str)
                     and targets.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND)
        out = own(peft_config, model)
        if shorthand:
            extra = _tpx_linear_names(model, out)
            if extra:
                out.target_modules = set(out.target_modules) | extra
        return out

    resolve._tpx_wrapped = True
    tuners_utils._maybe_include_all_linear_layers = resolve
