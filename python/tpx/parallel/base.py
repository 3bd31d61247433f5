"""What every parallel style shares: the :class:`ParallelStyle` base, how a style is applied
(tpx's with ``src_rank`` where it takes one; PyTorch's through PyTorch's own implementation),
the placement checks, and :func:`redistribute` (a tensor moved between R and S(d) at a module
boundary)."""

from __future__ import annotations

import inspect
from typing import Optional

import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm_groups import guarded
from ..group import mesh_for_group, shard_bounds, shard_sizes
from ..nn.dtensor_io import DTensor, Partial, Replicate, Shard, gathered_local, wrap_output

__all__ = ["ParallelStyle", "apply_style", "check_placement", "is_style", "redistribute",
           "torch_style"]


def check_placement(style: str, name: str, value, allowed: tuple) -> None:
    if value is None or isinstance(value, allowed):
        return
    names = [a.__name__ + ("(dim)" if a is Shard else "()") for a in allowed]
    if isinstance(value, Partial):
        raise ValueError(f"tpx.{style}: `{name}`={value!r}: a plain tensor of partial sums is not a "
                         f"layout this style takes (one of {names}); reduce it first, or pass "
                         "a DTensor with that placement (it is redistributed to what the layer "
                         "needs)")
    raise TypeError(f"tpx.{style}: `{name}` must be one of {names} (torch.distributed.tensor's "
                    f"placements, which tpx.Replicate / tpx.Shard are); got {value!r}")


@guarded
def redistribute(x, src, dst, pg: dist.ProcessGroup, *, local: bool = True):
    """Changes the placement of a tensor from ``src`` to ``dst`` (R <-> S(d)).

    A plain tensor is this rank's part of ``src``; a ``DTensor`` carries its own placement
    (``src`` is ignored) and is redistributed to ``dst``. The result is local, or a ``DTensor``
    with placement ``dst`` when ``local=False``."""
    if isinstance(x, DTensor):
        if dst is not None:
            d = Shard(dst.dim % x.dim()) if isinstance(dst, Shard) else dst
            if tuple(x.placements) != (d,):
                full = gathered_local(x, d, pg)  # S(k) -> R through tpx's counted gather
                if full is not None:
                    if local:
                        return full
                    out = wrap_output(full, d, pg, x.shape, x.device_mesh)
                    twin = getattr(full, "_tpx_partial_grad_input", None)
                    if twin is not None:  # for the column-parallel layers that read it
                        out._tpx_partial_grad_input = twin
                    return out
                x = x.redistribute(x.device_mesh, [d])
        return x.to_local() if local else x
    if not isinstance(x, Tensor):
        return x
    if isinstance(src, Partial) or isinstance(dst, Partial):
        raise ValueError(f"tpx: a plain tensor cannot be redistributed from {src} to {dst}; "
                         "partial sums are accepted as DTensor inputs only")
    y = x
    if not (src is None or dst is None or src == dst):
        world = pg.size()
        if isinstance(src, Replicate) and isinstance(dst, Shard):
            d = dst.dim % x.dim()
            if x.shape[d] % world:
                # The way back (S(d) -> R below) and every rank's peers take a plain tensor's
                # shards as equal-sized: an uneven split would gather wrong sizes. The input is
                # replicated, so every rank raises here, before any collective.
                raise ValueError(
                    f"tpx: Replicate() -> Shard({dst.dim}) of a tensor of shape "
                    f"{tuple(x.shape)}: dim {d} (size {x.shape[d]}) does not divide by the "
                    f"group size {world}, and the shards of a plain tensor are equal-sized; pad "
                    f"dim {d} (the sequence) to a multiple of {world}")
            sizes = shard_sizes(x.shape[d], world)
            start, _ = shard_bounds(x.shape[d], dist.get_rank(pg), world)
            y = mappings.split_dim(x, d, sizes, start, pg)
        elif isinstance(src, Shard) and isinstance(dst, Replicate):
            d = src.dim % x.dim()
            # Shards of a plain tensor are equal-sized: the full size is local * world. The
            # column-parallel layers that read the result send their (partial) input
            # gradients back with one reduce-scatter of their sum.
            y = mappings.gather_dim_for_partial_grads(x, d, pg)
        else:
            raise ValueError(f"tpx: cannot redistribute a tensor from {src} to {dst}")
    if local:
        return y
    placement = dst if dst is not None else src
    if placement is None:
        return y
    shape = list(y.shape)
    if isinstance(placement, Shard):
        shape[placement.dim % y.dim()] *= pg.size()
    return wrap_output(y, placement, pg, shape)


class ParallelStyle:
    """Base of the styles: ``apply(module, group)`` returns the sharded module (the same
    object, with hooks, or a tpx replacement). Styles that build tpx modules also take
    ``src_rank`` (the rank whose weights are used, as ``tpx.parallelize_module``'s)."""

    def apply(self, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:  # pragma: no cover
        raise NotImplementedError


def torch_style(style) -> bool:
    """Whether ``style`` is one of PyTorch's ``ParallelStyle`` s (torch's own, torchtitan's,
    a user's written for ``torch.distributed.tensor.parallel``): tpx applies it with PyTorch's
    implementation."""
    try:
        from torch.distributed.tensor.parallel.style import ParallelStyle as TorchParallelStyle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(style, TorchParallelStyle)


def is_style(style) -> bool:
    """A style ``parallelize_module`` takes: tpx's, or PyTorch's (applied by PyTorch)."""
    return isinstance(style, ParallelStyle) or torch_style(style)


def apply_style(style: ParallelStyle, module: nn.Module, pg: dist.ProcessGroup,
                src_rank: Optional[int] = 0) -> nn.Module:
    """``style.apply(module, pg)``, passing ``src_rank`` to styles whose ``apply`` takes it
    (user-defined styles with ``apply(module, pg)`` keep working). A PyTorch
    ``ParallelStyle`` tpx did not write (``PrepareModuleInputOutput``, torchtitan's styles) is
    applied by PyTorch (``style._apply(module, mesh)``) on the 1-D mesh over ``pg`` (the mesh
    ``parallelize_module`` was given, when it was one): its parameters and outputs are
    PyTorch's ``DTensor`` s, which tpx's layers take as inputs."""
    if torch_style(style):
        return apply_with_pytorch(style, module, pg)
    try:
        takes = "src_rank" in inspect.signature(style.apply).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        takes = False
    if takes:
        return style.apply(module, pg, src_rank=src_rank)
    return style.apply(module, pg)


def apply_with_pytorch(style, module: nn.Module, pg: dist.ProcessGroup) -> nn.Module:
    """``style`` (one of PyTorch's ``ParallelStyle`` s) applied by PyTorch
    (``style._apply(module, mesh)``) on the 1-D mesh over ``pg``."""
    device = next((t.device.type for t in module.parameters()), None) or \
        next((t.device.type for t in module.buffers()), "cpu")
    return style._apply(module, mesh_for_group(pg, device))
