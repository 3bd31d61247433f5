"""PyTorch's simulated ranks: under ``torch.distributed._local_tensor.LocalTensorMode`` one
process runs every rank of a fake process group, each tensor a ``LocalTensor`` holding every
rank's value, each collective simulated by the mode. tpx's engine talks to real process
groups, so while such a mode is active tpx shards through PyTorch's own implementation of the
same styles (``torch.distributed.tensor.parallel``): :func:`parallelize_module` and
:func:`tpx.loss_parallel` hand their plan to PyTorch's, style by style, and the simulation sees
PyTorch's collectives. Layers and plans that have no PyTorch counterpart (the 2-D / 2.5-D /
3-D layouts, tpx's expert styles, a plan written for a Hugging Face model) raise there.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn


def active() -> bool:
    """Whether PyTorch's rank simulation (``LocalTensorMode``) is on."""
    try:
        from torch.distributed._local_tensor import enabled_local_tensor_mode
    except ImportError:  # a torch without the simulation
        return False
    return enabled_local_tensor_mode() is not None


def torch_style(style: Any, where: str) -> Any:
    """PyTorch's counterpart of one of tpx's styles (a PyTorch style is returned as it is)."""
    from torch.distributed.tensor.parallel import style as torch_styles

    from . import module_styles
    from . import style as tpx_styles

    if isinstance(style, torch_styles.ParallelStyle):
        return style
    kind = type(style)
    if kind is tpx_styles.ColwiseParallel or kind is tpx_styles.RowwiseParallel:
        target = (torch_styles.ColwiseParallel if kind is tpx_styles.ColwiseParallel
                  else torch_styles.RowwiseParallel)
        return target(input_layouts=style.input_layouts, output_layouts=style.output_layouts,
                      use_local_output=style.use_local_output)
    if kind is tpx_styles.SequenceParallel:
        return torch_styles.SequenceParallel(sequence_dim=style.sequence_dim,
                                             use_local_output=style.use_local_output)
    if kind is module_styles.PrepareModuleInput:
        return torch_styles.PrepareModuleInput(**_input_kwargs(style),
                                               use_local_output=style.use_local_output)
    if kind is module_styles.PrepareModuleOutput:
        return torch_styles.PrepareModuleOutput(
            output_layouts=style.output_layouts,
            desired_output_layouts=style.desired_output_layouts,
            use_local_output=style.use_local_output)
    if kind is module_styles.PrepareModuleInputOutput:
        i, o = style.prepare_module_input, style.prepare_module_output
        return torch_styles.PrepareModuleInputOutput(
            **_input_kwargs(i), use_local_input=i.use_local_output,
            output_layouts=o.output_layouts, desired_output_layouts=o.desired_output_layouts,
            use_local_output=o.use_local_output)
    raise NotImplementedError(
        f"tpx.parallelize_module: {type(style).__name__} (at {where!r}) has no counterpart in "
        "PyTorch's TP, which tpx runs on under LocalTensorMode (PyTorch's simulated ranks); "
        "run this plan on real ranks (torchrun), or use PyTorch's styles in it")


def _input_kwargs(style) -> Dict[str, Any]:
    def layouts(value):
        return None if not value else value

    return dict(input_layouts=layouts(style.input_layouts),
                desired_input_layouts=layouts(style.desired_input_layouts),
                input_kwarg_layouts=style.kwarg_layouts or None,
                desired_input_kwarg_layouts=style.desired_kwarg_layouts or None)


def parallelize_module(module: nn.Module, device_mesh, plan, src_data_rank: Optional[int]):
    """``torch.distributed.tensor.parallel.parallelize_module`` with tpx's styles replaced by
    PyTorch's (see the module docstring)."""
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    if isinstance(plan, dict):
        plan = {k: torch_style(v, k) for k, v in plan.items()}
    elif plan is not None:
        plan = torch_style(plan, "")
    return torch_parallelize(module, device_mesh, plan, src_data_rank=src_data_rank)
