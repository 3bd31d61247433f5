"""tpx: tensor parallelism for PyTorch.

Overlapped collective matmuls (``tpx.ops``, registered as ``torch.ops.tpx.*``) and drop-in
column/row-parallel linear layers built on them. Placements are written R (replicated),
S(d) (sharded on dim d) and P (partial sums).
"""

from . import mappings, ops, random
from .ops import SAVE_OPS, checkpoint_policy
from .comm.stats import CommStats, comm_stats
from .comm.groups import resolve_group, shard_range
from .parallel import MeshAttention, MeshInput, MeshParallel
from .parallel import (
    ExpertsParallel, ExpertsTensorParallel, GroupedExpertsParallel, GroupedExpertsTensorParallel,
    MoEIdentityExpert)
from .parallel import (
    ColwiseParallel, NoParallel, PairwiseParallel, ParallelStyle, PrepareModuleInput,
    PrepareModuleInputOutput, PrepareModuleOutput, Replicate, ReplicatedWithGradAllReduce,
    RowwiseParallel, SequenceParallel, Shard, ShardedAttention, loss_parallel, parallelize_module,
    plans)
from .replicas import ReplicaMismatch, check_replicas
from .run import end_run
from .nn import (
    ColumnParallelEmbedding, ColumnParallelLinear, RowParallelLinear,
    VocabParallelCrossEntropyLoss, VocabParallelEmbedding, linear_cross_entropy,
    vocab_parallel_cross_entropy)
from . import checkpoint, memory
from .checkpoint import from_pretrained
from .layout.sharding import register_sharded_save as _register_sharded_save

# save_pretrained of a sharded model, and peft's of its adapters: every rank writes its part
_register_sharded_save("model", checkpoint.save_pretrained)
_register_sharded_save("adapters", checkpoint.save_adapters)
from .clip_grad import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from . import mesh
from .mesh import init_mesh
from .nn.multidim import (
    Embedding2D, Embedding2p5D, Embedding3D, LayerNorm2D, LayerNorm2p5D, LayerNorm3D, Linear2D,
    Linear2p5D, Linear3D, RMSNorm2D, RMSNorm2p5D, RMSNorm3D, gather_output, split_input)

__version__ = "0.1.0"


def _alias_old_paths() -> None:
    """Earlier module paths of tpx, still importable (``import tpx.group``,
    ``from tpx.sharding import ...``, ``tpx.collectives.all_reduce``): each names the module
    that holds the code now."""
    import importlib
    import sys

    moved = {
        "group": "comm.groups", "comm_groups": "comm.owned", "collectives": "comm.collectives",
        "agree": "comm.agree", "checks": "comm.checks",
        "sharding": "layout.sharding", "param_dtensors": "layout.param_dtensors",
        "initial": "layout.initial", "nn.dtensor_io": "layout.dtensor_io",
        "amp": "ops.amp", "autograd": "mappings", "autograd_multidim": "ops.multidim",
    }
    for old, new in moved.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        parent, _, leaf = f"{__name__}.{old}".rpartition(".")
        setattr(sys.modules[parent], leaf, module)


_alias_old_paths()

__all__ = [
    "ColwiseParallel",
    "PairwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "Replicate",
    "RowwiseParallel",
    "SequenceParallel",
    "Shard",
    "ShardedAttention",
    "NoParallel", "ReplicatedWithGradAllReduce",
    "ExpertsTensorParallel",
    "ExpertsParallel",
    "GroupedExpertsParallel",
    "GroupedExpertsTensorParallel",
    "MoEIdentityExpert",
    "check_replicas",
    "end_run",
    "ReplicaMismatch",
    "checkpoint",
    "from_pretrained",
    "comm_stats",
    "CommStats",
    "loss_parallel",
    "plans",
    "random",
    "ColumnParallelEmbedding",
    "parallelize_module",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "build_info",
    "linear_cross_entropy",
    "ops",
    "resolve_group",
    "shard_range",
    "__version__",
]
__all__ += ["MeshParallel", "MeshAttention", "MeshInput"]
__all__ += ["clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm"]
__all__ += ["SAVE_OPS", "checkpoint_policy"]
__all__ += ["init_mesh", "mesh", "Linear2D", "Linear2p5D", "Linear3D", "gather_output",
            "split_input", "LayerNorm2D", "LayerNorm2p5D", "LayerNorm3D", "RMSNorm2D",
            "RMSNorm2p5D", "RMSNorm3D", "Embedding2D", "Embedding2p5D", "Embedding3D"]


def build_info() -> dict:
    """How the installed extension was built: ``cuda`` (whether the CUDA kernels were
    compiled in), ``cuda_kernels`` (the ops whose CUDA path runs tpx's own kernels: the
    vocab-parallel loss and embedding, and the fused head + loss that uses them; empty in a
    CPU-only build), ``torch_version`` (the torch it was compiled against),
    ``default_chunks`` (the pipeline depth used when ``chunks=None``), ``cpu_gemm`` (the GEMM
    its ops run for float32 CPU tensors, see :func:`tpx.ops.cpu_gemm_backend`), and
    ``version``."""
    from . import _ext

    info = dict(_ext.build_info())
    info["version"] = __version__
    info["cpu_gemm"] = ops.cpu_gemm_backend()
    return info
