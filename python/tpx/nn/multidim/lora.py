"""LoRA adapters (peft) on the 2-D and 2.5-D layouts' linear layers: :class:`MeshLoraLinear`,
which peft's dispatch makes (taught by :mod:`tpx.nn.lora`) when ``get_peft_model`` meets a
``Linear2D`` / ``Linear2p5D``. Imported only when peft is in use."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from peft.tuners.lora.layer import Linear as _PeftLoraLinear

from ...layout.dtensor_io import DTensor
from ...layout.param_dtensors import local_ranges
from .linear import Linear2D

__all__ = ["MeshLoraLinear"]


class MeshLoraLinear(_PeftLoraLinear):
    """peft's ``lora.Linear`` on a 2-D / 2.5-D tpx layer (:class:`tpx.nn.multidim.Linear2D`,
    ``Linear2p5D``), made by ``get_peft_model`` on a model tpx sharded in that layout.

    Each adapter's factors are layers of the same layout: ``lora_A`` a ``Linear2D(in, r)``,
    ``lora_B`` a ``Linear2D(r, out)`` (blocks of peft's full-sized draw from the base layer's
    source rank), so peft's own forward ``base(x) + B(A(x)) * scaling`` runs on the layout's
    blocks: input and output in the base layer's layout (rows over the batch dims, features
    over "col"), each factor's weight ``DTensor`` over the same mesh, its gradient summed as
    the layout's layers sum theirs. ``r`` must divide by ``q``; ``lora_dropout`` must be 0 (a
    mask drawn on each rank's block is not one device's mask). Merging adds this rank's block
    of ``scaling * B @ A`` to the base weight's block."""

    def __init__(self, base_layer, adapter_name: str, config=None, **kwargs) -> None:
        if not isinstance(base_layer, Linear2D) or base_layer._layout not in ("2d", "2.5d"):
            raise TypeError(f"tpx.MeshLoraLinear wraps a tpx Linear2D or Linear2p5D; got "
                            f"{type(base_layer).__name__}")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.fan_in_fan_out = False

    def _get_in_out_features(self, module: nn.Module):
        if isinstance(module, Linear2D):
            return module.in_features, module.out_features  # the full sizes
        return super()._get_in_out_features(module)

    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """peft's ``update_layer`` (a new adapter: drawn full-sized, as on one device), then
        this rank keeps its blocks of the base layer's source rank's draw."""
        base = self.get_base_layer()
        who = f"LoRA adapter {adapter_name!r} on the {base._layout!r} layout"
        if config.use_dora or self.resolve_lora_variant(config=config) is not None:
            raise NotImplementedError(f"tpx: {who}: a LoRA variant (DoRA or another) is not "
                                      "supported; tpx shards plain LoRA. Nothing was changed")
        if kwargs.get("lora_dropout", getattr(config, "lora_dropout", 0.0)):
            raise NotImplementedError(f"tpx: {who}: lora_dropout must be 0 (each rank holds a "
                                      "block of the input). Nothing was changed")
        if r % base.q:
            raise ValueError(f"tpx: {who}: r = {r} must divide by q = {base.q} (the factors "
                             f"are split in q blocks); choose r a multiple of {base.q}. Nothing "
                             "was changed")
        super().update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        mesh, src = base.weight.device_mesh, getattr(base, "src_rank", 0)
        layer = type(base)
        for factors in (self.lora_A, self.lora_B):
            full = factors[adapter_name]
            factors[adapter_name] = layer.from_linear(full, mesh, src_rank=src)

    def get_delta_weight(self, adapter) -> Tensor:
        """This rank's block of ``scaling * B @ A``, a ``DTensor`` of the base weight's
        placements (the factors gathered: ``r x in`` and ``out x r`` elements)."""
        weight = self.get_base_layer().weight
        (rows,), (cols,) = local_ranges(weight)
        a = self.lora_A[adapter].weight.full_tensor()[:, cols[0]:cols[1]]
        b = self.lora_B[adapter].weight.full_tensor()[rows[0]:rows[1]]
        dtype = b.dtype
        if b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
            a, b = a.float(), b.float()
        delta = ((b @ a) * self.scaling[adapter]).to(dtype)
        return DTensor.from_local(delta, weight.device_mesh, weight.placements,
                                  run_check=False, shape=weight.shape, stride=weight.stride())

    def _mixed_batch_forward(self, *args, **kwargs):
        raise NotImplementedError(
            "tpx: peft's mixed-adapter batches (adapter_names=...) are not supported under "
            "tensor parallelism; activate one adapter set with set_adapter() per batch")

    def __repr__(self) -> str:
        return "tpx." + nn.Module.__repr__(self)
