"""Full logits while a Hugging Face model generates: on a model whose LM head keeps its logits
sharded (``loss_parallel=True``), ``generate()`` gathers them, so every rank picks its next
token from the whole vocabulary; outside ``generate()`` they stay sharded for the loss."""

from __future__ import annotations

import types
from typing import Dict, Optional

from torch import Tensor, nn

from ..comm.groups import copied_with_module
from .. import mappings
from ..nn import multidim as md
from .mesh_styles import MeshInput, mesh_info
from .style import ParallelStyle, TPContext

__all__ = ["FullLogitsInGenerate", "MeshInputFullLogits", "with_generate"]

Plan = Dict[str, ParallelStyle]


def with_generate(plan: Plan, model: nn.Module, head: Optional[str],
                   loss_parallel: bool) -> Plan:
    """Adds :class:`FullLogitsInGenerate` on the model itself when its LM head keeps the
    logits vocab-sharded and the model can ``generate()``."""
    if loss_parallel and head is not None and callable(getattr(type(model), "generate", None)):
        plan[""] = FullLogitsInGenerate(head)
    return plan


class FullLogitsInGenerate(ParallelStyle):
    """On the model itself (plan key ``""``) when the plan's LM head keeps the logits sharded
    over the vocabulary (``loss_parallel=True``): while the model's ``generate()`` runs, every
    forward pass gathers the logits it returns over the vocabulary (the positions Hugging Face
    keeps, one per decoding step), so each rank picks its next token from the full vocabulary
    and every rank generates what one device generates. Outside ``generate()`` the logits stay
    vocab-sharded, for the loss under ``tpx.loss_parallel()``."""

    def __init__(self, head: str) -> None:
        self.head = head

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        head_name = self.head

        def gather(root, logits):
            head = root.get_submodule(head_name)
            return mappings.gather_last_dim(logits, head.out_sizes, head.out_start,
                                                head.group)

        gather_logits_in_generate(module, gather)
        return module

    def __repr__(self) -> str:
        return f"FullLogitsInGenerate(head={self.head!r})"


class MeshInputFullLogits(MeshInput):
    """:class:`MeshInput`, and on a model whose LM head keeps the logits in the layout's blocks
    (``loss_parallel=True``): the full logits while the model's ``generate()`` runs."""

    def __init__(self, input_kwargs, head: str) -> None:
        super().__init__(input_kwargs)
        self.head = head

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module = super().apply(module, ctx)
        info = mesh_info(ctx.mesh, "MeshInput")
        head_name = self.head

        def gather(root, logits):
            kw = {}
            if info.layout == "3d":
                kw["hidden_mesh_dim"] = root.get_submodule(head_name).output_mesh_dim
            return md.gather_output(logits, info, **kw)

        gather_logits_in_generate(module, gather)
        return module


def gather_logits_in_generate(module: nn.Module, gather) -> None:
    """Runs ``module.generate`` (Hugging Face's) with the logits each forward pass returns
    replaced by ``gather(module, logits)``; other calls of the module are left alone."""
    if "_tpx_gather_logits" not in module.__dict__:
        module.generate = types.MethodType(_generate_full_logits, module)
        module.register_forward_hook(copied_with_module(_gather_logits_when_generating))
    module.__dict__["_tpx_gather_logits"] = gather


def _generate_full_logits(self, *args, **kwargs):
    """The model's own ``generate``, with the LM head's vocab shards gathered during it."""
    self.__dict__["_tpx_generating"] = self.__dict__.get("_tpx_generating", 0) + 1
    try:
        return type(self).generate(self, *args, **kwargs)
    finally:
        self.__dict__["_tpx_generating"] -= 1


def _gather_logits_when_generating(module, args, output):
    if not module.__dict__.get("_tpx_generating"):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, Tensor):
        return output
    output.logits = module.__dict__["_tpx_gather_logits"](module, logits)
    return output
