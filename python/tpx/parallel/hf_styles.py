"""Hugging Face's TP style names as tpx styles: the one table (:data:`HF_STYLES`) from every
name of transformers' ``ALL_PARALLEL_STYLES`` to the tpx style that computes the same thing,
the small styles it needs, and the styles :func:`tpx.parallel.hf_plan.translate` adds for
attention's per-head parameters and partial gradients."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.groups import copied_with_module, head_split
from .. import mappings
from ..nn.functional import gaussian_topk
from ..layout.param_dtensors import compute_on_locals, replicate_params, sum_partial_grads
from .moe import MoEIdentityExpert
from .style import (
    ColwiseParallel, ParallelStyle, Replicate, ReplicatedWithGradAllReduce, RowwiseParallel,
    SequenceParallel, TPContext)

__all__ = ["HF_STYLES", "HFStyle", "HeadParams", "PartialGradParams", "style"]

Plan = Dict[str, ParallelStyle]


# ------------------------------------------------------------------ small styles of the table

class AllReduceOutput(ParallelStyle):
    """A module whose output is a partial sum on every rank (its parameters already sharded
    by entries inside it): the output is summed over the group. ``P -> R``; backward
    identity. Hugging Face's ``all_reduce``."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        if pg.size() > 1:
            module.register_forward_hook(
                copied_with_module(lambda m, a, out: mappings.all_reduce_sum(out, pg)
                                   if isinstance(out, Tensor) else out))
        return module

    def __repr__(self) -> str:
        return "AllReduceOutput()"


