"""Full <-> sharded state dicts of models sharded by tpx.

``full_state_dict`` gathers every tpx layer's shards back into the tensors of the ORIGINAL
model (same keys, same shapes: it loads straight into the unsharded model);
``load_full_state_dict`` slices a full state dict into a sharded model. Both are collective:
every rank of each layer's group must call them.

Every tpx layer describes its parameters with ``_shards()``: (name, sharded dim, for each rank
the ``(start, end)`` ranges of the full tensor along that dim it holds, concatenated). A
layer made from a Hugging Face ``Conv1D`` (weight stored as ``[in, out]``) carries
``_transposed_weight = True``: its full weight is the transpose of the gathered one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .autograd import gather_dim

__all__ = ["full_state_dict", "load_full_state_dict"]


@dataclass
class _Sharded:
    key: str                      # key in the original model's state dict
    module: nn.Module
    name: str                     # parameter name in the tpx module
    dim: int                      # sharded dim of the local tensor
    rows: List[List[Tuple[int, int]]]  # per rank, ranges of the full tensor along dim
    transposed: bool              # the original tensor is the transpose of the local one

    @property
    def rank(self) -> int:
        return dist.get_rank(self.module.group)

    def local(self) -> Tensor:
        return getattr(self.module, self.name)

    def full_size(self) -> int:
        return max(e for r in self.rows for _, e in r)

    def orig_dim(self) -> int:
        return 1 - self.dim if self.transposed else self.dim

    def slice_of(self, full: Tensor) -> Tensor:
        """This rank's local tensor cut from the ORIGINAL full tensor."""
        d = self.orig_dim()
        pieces = [full.narrow(d, s, e - s) for s, e in self.rows[self.rank]]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, d)
        return out.t() if self.transposed else out


def _sharded_params(model: nn.Module) -> Iterator[_Sharded]:
    """Every sharded parameter of the tpx layers in ``model``, in module order (the same on
    every rank)."""
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "_shards") or not hasattr(mod, "group"):
            continue
        pre = f"{prefix}." if prefix else ""
        for name, dim, rows in mod._shards():
            transposed = name == "weight" and getattr(mod, "_transposed_weight", False)
            yield _Sharded(pre + name, mod, name, dim, rows, transposed)


def _gather_full(sh: _Sharded) -> Tensor:
    """The full tensor (original orientation) assembled from every rank's pieces."""
    local = sh.local().detach()
    sizes = [sum(e - s for s, e in r) for r in sh.rows]
    rank = sh.rank
    gathered = gather_dim(local, sh.dim, sizes, sum(sizes[:rank]), sh.module.group)
    shape = list(local.shape)
    shape[sh.dim] = sh.full_size()
    flat = [r for ranges in sh.rows for r in ranges]
    if all(a[1] == b[0] for a, b in zip(flat, flat[1:])) and flat[0][0] == 0:
        full = gathered  # ranks hold consecutive blocks: the gather is the full tensor
    else:
        full = local.new_empty(shape)
        offset = 0
        for ranges in sh.rows:
            for s, e in ranges:
                full.narrow(sh.dim, s, e - s).copy_(gathered.narrow(sh.dim, offset, e - s))
                offset += e - s
    return full.t() if sh.transposed else full


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Dict[str, Tensor]:
    """The unsharded state dict of a model sharded by tpx, with the original model's keys and
    shapes (on every rank, or only on the group's rank 0 with ``rank0_only=True``: the
    others return ``{}`` but must still call)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for sh in _sharded_params(model):
        state[sh.key] = _gather_full(sh)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


def _check_full_shape(where: str, sh: _Sharded, full: Tensor) -> None:
    d = sh.orig_dim()
    if full.dim() != sh.local().dim() or full.shape[d] != sh.full_size():
        raise ValueError(f"tpx.checkpoint.{where}: {sh.key} has shape {tuple(full.shape)}; the "
                         f"model expects {sh.full_size()} entries along dim {d}")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Dict[str, Tensor],
                         strict: bool = True) -> None:
    """Loads a full (unsharded) state dict into a model sharded by tpx: each tpx layer keeps
    its slice, every other tensor is loaded whole."""
    local = dict(state_dict)
    for sh in _sharded_params(model):
        if sh.key not in local:
            continue
        _check_full_shape("load_full_state_dict", sh, local[sh.key])
        local[sh.key] = sh.slice_of(local[sh.key])
    model.load_state_dict(local, strict=strict)
