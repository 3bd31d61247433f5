"""The tpx operators: typed Python wrappers over ``torch.ops.tpx.*`` and their fake (meta)
implementations, so ``torch.compile`` and ``torch.library.opcheck`` can trace them.

Placements (per rank of the group; R = replicated, S(d) = sharded on dim d, P = partial):

===========================  ======================================  ===========================
op                           inputs                                  outputs
===========================  ======================================  ===========================
``all_gather_matmul``        a S(gather_dim), b R or S(1)            a_gathered R, out S(1)*
``matmul_reduce_scatter``    a S(-1), b S(0)                         out S(scatter_dim)
``matmul_all_reduce``        a S(-1), b S(0)                         out R
``replicated_matmul``        a R, b S(1)                             out S(-1)
``vocab_parallel_cross_``    logits S(1) [N, V_local], target R      loss R [N], lse R [N]
``entropy_rows``
``linear_cross_entropy_``    hidden R, weight S(0), target R         loss R [N], lse R [N]
``rows``
``vocab_parallel_embedding`` weight S(0), ids R                      out R, or S(scatter_dim)
===========================  ======================================  ===========================

(*) ``out`` is R when ``b`` is replicated and S(-1) when ``b`` holds this rank's columns.

Under ``torch.autocast`` every op follows its torch counterpart (GEMMs in the autocast
dtype, the loss in float32, the embedding untouched; see :mod:`tpx.ops.amp`).

Every op is differentiable (its autograd sits beside it in its family's module); ``chunks`` is the pipeline depth:
``1`` runs the collective and the GEMM one after the other (the reference), ``None`` picks
the default (``tpx.build_info()["default_chunks"]``, or ``TPX_DEFAULT_CHUNKS``).

The operators live by family, each with its wrapper, fake implementation and autograd side by
side: :mod:`tpx.ops.matmul` (the collective matmuls), :mod:`tpx.ops.vocab` (loss and
embedding), :mod:`tpx.ops.multidim` (2-D / 2.5-D / 3-D and the mesh collectives);
:mod:`tpx.ops.core` holds the call path they share, :mod:`tpx.ops.amp` their autocast
kernels, :mod:`tpx.ops.reference` their decomposition into PyTorch's functional collectives
(what runs while ``CommDebugMode`` watches) and :mod:`tpx.ops.recompute` the ops a selective
activation checkpointing policy saves (``tpx.SAVE_OPS``, ``tpx.checkpoint_policy``).
Nothing outside this package calls ``torch.ops.tpx`` itself.
"""

from . import amp
from .core import (
    ON_PARAMS, PLAIN, lean_mode, params_path, plain_group_name, register_eager_function)
from .matmul import (
    all_gather_matmul, cpu_gemm_backend, default_chunks, local_matmul, linear_on_params,
    matmul_all_reduce, matmul_reduce_scatter, plain_linear, plain_linear_all_reduce,
    replicated_matmul)
from .multidim import (linear_2d, linear_3d, mesh_all_gather, mesh_all_reduce, mesh_layer_norm,
                       mesh_rms_norm, sum_by_name)
from .vocab import (
    linear_cross_entropy_rows, plain_embedding, vocab_parallel_cross_entropy_rows,
    vocab_parallel_embedding)
from . import reference
from .recompute import SAVE_OPS, checkpoint_policy

reference.install()

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "replicated_matmul",
    "vocab_parallel_cross_entropy_rows",
    "vocab_parallel_embedding",
    "linear_cross_entropy_rows",
    "local_matmul",
    "cpu_gemm_backend",
    "default_chunks",
    "linear_2d",
    "linear_3d",
    "mesh_all_reduce",
    "mesh_all_gather",
    "mesh_layer_norm",
    "mesh_rms_norm",
    "params_path",
]