class BlocksColwise(ColwiseParallel):
    """A fused ``[q | v | k]`` projection laid out in ``n_blocks`` interleaved blocks of
    ``n_heads / n_blocks`` heads each (CodeGen's ``mp_num``). At a TP size that divides the
    blocks each rank holds whole blocks; at a multiple of them the ranks of one block share
    it, each holding its heads' rows of the block's q, v and k (8 ranks, 4 blocks: rank 5
    holds the second half of block 2's q, of its v and of its k). Either way rank ``r``'s heads
    are the ``r``-th of the contiguous split, the columns its output projection holds."""

    def __init__(self, n_blocks: int, n_heads: int, head_dim: int, **kw) -> None:
        super().__init__(head_size=3 * n_heads * head_dim // n_blocks, **kw)
        self.n_blocks, self.n_heads, self.head_dim = n_blocks, n_heads, head_dim

    def _out_rows(self, out_f: int, world: int):
        blocks, heads, hd = self.n_blocks, self.n_heads, self.head_dim
        if out_f != 3 * heads * hd:
            raise ValueError(f"tpx.BlocksColwise: {out_f} output features are not [q | v | k] "
                             f"of {heads} heads of {hd}")
        if world <= blocks or world % blocks:
            return super()._out_rows(out_f, world)
        if heads % world:
            raise ValueError(f"tpx.BlocksColwise: {heads} heads in {blocks} blocks do not "
                             f"split over {world} ranks in whole heads; use a TP size that "
                             f"divides {heads}")
        part, share = heads * hd // blocks, heads * hd // world  # a block's q; a rank's q
        per_block = world // blocks
        rows = []
        for r in range(world):
            start = (r // per_block) * 3 * part + (r % per_block) * share
            rows.append([(start + i * part, start + i * part + share) for i in range(3)])
        return rows

    def __repr__(self) -> str:
        return (f"BlocksColwise(n_blocks={self.n_blocks}, n_heads={self.n_heads}, "
                f"head_dim={self.head_dim})")


class KeepWhole(ParallelStyle):
    """Leaves the module whole on every rank (its parameters broadcast from ``src_rank`` as
    every unsharded one). Hugging Face's ``replicate`` and ``local_params`` (tpx's sharded
    layers compute on local tensors already, so a module that reads its own sharded
    parameters needs nothing more)."""

    def __init__(self, hf_name: str = "replicate") -> None:
        self.hf_name = hf_name

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        return module

    def __repr__(self) -> str:
        return f"KeepWhole({self.hf_name!r})"


class SplitRopeGrad(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa`` (DeepSeek-V2 style attention), replicated: its output is
    ``[k_pass | k_rope]``; ``k_pass`` goes through a column-parallel ``kv_b_proj`` (whose
    backward sums the input gradient), ``k_rope`` straight to this rank's heads, so its
    gradient is partial and is summed here. ``rope_dim``: ``config.qk_rope_head_dim``.
    Hugging Face's ``mla_kv_a_proj``."""

    def __init__(self, rope_dim: int) -> None:
        self.rope_dim = int(rope_dim)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        n = self.rope_dim

        def hook(mod, args, out):
            if pg.size() == 1 or not isinstance(out, Tensor):
                return out
            keep, rope = out.split([out.shape[-1] - n, n], dim=-1)
            return torch.cat([keep, mappings.all_reduce_grad(rope, pg)], dim=-1)

        module.register_forward_hook(copied_with_module(hook))
        return module

    def __repr__(self) -> str:
        return f"SplitRopeGrad(rope_dim={self.rope_dim})"


class VocabParallelEmbeddingStyle(ParallelStyle):
    """``nn.Embedding`` -> :class:`tpx.VocabParallelEmbedding` (rows of the vocabulary
    sharded, lookups summed), also for a subclass that scales its output (Gemma's
    ``*ScaledWordEmbedding``: ``super().forward(ids) * self.embed_scale``): the scale is kept
    and applied to the summed lookup. Any other subclass with its own forward raises
    ``ValueError``. Hugging Face's ``embedding_rowwise``; ids R, output R."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tpx.hf_plan: 'embedding_rowwise' applies to nn.Embedding; got "
                             f"{type(module).__name__}")
        if type(module).forward is nn.Embedding.forward:
            return RowwiseParallel(input_layouts=Replicate()).apply(module, ctx)
        scale = getattr(module, "embed_scale", None)
        if own_embedding_forward(module):
            raise ValueError(
                f"tpx.hf_plan: {type(module).__name__} subclasses nn.Embedding with its own "
                "forward, which a vocab-parallel embedding would drop. tpx keeps the forward "
                "of a scaled embedding (super().forward(ids) * self.embed_scale) only; leave "
                "this module out of the plan ('replicate') or write a style for it")
        from ..nn import VocabParallelEmbedding

        new = VocabParallelEmbedding.from_embedding(module, group=ctx.group,
                                                    src_rank=ctx.src_rank)
        value = getattr(module, "scalar_embed_scale", None)
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            value = float(scale)
        if isinstance(scale, Tensor) and scale.device.type != "meta" and scale.numel() == 1:
            value = float(scale)
        if value is None:
            raise ValueError(
                f"tpx.hf_plan: the scale of {type(module).__name__} is on the meta device and "
                "the module has no scalar_embed_scale to take it from; build this module off "
                "the meta device, or leave it out of the plan ('replicate')")
        device = scale.device if isinstance(scale, Tensor) else None
        dtype = scale.dtype if isinstance(scale, Tensor) else None
        new.register_buffer("embed_scale", torch.tensor(value, dtype=dtype, device=device),
                            persistent=False)
        # The value of the non-persistent buffer, to set it again when the model is
        # materialized from the meta device (tpx.checkpoint.init_unsaved_buffers), as
        # transformers' _init_weights sets the buffer of the module this one replaces.
        new._tpx_buffer_values = {"embed_scale": value}
        new.register_forward_hook(
            copied_with_module(lambda m, a, out: out * m.embed_scale.to(out.dtype)))
        return new

    def __repr__(self) -> str:
        return "VocabParallelEmbeddingStyle()"


def own_embedding_forward(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Embedding`` subclass with a forward of its own that is
    not a scaled lookup (:func:`is_scaled_embedding`): a vocabulary-parallel embedding in
    its place would drop what that forward does."""
    return (isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward
            and not is_scaled_embedding(module))


def is_scaled_embedding(module: nn.Module) -> bool:
    """A subclass of nn.Embedding whose forward is the lookup times ``self.embed_scale``."""
    if not hasattr(module, "embed_scale"):
        return False
    try:
        src = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    body = [ln.strip() for ln in src.splitlines()[1:]
            if ln.strip() and not ln.strip().startswith(("#", '"""', "'''"))]
    return (len(body) == 1 and body[0].startswith("return super().forward(")
            and "* self.embed_scale" in body[0])


# Fused experts whose class says nothing of its layout: (transposed, interleaved).
# gpt-oss: gate_up_proj [E, H, 2I] with the gate and up features alternating (its
# ``_apply_gate`` reads ``[..., ::2]`` and ``[..., 1::2]``), down_proj [E, I, H].
EXPERT_LAYOUTS = {"GptOssExperts": (True, True)}


def _experts_style(module: nn.Module, name: str, params: Dict[str, str],
                   experts: str = "tp") -> ParallelStyle:
    """``moe_tp_experts``: tpx's experts style (``experts="tp"``: expert TP,
    :class:`~tpx.parallel.moe.ExpertsTensorParallel`; ``"ep"``: expert parallelism,
    :class:`~tpx.parallel.moe.ExpertsParallel`). ``params``: the plan's parameter entries under
    this module (attribute -> style name), read here and not applied again. The pairs read:
    ``packed_colwise`` [gate | up] ``[E, 2I, H]`` with ``rowwise`` down ``[E, H, I]``; the
    same stored transposed (``packed_rowwise`` ``[E, H, 2I]`` with ``colwise`` ``[E, I, H]``,
    Aria); a non-gated ``colwise`` up ``[E, I, H]`` with ``rowwise`` down (NemotronH)."""
    from .moe import ExpertsParallel, ExpertsTensorParallel

    styles = sorted(params.values())
    kwargs: Dict[str, object] = {}
    if styles in (["colwise", "packed_rowwise"], ["colwise", "rowwise"]):
        first = "packed_rowwise" if "packed_rowwise" in styles else "colwise"
        second = "colwise" if first == "packed_rowwise" else "rowwise"
        up = next(p for p, s in params.items() if s == first)
        down = next(p for p, s in params.items() if s == second)
        kwargs = dict(gate_up=up, down=down)
        if first == "packed_rowwise":
            kwargs.update(packed=True, transposed=True)
        else:
            w_up, w_down = getattr(module, up, None), getattr(module, down, None)
            if not (isinstance(w_up, Tensor) and isinstance(w_down, Tensor)
                    and w_up.dim() == 3 and w_down.dim() == 3
                    and w_up.shape[1] == w_down.shape[2]):
                raise ValueError(
                    f"tpx.hf_plan: the experts {name!r} ('moe_tp_experts') come with "
                    f"{params}: a 'colwise' {up!r} is read as a non-gated up projection "
                    f"[experts, intermediate, hidden] beside {down!r} [experts, hidden, "
                    "intermediate], but the shapes are "
                    f"{tuple(getattr(w_up, 'shape', ()))} and "
                    f"{tuple(getattr(w_down, 'shape', ()))} (a fused [gate | up] split in one "
                    "block would pair gates with the wrong up features). Write the plan for "
                    "these experts by hand")
            kwargs["packed"] = False
    else:
        gate_up = [p for p, s in params.items() if s == "packed_colwise"]
        down = [p for p, s in params.items() if s == "rowwise"]
        other = {p: s for p, s in params.items() if p not in gate_up + down}
        if other or len(gate_up) > 1 or len(down) > 1:
            raise ValueError(
                f"tpx.hf_plan: the experts {name!r} ('moe_tp_experts') come with the parameter "
                f"entries {params}; tpx's experts style reads a 'packed_colwise' fused [gate | "
                "up] projection ([experts, 2 * intermediate, hidden]) with a 'rowwise' down "
                "projection ([experts, hidden, intermediate]), the same transposed "
                "('packed_rowwise' with 'colwise'), or a non-gated 'colwise' up with a "
                "'rowwise' down. Write the plan for these experts by hand")
        if gate_up:
            kwargs["gate_up"] = gate_up[0]
        if down:
            kwargs["down"] = down[0]
        kwargs["packed"] = True
    if type(module).__name__ in EXPERT_LAYOUTS:  # a layout its class does not say
        kwargs["transposed"], kwargs["interleaved"] = EXPERT_LAYOUTS[type(module).__name__]
    cls = ExpertsParallel if experts == "ep" else ExpertsTensorParallel
    return cls(**kwargs)


def packed_colwise(module: nn.Module) -> ParallelStyle:
    out = getattr(module, "out_features", None)
    if out is None or out % 2:
        raise ValueError(f"tpx.hf_plan: 'packed_colwise' on a module needs a linear layer with "
                         f"an even number of output features ([gate | up]); got "
                         f"{type(module).__name__} with out_features={out}")
    return ColwiseParallel(segments=(out // 2, out // 2))


def _unsupported(name: str, why: str):
    def build(module, ctx):
        raise ValueError(f"tpx.hf_plan: the style {name!r} on {type(module).__name__}: {why}")
    return build


@dataclass(frozen=True)
class HFStyle:
    """One entry of :data:`HF_STYLES`: a transformers style name, what transformers does with
    it, and how tpx computes the same thing."""

    name: str
    hf: str            # transformers' semantics (placements, what is gathered or summed)
    tpx: str           # the tpx style and its placements
    build: Callable    # build(module, ctx) -> ParallelStyle; module: one module it names
    target: str = "module"   # "module" or "module or parameter"


def _b(make):
    return lambda module, ctx: make()


_GATHER = "ColwiseParallel(output_layouts=Replicate())"
_SPLIT = "RowwiseParallel(input_layouts=Replicate())"

#: Every style name of transformers' ``ALL_PARALLEL_STYLES`` -> its tpx style.
HF_STYLES: Dict[str, HFStyle] = {s.name: s for s in (
    HFStyle("colwise", "Linear weight and bias Shard(0) (output features); input R, output "
            "S(-1)", "ColwiseParallel() (attention projections: in whole heads, see translate)",
            _b(ColwiseParallel), "module or parameter"),
    HFStyle("colwise_gather_output", "as colwise, output gathered to R", _GATHER,
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("colwise_rep", "the same as colwise_gather_output", _GATHER,
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("rowwise", "Linear weight Shard(1) (input features), bias R added once after the "
            "sum; input S(-1), output P -> R (all-reduce)", "RowwiseParallel()",
            _b(RowwiseParallel), "module or parameter"),
    HFStyle("rowwise_split_input", "as rowwise, input R split locally to S(-1)", _SPLIT,
            _b(lambda: RowwiseParallel(input_layouts=Replicate()))),
    HFStyle("rowwise_rep", "the same as rowwise_split_input", _SPLIT,
            _b(lambda: RowwiseParallel(input_layouts=Replicate()))),
    HFStyle("embedding_rowwise", "Embedding weight Shard(0) (vocabulary); ids R, lookups "
            "P -> R", "VocabParallelEmbeddingStyle() (tpx.VocabParallelEmbedding; a scaled "
            "embedding keeps its scale)", _b(VocabParallelEmbeddingStyle)),
    HFStyle("embedding_colwise", "Embedding weight Shard(1) (embedding dim); ids R, output "
            "gathered to R", "ColwiseParallel(output_layouts=Replicate()) "
            "(tpx.ColumnParallelEmbedding)",
            _b(lambda: ColwiseParallel(output_layouts=Replicate()))),
    HFStyle("packed_colwise", "fused [gate | up] weight, each half Shard(0) "
            "(_StridedShard, split_factor 2: every rank keeps matching halves); input R, output "
            "S(-1) of each half", "ColwiseParallel(segments=(n/2, n/2)) on a Linear (its bias "
            "split the same way); on experts' parameters: read by ExpertsTensorParallel",
            lambda module, ctx: packed_colwise(module), "module or parameter"),
    HFStyle("packed_rowwise", "weight packed along its last dim, each half Shard(-1) "
            "(_StridedShard), bias R", "experts' parameters only (read by the experts' style)",
            _unsupported("packed_rowwise", "a Linear whose input is two packed halves has no "
                         "tpx style; write the plan for this module by hand"),
            "module or parameter"),
    HFStyle("sequence_parallel", "norm/dropout on S(1) (the sequence), parameters R",
            "SequenceParallel(use_local_output=True) (gradients summed over the group)",
            _b(lambda: SequenceParallel(use_local_output=True))),
    HFStyle("replicated_with_grad_allreduce", "parameters R whose gradient is partial (a "
            "per-head norm after a column-parallel projection); gradient summed",
            "ReplicatedWithGradAllReduce() (a module without parameters: nothing to sum, kept "
            "whole)", lambda module, ctx: (
                ReplicatedWithGradAllReduce()
                if module is None or next(module.parameters(), None) is not None
                else KeepWhole("replicated_with_grad_allreduce"))),
    HFStyle("all_reduce", "the module's output P -> R (all-reduce), backward identity",
            "AllReduceOutput()", _b(AllReduceOutput)),
    HFStyle("mla_kv_a_proj", "output [pass | rope]: the rope part's gradient summed (it "
            "bypasses the column-parallel kv_b_proj)", "SplitRopeGrad(config.qk_rope_head_dim)",
            lambda module, ctx: SplitRopeGrad(_rope_dim(ctx))),
    HFStyle("local_params", "the module's forward runs on its sharded parameters as local "
            "tensors", "KeepWhole('local_params') (tpx computes on local tensors already)",
            _b(lambda: KeepWhole("local_params"))),
    HFStyle("replicate", "every rank keeps the full parameter", "KeepWhole('replicate')",
            _b(lambda: KeepWhole("replicate")), "module or parameter"),
    HFStyle("moe_tp_experts", "each expert's [gate|up] Shard(-2) packed, down Shard(-1); "
            "input R (gradient summed), output P -> R", "tpx.parallel.moe."
            "ExpertsTensorParallel (imported when needed; it shards the experts' parameters)",
            lambda module, ctx: _experts_style(module, ctx["name"], ctx["params"],
                                               ctx["experts"])),
    HFStyle("moe_identity_expert", "input divided by the TP size (the experts' sum counts it "
            "once)", "tpx.MoEIdentityExpert()", _b(MoEIdentityExpert)),
)}


def text_config(model: nn.Module):
    """The text part of a Hugging Face model's config (the config itself for text models)."""
    cfg = getattr(model, "config", None)
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _rope_dim(ctx) -> int:
    cfg = text_config(ctx["model"])
    n = getattr(cfg, "qk_rope_head_dim", None)
    if n is None:
        raise ValueError("tpx.hf_plan: 'mla_kv_a_proj' needs config.qk_rope_head_dim")
    return n


def style(name: str, module: Optional[nn.Module] = None) -> ParallelStyle:
    """The tpx style for one Hugging Face style name (``"colwise"``, ``"rowwise"``, ...).
    ``module``: the module it will shard, for the styles that read it (``packed_colwise``)."""
    if name not in HF_STYLES:
        raise ValueError(f"tpx.hf_plan.style: unknown Hugging Face style {name!r}; known: "
                         f"{sorted(HF_STYLES)}")
    if name in ("moe_tp_experts", "mla_kv_a_proj"):
        raise ValueError(f"tpx.hf_plan.style: {name!r} reads the model (its config, the "
                         "experts' parameter entries); use tpx.hf_plan.translate(model)")
    return HF_STYLES[name].build(module, {})


def _storage(t) -> Optional[int]:
    return t.untyped_storage().data_ptr() if isinstance(t, Tensor) else None


class PartialGradParams(ParallelStyle):
    """A module with parameters in a block whose plan splits features column-parallel and
    joins them row-parallel, not named by the plan. Where it sees only this rank's features
    (an activation with its own parameters between the projections: Apertus' xIELU
    ``alpha_p`` / ``alpha_n``) its gradient is a partial sum and is summed over the group, as
    :class:`ReplicatedWithGradAllReduce` does; where it sees a whole (replicated) input (a norm
    before the projections: an MLA attention's ``kv_a_layernorm``) its gradient is whole and
    left alone. Which of the two, each call tells from its input: a column-parallel sibling's
    output of this call of the block (or a view of it: one half of a packed [gate | up]
    output), or anything else."""

    def __init__(self, name: str, block: nn.Module, columns: List[str]) -> None:
        self.name, self.block, self.columns = name, block, list(columns)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        if pg.size() == 1:
            return module
        state = {"partial": False, "outputs": set(), "hooked": set()}
        self.block.register_forward_pre_hook(
            copied_with_module(lambda mod, args: self._start(state)))
        # Replicate() DTensors, the module computing on their local tensors (as
        # ReplicatedWithGradAllReduce's), swapped in by a hook that runs before this one
        owned = replicate_params(module, pg)

        def see(mod, args):
            self._see(state, args)
            if state["partial"]:  # this call's gradients summed in its backward
                locals_ = [owner._parameters[name] for owner, name in owned]
                sum_partial_grads(locals_, pg)
                for (owner, name), local in zip(owned, locals_):
                    owner._parameters[name] = local

        module.register_forward_pre_hook(copied_with_module(see))
        compute_on_locals(module, owned)
        return module

    def _start(self, state) -> None:
        """At each call of the block: forget the last call's outputs; hook the column-parallel
        siblings (the layers parallelize_module put in their place) to record theirs."""
        state["outputs"].clear()
        for c in self.columns:
            sub = self.block.get_submodule(c)
            if id(sub) not in state["hooked"]:
                state["hooked"].add(id(sub))
                sub.register_forward_hook(
                    copied_with_module(lambda mod, args, out: state["outputs"].add(_storage(out))))

    def _see(self, state, args) -> None:
        x = next((a for a in args if isinstance(a, Tensor)), None)
        state["partial"] = x is not None and _storage(x) in state["outputs"]

    def __repr__(self) -> str:
        return f"gradient summed where it sees {self.columns}' local features"


class HeadParams(ParallelStyle):
    """Bare per-head parameters of an attention module split by heads (attention sinks,
    ``[num_heads]``): each rank keeps the rows of its query heads (``num_heads`` must divide
    by the TP size, as the queries' split needs). The parameters become ``DTensor`` s,
    ``Shard(0)`` of their full shape on the TP mesh (state dicts, DCP and optimizers see the
    whole); the module's forward reads their local tensors (Hugging Face's ``local_params``),
    and their gradients land as ``DTensor`` s. Values from ``src_rank``."""

    def __init__(self, names: Tuple[str, ...], num_heads: int,
                 num_kv_heads: Optional[int] = None) -> None:
        self.names, self.num_heads = tuple(names), int(num_heads)
        # given: the heads are split as ShardedAttention(uneven=True) splits them
        self.num_kv_heads = int(num_kv_heads) if num_kv_heads is not None else None

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg, src_rank = ctx.group, ctx.src_rank
        from torch.distributed.tensor import DTensor

        from ..layout.initial import broadcast_
        from ..layout.sharding import describe_params

        world, rank = pg.size(), dist.get_rank(pg)
        if self.num_heads % world and self.num_kv_heads is None:
            raise ValueError(f"tpx.HeadParams: {self.num_heads} heads do not divide by the TP "
                             f"size {world}")
        names = tuple(n for n in self.names if getattr(module, n, None) is not None)
        params = [getattr(module, n) for n in names]
        if not params:
            return module
        if src_rank is not None and world > 1:
            with torch.no_grad():
                broadcast_(pg, src_rank, [p.data for p in params])
        if self.num_kv_heads is not None:
            rows = tuple((q,) for q, _ in head_split(self.num_heads, self.num_kv_heads, world))
        else:
            per = self.num_heads // world
            rows = tuple(((r * per, (r + 1) * per),) for r in range(world))
        lo, hi = rows[rank][0]
        with torch.no_grad():
            for p in params:
                p.data = p.detach()[lo:hi].clone()
        # Described as a tpx layer's parameters are: tpx.checkpoint, clipping and the checks
        # read the layout; describe_params makes them DTensors (Shard(0), full shape).
        module._shards = lambda names=names, rows=rows: [(n, 0, rows) for n in names]
        module.group = pg
        module._tpx_dtensor_params = True
        describe_params(module)
        saved: Dict[int, Dict[str, nn.Parameter]] = {}

        def to_local(mod, args):
            dts = [n for n, p in mod._parameters.items() if isinstance(p, DTensor)]
            saved[id(mod)] = {n: mod._parameters[n] for n in dts}
            for n in dts:
                dt = mod._parameters[n]
                mod._parameters[n] = dt.to_local() if torch.is_grad_enabled() else \
                    dt._local_tensor
            return None

        def restore(mod, args, out):
            for n, p in saved.pop(id(mod), {}).items():
                mod._parameters[n] = p
            return None

        module.register_forward_pre_hook(copied_with_module(to_local))
        module.register_forward_hook(copied_with_module(restore), always_call=True)
        return module

    def __repr__(self) -> str:
        return f"HeadParams({list(self.names)}, num_heads={self.num_heads})"


class SparseActivationsOverRanks(ParallelStyle):
    """On a block whose ``gate_proj`` is column-parallel and which keeps only the activations
    above a mean plus a multiple of the standard deviation over ALL its intermediate features
    (Gemma 3n's ``activation_sparsity``, its method ``_gaussian_topk``): the statistic is taken
    over every rank's features (:func:`tpx.nn.functional.gaussian_topk`), as on one device.
    A block without activation sparsity is left as it is. Placement: the block's input and
    output as its projections' (``R``)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        sparsity = float(getattr(module, "activation_sparsity", 0.0) or 0.0)
        if sparsity <= 0.0 or ctx.group.size() == 1:
            return module
        features = int(module.intermediate_size)
        gate = module.gate_proj
        full = sum(gate.out_sizes) if hasattr(gate, "out_sizes") else gate.out_features
        if full != features:
            raise ValueError(f"tpx.SparseActivationsOverRanks: {type(module).__name__}'s "
                             f"gate_proj has {full} output features, its intermediate_size "
                             f"is {features}")
        pg = ctx.group

        def topk_over_ranks(inputs: Tensor) -> Tensor:
            return gaussian_topk(inputs, sparsity, features, pg)

        module.__dict__["_gaussian_topk"] = topk_over_ranks
        return module

    def __repr__(self) -> str:
        return "SparseActivationsOverRanks()"
