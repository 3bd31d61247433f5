"""tpx's operators under activation checkpointing: the operators whose forward communicates
(:data:`SAVE_OPS`) and a selective checkpointing policy that saves their outputs and
recomputes everything else (:func:`checkpoint_policy`).

>>> from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
>>> context_fn = functools.partial(create_selective_checkpoint_contexts, tpx.checkpoint_policy)
>>> out = checkpoint(layer, x, use_reentrant=False, context_fn=context_fn)

Selective checkpointing decides op by op, in a dispatch mode: in eager mode each tpx operator
runs below autograd inside its own autograd Function (:mod:`tpx.ops.core`), and the mode sees
it there as one ``OpOverload`` (``torch.ops.tpx.<op>.default``), the GEMMs and collectives of
the C++ engine inside it. A saved operator's output is kept from the forward and handed back
to the recomputation, which then runs neither its GEMM nor its collective; ``tpx.comm_stats``
and ``CommDebugMode`` count none.

=============================  ==============================================================
operator                       forward collective (placements in :mod:`tpx.ops`)
=============================  ==============================================================
all_gather_matmul              all-gather of the input (a column-parallel layer, sequence
                               parallel); its output and the gathered input are saved
matmul_reduce_scatter          reduce-scatter of the product (a row-parallel layer, sequence
                               parallel)
matmul_all_reduce              all-reduce of the product (a row-parallel layer)
vocab_parallel_embedding       all-reduce (or reduce-scatter) of the partial lookups
vocab_parallel_cross_entropy   all-reduces of the row statistics
linear_cross_entropy           as the cross-entropy, on the fused head's logits
linear_2d, linear_3d           the broadcasts / gathers and reduce-scatters of the 2-D,
                               2.5-D and 3-D linears
mesh_all_gather                the layout changes' gathers (sequence shards gathered before a
                               block, a column-parallel output gathered)
mesh_all_reduce                the layout changes' sums of partial results, the
                               multi-dimensional norms' row statistics
=============================  ==============================================================

Full non-reentrant checkpointing needs no policy for the collective at the end of a
checkpointed layer: while saved-tensor hooks are active, the row-parallel operators
(``matmul_all_reduce``, ``matmul_reduce_scatter``) and ``linear_2d`` save their inputs in an
autograd node of their own before the collective runs (``tpx.ops.core.register_saved_first``),
so the recomputation stops before it, as it stops before PyTorch's TP's collective.

``replicated_matmul`` (a column-parallel layer without sequence parallelism) communicates in
its backward only: it is recomputed, as every GEMM outside the list is. To save GEMMs as well,
add their operators to the list (``create_selective_checkpoint_contexts`` takes a list of
ops). One collective that tpx's layout changes issue in the forward cannot be saved: the
reduce-scatter that hands a block gathered whole back to its sequence shards, or splits a
vocab-parallel embedding's output along the features (``tpx.mappings.reduce_scatter_dim``),
goes through ``torch.distributed`` in place, and is recomputed.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["SAVE_OPS", "checkpoint_policy"]

_TPX = torch.ops.tpx

#: The tpx operators whose forward communicates, as ``OpOverload`` s: the ops a selective
#: checkpointing policy saves so that no tpx collective runs again in the recomputation. A list,
#: as ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes it; add it to
#: torchtitan's save list with ``_op_sac_save_list.update(tpx.SAVE_OPS)`` (docs/training.md).
SAVE_OPS = [
    _TPX.all_gather_matmul.default,
    _TPX.matmul_reduce_scatter.default,
    _TPX.matmul_all_reduce.default,
    _TPX.vocab_parallel_embedding.default,
    _TPX.vocab_parallel_cross_entropy.default,
    _TPX.linear_cross_entropy.default,
    _TPX.linear_2d.default,
    _TPX.linear_3d.default,
    _TPX.mesh_all_gather.default,
    _TPX.mesh_all_reduce.default,
]

_SAVED = frozenset(SAVE_OPS)


def checkpoint_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """A selective activation checkpointing policy (the ``policy_fn`` of
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``): ``MUST_SAVE`` for the
    operators of :data:`SAVE_OPS` (as tpx ships it), ``PREFER_RECOMPUTE`` for every other op,
    in the forward and in the recomputation alike. ``ctx`` is torch's
    ``SelectiveCheckpointContext``; ``op`` the ``OpOverload`` being run, ``args`` and
    ``kwargs`` its arguments."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE
