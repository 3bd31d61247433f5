"""Full <-> sharded state dicts of models sharded by tpx.

``full_state_dict`` gathers every tpx layer's shards back into the tensors of the ORIGINAL
model (same keys, same shapes: it loads straight into the unsharded model);
``load_full_state_dict`` slices a full state dict into a sharded model. Both are collective:
every rank of each layer's group must call them.
"""

from __future__ import annotations

from typing import Dict, Iterator, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .autograd import gather_dim
from .group import shard_sizes
from .nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["full_state_dict", "load_full_state_dict"]


def _sharded_params(model: nn.Module) -> Iterator[Tuple[str, nn.Module, str, int, list, int]]:
    """(key, layer, param name, sharded dim, per-rank sizes, this rank's start) of every
    sharded parameter, in module order (the same on every rank)."""
    for prefix, mod in model.named_modules():
        pre = f"{prefix}." if prefix else ""
        if isinstance(mod, ColumnParallelLinear):
            yield pre + "weight", mod, "weight", 0, mod.out_sizes, mod.out_start
            if mod.bias is not None:
                yield pre + "bias", mod, "bias", 0, mod.out_sizes, mod.out_start
        elif isinstance(mod, RowParallelLinear):
            yield pre + "weight", mod, "weight", 1, mod.in_sizes, mod.in_start
        elif isinstance(mod, VocabParallelEmbedding):
            sizes = shard_sizes(mod.num_embeddings, mod.world_size)
            yield pre + "weight", mod, "weight", 0, sizes, mod.vocab_start


@torch.no_grad()
def full_state_dict(model: nn.Module, *, rank0_only: bool = False) -> Dict[str, Tensor]:
    """The unsharded state dict of a model sharded by tpx, with the original model's keys and
    shapes (on every rank, or only on the group's rank 0 with ``rank0_only=True``: the
    others return ``{}`` but must still call)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for key, mod, pname, dim, sizes, start in _sharded_params(model):
        state[key] = gather_dim(getattr(mod, pname).detach(), dim, sizes, start, mod.group)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return state


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Dict[str, Tensor],
                         strict: bool = True) -> None:
    """Loads a full (unsharded) state dict into a model sharded by tpx: each tpx layer keeps
    its slice, every other tensor is loaded whole."""
    local = dict(state_dict)
    for key, mod, pname, dim, sizes, start in _sharded_params(model):
        if key not in local:
            continue
        full = local[key]
        expected = sum(sizes)
        if full.shape[dim] != expected:
            raise ValueError(f"tpx.checkpoint.load_full_state_dict: {key} has {full.shape[dim]} "
                             f"entries along dim {dim}, the model expects {expected}")
        local[key] = full.narrow(dim, start, sizes[mod.rank])
    model.load_state_dict(local, strict=strict)
