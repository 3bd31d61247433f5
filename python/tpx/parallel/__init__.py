"""Sharding whole models: ``parallelize_module``, the parallel styles, ready-made plans and
the loss-parallel context; ``compat`` holds the API of earlier PyTorch releases
(``PairwiseParallel``, the ``make_input_*`` / ``make_output_*`` helpers)."""

from . import plans
from . import hf_plan
from .api import parallelize_module
from . import compat
from .compat import PairwiseParallel
from .loss_parallel import loss_parallel
from . import moe
from .moe import (
    ExpertsParallel, ExpertsTensorParallel, GroupedExpertsParallel, GroupedExpertsTensorParallel,
    MoEIdentityExpert)
from . import mesh_styles
from .mesh_styles import MeshAttention, MeshInput, MeshParallel
from .style import (
    ColwiseParallel, NoParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput,
    PrepareModuleOutput, ReplicatedWithGradAllReduce, Replicate, RowwiseParallel, SequenceParallel,
    Shard, ShardedAttention, TPContext)

__all__ = ["parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput", "ParallelStyle", "TPContext", "Replicate", "Shard",
           "ShardedAttention", "NoParallel", "ReplicatedWithGradAllReduce", "loss_parallel",
           "plans", "hf_plan",
           "compat", "PairwiseParallel", "mesh_styles", "MeshParallel", "MeshAttention",
           "MeshInput", "moe", "ExpertsTensorParallel", "ExpertsParallel", "MoEIdentityExpert",
           "GroupedExpertsTensorParallel", "GroupedExpertsParallel"]
