"""Full <-> sharded state dicts of models sharded by tpx, 1-D or multi-dimensional.

``full_state_dict`` gathers every tpx layer's shards back into the tensors of the ORIGINAL
model (same keys, same shapes: it loads straight into the unsharded model);
``load_full_state_dict`` slices a full state dict into a sharded model. Both are collective:
every rank of each layer's group (or mesh) must call them.

Each sharded parameter has one description, :mod:`tpx.layout.sharding`'s, which these functions
read. A 1-D tpx layer's parameter (:class:`tpx.layout.sharding.GroupSharding`, from the layer's
``_shards()``: name, sharded dim, for each rank the ``(start, end)`` ranges of the full tensor
along that dim it holds, concatenated) may be stored transposed by the original model (a layer
made from a Hugging Face ``Conv1D``, weight ``[in, out]``, marked by
``tpx.layout.sharding.mark_transposed_weight``): its full weight is the transpose of the gathered one.

Every multi-dimensional layer (2-D, 2.5-D, 3-D: :mod:`tpx.nn.multidim`) describes its
parameters with ``_param_splits()``: one :class:`tpx.nn.multidim.BlockSpec` per parameter,
giving for each of the parameter's dims the mesh dimensions that split it, outermost first
(the block index and count follow from the rank's mesh coordinates), and the full shape. A
rank's parameter is one rectangular block of the full tensor, replicated over the mesh
dimensions that split none of its dims; gathering is one mesh all-gather per splitting mesh
dimension.
"""

from .dcp import is_complete, load, save, sharded_state_dict
from .full import full_state_dict, load_full_state_dict, mesh_params, sharded_params  # noqa: F401
from .hf import HFLoadResult, init_unsaved_buffers, load_hf_checkpoint
from .pretrained import from_pretrained
from .hf_write import save_pretrained
from .adapters import save_adapters
from .optim import (
    ParamSet, full_optimizer_state_dict, get_optimizer_state_dict, load_full_optimizer_state_dict,
    set_optimizer_state_dict)

__all__ = ["full_state_dict", "load_full_state_dict", "load_hf_checkpoint", "save", "load",
           "is_complete",
           "sharded_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
           "full_optimizer_state_dict", "load_full_optimizer_state_dict", "HFLoadResult",
           "from_pretrained", "init_unsaved_buffers", "save_pretrained", "save_adapters"]
