"""Mixture-of-experts layers under tensor parallelism (expert TP).

A mixture-of-experts block routes each token to ``k`` of ``E`` experts (MLPs) and adds their
outputs, weighted by the router's scores. Under expert TP every rank keeps every expert and a
slice of each one's intermediate features, as Megatron's column/row split of a dense MLP:

* the gate and up projections are split by output feature (for a fused ``[gate | up]``
  weight, each half separately, so that every rank keeps the gate and up rows of the same
  features; for an interleaved ``[g0, u0, g1, u1, ...]`` weight, whole pairs);
* the down projection is split by input feature, so each rank's expert outputs are partial
  sums;
* the block's routed output is summed over the group ONCE, after the experts' weighted outputs
  are combined (not once per expert), and in the backward the gradients of the experts'
  inputs (the hidden states and the routing weights, both partial sums) are summed ONCE, in
  one all-reduce.

The router, the shared experts and the auxiliary (load-balancing) losses are whatever the plan
makes of them: a replicated router computes the same routing on every rank, so the tokens a
capacity limit drops are dropped alike.

Bytes per token and rank, ``H`` the hidden size, ``b`` bytes per element, ring all-reduce over
``P`` ranks: forward ``2 (P-1)/P * H * b``, backward ``2 (P-1)/P * (H + k) * b`` (the hidden
state's and the ``k`` routing weights' gradients), whatever ``E`` and ``k`` are.

Layouts:

* **Fused 3-D experts** (Hugging Face transformers 5: ``experts.gate_up_proj`` ``[E, 2I, H]``,
  ``experts.down_proj`` ``[E, H, I]``, called as ``experts(hidden, top_k_index,
  top_k_weights)``): :class:`ExpertsTensorParallel` on the experts module.
* **A ``ModuleList`` of expert MLPs** (transformers 4, most user models): the stock styles on
  each expert (``ColwiseParallel`` on its gate/up, ``RowwiseParallel`` on its down). Each
  expert's output is then summed on its own, a reduction per expert a token visits (``k``
  times the bytes of the fused layout): the combination of the experts is the block's own
  code, which no style can see into.
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import mappings
from ..comm.groups import copied_with_module, shard_bounds
from ..layout.initial import shard_in_place
from ..layout.dtensor_io import DTensor, Partial, Replicate
from ..layout.param_dtensors import compute_on_locals
from ..layout.sharding import describe_params, guard_state_dict
from .style import ParallelStyle, TPContext

__all__ = ["ExpertsTensorParallel", "ExpertsParallel", "GroupedExpertsParallel",
           "GroupedExpertsTensorParallel", "MoEIdentityExpert"]

Ranges = Tuple[Tuple[int, int], ...]


def _expert_args(module: nn.Module) -> Tuple[str, str, str]:
    """The names of the experts' arguments: hidden states, expert indices, routing weights."""
    try:
        names = [p.name for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # pragma: no cover
        names = []
    names += ["hidden_states", "top_k_index", "top_k_weights"][len(names):]
    return names[0], names[1], names[2]


class ExpertsTensorParallel(ParallelStyle):
    """Expert TP for experts kept as fused 3-D parameters (Hugging Face transformers 5's
    ``*Experts`` modules; Hugging Face's plans call it ``moe_tp_experts`` on the experts
    module, with ``packed_colwise`` on ``gate_up_proj`` and ``rowwise`` on ``down_proj``).

    Applied to the experts module itself. Shards, in place (the ``Parameter`` objects stay,
    holding this rank's slice):

    * ``gate_up`` (``[E, 2I, H]``; ``[E, H, 2I]`` when the module is ``is_transposed``): the
      ``I`` intermediate features split with ``tpx.shard_range(I)``, each of the gate and up
      halves separately (or whole ``(gate, up)`` pairs when the module is not
      ``is_concatenated``: interleaved rows). Its bias ``<gate_up>_bias`` ``[E, 2I]`` likewise.
    * ``down`` (``[E, H, I]``; ``[E, I, H]`` transposed): the same ``I`` features.
      Its bias ``<down>_bias`` ``[E, H]`` stays whole; each rank adds ``bias / P`` so that the
      sum over the group adds it once.
    * Experts without a gate (``has_gate=False``): ``gate_up`` names the ``up`` weight
      ``[E, I, H]``, split as one block.

    Placements: ``hidden_states`` R, ``top_k_index`` R, ``top_k_weights`` R (their gradients
    are partial sums, summed in one all-reduce) -> output R (the partial outputs summed once;
    with ``output_layouts=Partial()`` each rank's partial sum, for the block around the experts
    to reduce: sequence parallelism reduce-scatters it along the sequence). The routing must be
    the same on every rank (a replicated router on replicated inputs).

    ``gate_up`` / ``down``: the parameter names (Hugging Face's). A weight split in
    ``tpx.shard_range``'s blocks (``I`` a multiple of ``P`` times the 16-byte unit, as in real
    models) becomes a ``DTensor`` parameter ``Shard(dim)`` of its global shape on the group's
    1-D mesh, the down bias a ``Replicate()`` one; the module's own forward runs on their local
    tensors and their gradients land as ``DTensor`` s. A fused ``[gate | up]`` (its halves split
    separately) or another split stays this rank's plain tensor: ``state_dict()`` raises on it,
    naming ``tpx.checkpoint``, which saves and loads every layout. Checkpoints, gradient clipping
    and memory accounting see the slices through the parameters' sharding description, like
    every tpx layer's.
    """

    def __init__(self, *, gate_up: str = "gate_up_proj", down: str = "down_proj",
                 packed: Optional[bool] = None, transposed: Optional[bool] = None,
                 interleaved: Optional[bool] = None, output_layouts=None) -> None:
        self.gate_up, self.down = gate_up, down
        self.packed, self.transposed, self.interleaved = packed, transposed, interleaved
        self.output_layouts = _output_layout(type(self).__name__, output_layouts, Replicate())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(gate_up={self.gate_up!r}, down={self.down!r}, "
                f"output_layouts={self.output_layouts!r})")

    # -- layout -------------------------------------------------------------------------------
    def _layout(self, module: nn.Module):
        what = f"tpx.ExpertsTensorParallel on {type(module).__name__}"
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(f"{what}: a ModuleList of expert MLPs keeps no fused weights; "
                             "shard each expert with the stock styles instead, e.g. "
                             "{'experts.*.w1': ColwiseParallel(), 'experts.*.w3': "
                             "ColwiseParallel(), 'experts.*.w2': RowwiseParallel()}")
        if hasattr(module, "_tpx_experts_group"):
            raise ValueError(f"{what}: the experts are sharded already")
        params = dict(module.named_parameters(recurse=False))
        for name in (self.gate_up, self.down):
            if name not in params:
                raise ValueError(f"{what}: the module has no parameter {name!r} (it has "
                                 f"{sorted(params)}); name the fused expert weights with "
                                 "gate_up=... and down=...")
            p = params[name]
            if type(p.data) is not torch.Tensor and p.data.__class__.__name__ == "DTensor":
                raise ValueError(f"{what}: {name!r} is already a DTensor (sharded by another "
                                 "library); start from the unsharded model")
            if p.dim() != 3:
                raise ValueError(f"{what}: {name!r} must be a 3-D [experts, out, in] weight; "
                                 f"got shape {tuple(p.shape)}. A ModuleList of expert MLPs "
                                 "takes ColwiseParallel / RowwiseParallel on each expert")
        transposed = bool(getattr(module, "is_transposed", False)) if self.transposed is None \
            else bool(self.transposed)
        gated = bool(getattr(module, "has_gate", True)) if self.packed is None else bool(self.packed)
        interleaved = (not bool(getattr(module, "is_concatenated", True))
                       if self.interleaved is None else bool(self.interleaved))
        gu, dn = params[self.gate_up], params[self.down]
        gu_dim, dn_dim = (2, 1) if transposed else (1, 2)
        inter = dn.shape[dn_dim]
        hidden = dn.shape[3 - dn_dim]
        want = 2 * inter if gated else inter
        # gate_up may hold more experts than down: LongCat-Flash's zero-computation experts
        # (an index past the routed ones is an identity) keep unused gate_up rows, which expert
        # TP splits like the others; expert parallelism deals out whole experts and needs the
        # counts equal.
        more = gu.shape[0] > dn.shape[0] and not isinstance(self, ExpertsParallel)
        if (gu.shape[0] != dn.shape[0] and not more) or gu.shape[gu_dim] != want or \
                gu.shape[3 - gu_dim] != hidden:
            raise ValueError(
                f"{what}: {self.gate_up!r} {tuple(gu.shape)} and {self.down!r} "
                f"{tuple(dn.shape)} do not fit [E, {'2I' if gated else 'I'}, H] and [E, H, I]"
                f"{' (transposed)' if transposed else ''}: check `transposed` / `packed`")
        return dict(transposed=transposed, gated=gated, interleaved=interleaved,
                    gu_dim=gu_dim, dn_dim=dn_dim, inter=inter, hidden=hidden,
                    experts=dn.shape[0])

    @staticmethod
    def _rows(inter: int, world: int, gated: bool, interleaved: bool, align: int = 1):
        """Per rank, the rows of the gate/up and down weights it holds. The ``inter``
        features are split in units of ``align`` when they divide by it, so that each slice
        keeps the 16-byte strides grouped GEMMs need."""
        gu_rows: List[Ranges] = []
        dn_rows: List[Ranges] = []
        unit = align if align > 1 and inter % align == 0 else 1
        for r in range(world):
            s, e = (x * unit for x in shard_bounds(inter // unit, r, world))
            dn_rows.append(((s, e),))
            if not gated:
                gu_rows.append(((s, e),))
            elif interleaved:
                gu_rows.append(((2 * s, 2 * e),))
            else:
                gu_rows.append(((s, e), (inter + s, inter + e)))
        return gu_rows, dn_rows

    # -- apply --------------------------------------------------------------------------------
    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        lay = self._layout(module)
        world, rank = pg.size(), dist.get_rank(pg)
        shards, dn_bias = self._plan_shards(module, lay, world)
        config = dict(experts=lay["experts"], inter=lay["inter"], hidden=lay["hidden"],
                      transposed=lay["transposed"], gated=lay["gated"],
                      interleaved=lay["interleaved"], names=[s[0] for s in shards])
        # the down bias is replicated: each rank adds bias / P
        shard_in_place(module, shards, ctx.group, ctx.src_rank, type(self).__name__, config,
                       replicated=[] if dn_bias is None else [dn_bias])
        module._shards = lambda shards=shards: [(n, d, rows) for n, d, rows in shards]
        module.group = pg
        module._tpx_experts_group = pg
        # DTensors where torch's placements say the layout: a weight split as shard_range
        # splits it Shard(dim), the down bias Replicate(); the halves of a fused [gate | up]
        # split separately stay this rank's plain tensor (state_dict() raises on it, naming
        # tpx.checkpoint)
        module._tpx_dtensor_params = True
        describe_params(module)
        compute_on_locals(module, [(module, n) for n, p in module._parameters.items()
                                   if isinstance(p, DTensor)])
        guard_state_dict(module)  # state_dict() speaks the full experts' names and shapes
        self._local_experts(module, lay, world, rank)
        if world > 1:
            self._install_hooks(module, pg, dn_bias is not None)
        return module

    def _plan_shards(self, module: nn.Module, lay: dict, world: int):
        """``([(param name, dim, rows per rank)], the bias each rank adds a 1/P of)``."""
        align = max(1, 16 // getattr(module, self.down).element_size())
        gu_rows, dn_rows = self._rows(lay["inter"], world, lay["gated"], lay["interleaved"],
                                      align)
        shards = [(self.gate_up, lay["gu_dim"], gu_rows), (self.down, lay["dn_dim"], dn_rows)]
        gu_bias = getattr(module, self.gate_up + "_bias", None)
        dn_bias = getattr(module, self.down + "_bias", None)
        if isinstance(gu_bias, nn.Parameter):
            shards.append((self.gate_up + "_bias", 1, gu_rows))
        return shards, dn_bias if isinstance(dn_bias, nn.Parameter) else None

    def _local_experts(self, module: nn.Module, lay: dict, world: int, rank: int) -> None:
        """Expert TP keeps every expert: nothing to change."""

    def _route(self, module, index, weights):
        """The expert indices and routing weights this rank's experts see (all of them)."""
        return index, weights

    def _install_hooks(self, module: nn.Module, pg: dist.ProcessGroup, dn_bias: bool) -> None:
        names = _expert_args(module)
        bias_name = self.down + "_bias"
        world = pg.size()
        calls = []  # per call in flight: the tensors whose gradients are summed over the group

        def pre(mod, args, kwargs):
            args = list(args)
            slots = []  # (where, key) of the hidden states, expert indices, routing weights
            for pos, key in enumerate(names):
                if pos < len(args):
                    slots.append(("a", pos))
                elif key in kwargs:
                    slots.append(("k", key))
                else:
                    slots.append(None)
            values = [None if s is None else args[s[1]] if s[0] == "a" else kwargs[s[1]]
                      for s in slots]
            values = [v.to_local() if hasattr(v, "to_local") else v for v in values]
            keep = [i for i in (0, 2) if isinstance(values[i], Tensor) and
                    values[i].is_floating_point()]
            summed = mappings.all_reduce_grads([values[i] for i in keep], pg)
            for i, v in zip(keep, summed):
                values[i] = v
            # this call's tensors whose backward must run on every rank: the summed inputs
            # and the local parameters (compute_on_locals' hook swapped them in before this one)
            calls.append(list(summed) + [p for p in mod._parameters.values()
                                         if isinstance(p, Tensor) and p.requires_grad])
            if values[1] is not None and values[2] is not None:
                values[1], values[2] = self._route(mod, values[1], values[2])
            for slot, v in zip(slots, values):
                if slot is None:
                    continue
                if slot[0] == "a":
                    args[slot[1]] = v
                else:
                    kwargs[slot[1]] = v
            if dn_bias:  # each rank adds bias / P: the group's sum adds it once
                # (the bias's local tensor, swapped in by compute_on_locals' hook before this
                # one, which also puts the parameter back after the forward)
                mod._parameters[bias_name] = mappings.scale_forward(
                    mod._parameters[bias_name], 1.0 / world)
            return tuple(args), kwargs

        reduce = isinstance(self.output_layouts, Replicate)

        def post(mod, args, kwargs, output):
            used = calls.pop() if calls else []  # always called: an exception's entry too
            if not isinstance(output, Tensor):
                return output
            # Every rank runs the backward of the input sums, their all-reduce included, and
            # every parameter gets a gradient (zeros for an expert no token reached, as on one
            # device), also when no token reached this rank's experts (expert parallelism:
            # then the forward used none of them).
            output = mappings.depend_on(output, used)
            return mappings.all_reduce_sum(output, pg) if reduce else output

        module.register_forward_pre_hook(copied_with_module(pre), with_kwargs=True)
        module.register_forward_hook(copied_with_module(post), with_kwargs=True, always_call=True)


def _output_layout(what: str, given, default):
    """The experts' output placement: ``Partial()`` (each rank's partial sum, for the caller to
    reduce) or ``Replicate()`` (summed here); ``default`` when ``given`` is ``None``."""
    out = default if given is None else given
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    if not isinstance(out, (Partial, Replicate)):
        raise ValueError(f"tpx.{what}: `output_layouts` must be Partial() (the caller reduces) "
                         f"or Replicate(); got {out!r}")
    return out


def _expert_range(experts: int, rank: int, world: int) -> Tuple[int, int]:
    """The experts rank ``rank`` holds: ``tpx.shard_range``'s blocks (the layout of a ``Shard(0)``
    ``DTensor``) where they leave no rank without one; otherwise counts that differ by at most
    one (``E=4`` over 3 ranks: 1, 1, 2), so that every rank holds one when ``E >= P``."""
    blocks = [shard_bounds(experts, r, world) for r in range(world)]
    if all(e > s for s, e in blocks):
        return blocks[rank]
    return rank * experts // world, (rank + 1) * experts // world


class ExpertsParallel(ExpertsTensorParallel):
    """Expert parallelism over the TP group, for the same fused 3-D experts as
    :class:`ExpertsTensorParallel`: each rank keeps a subset of WHOLE experts (every parameter,
    biases included, split along dim 0: ``tpx.shard_range(E)``, a ``Shard(0)`` ``DTensor``
    parameter, where that leaves every rank an expert; otherwise experts
    ``[r E // P, (r+1) E // P)``, plain tensors) and computes
    them for the tokens routed to them; the others' slots are masked (index set to the local
    expert count, Hugging Face's convention for experts not held here; routing weight zero).

    The tokens are replicated over the group (as everywhere in 1-D TP), so no token moves: the
    partial outputs are summed with one all-reduce forward and the hidden states' and routing
    weights' gradients with one backward, the same bytes as expert TP. Against expert TP each
    rank runs whole experts (larger GEMMs, no 1/P-wide slices) but only the tokens routed to its
    experts: the work per rank follows the router's balance. Needs at least as many experts as
    ranks.

    Placements: as :class:`ExpertsTensorParallel` (inputs R, gradients P summed to R; output R).
    """

    def _plan_shards(self, module: nn.Module, lay: dict, world: int):
        experts = lay["experts"]
        if experts < world:
            raise ValueError(f"tpx.ExpertsParallel on {type(module).__name__}: {experts} "
                             f"experts cannot be split over {world} ranks (each rank needs at "
                             "least one); use ExpertsTensorParallel")
        rows = [(_expert_range(experts, r, world),) for r in range(world)]
        shards = []
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == experts:
                shards.append((name, 0, rows))
        return shards, None

    def _local_experts(self, module: nn.Module, lay: dict, world: int, rank: int) -> None:
        start, end = _expert_range(lay["experts"], rank, world)
        module._tpx_local_experts = (start, end - start)
        module.num_experts = end - start
        module._is_expert_parallel = True  # Hugging Face's grouped GEMM masks the others' slots

    def _route(self, module, index, weights):
        start, count = module._tpx_local_experts
        local = index - start
        mine = (local >= 0) & (local < count)
        index = torch.where(mine, local, torch.full_like(local, count))
        return index, weights * mine.to(weights.dtype)


class GroupedExpertsTensorParallel(ParallelStyle):
    """Expert TP for experts kept as separate 3-D gate, up and down weights and called on tokens
    already grouped by expert: torchtitan's ``GroupedExperts`` (``w1`` gate ``[E, I, H]``,
    ``w3`` up ``[E, I, H]``, ``w2`` down ``[E, H, I]``, ``forward(x, num_tokens_per_expert)``),
    the module torchtitan's own ``TensorParallel`` style shards.

    Applied to the experts module. Every rank keeps every expert and the intermediate features
    ``tpx.shard_range(I)`` of each: ``gate`` and ``up`` split along dim 1, ``down`` along dim 2.
    The three become ``DTensor`` parameters ``Shard(1)`` / ``Shard(2)`` of their global
    shapes on the group's 1-D mesh (the layout ``torch.distributed.tensor.distribute_tensor``
    gives, uneven ``I`` included), with their values from rank ``src_rank``; the module's own
    forward runs on their local tensors (its grouped GEMM or loop, unchanged), and their
    gradients land as ``DTensor`` s of the same placements.

    Placements: input ``x`` R (the tokens grouped by expert, the same on every rank; its
    gradient, of which each rank computes a partial sum, is summed over the group in the
    backward: one all-reduce) -> output P, each rank's partial sum over its features, with
    ``output_layouts=Partial()`` (the default, as torchtitan's ``TensorParallel``: the block
    around the experts reduces its output once, e.g.
    ``PrepareModuleInputOutput(output_layouts=(Partial(),), ...)`` on the MoE module); with
    ``output_layouts=Replicate()`` the style sums the output over the group itself (one
    all-reduce per call).

    ``gate`` / ``up`` / ``down``: the parameter names (torchtitan's by default); ``up=None``
    for experts without a gate product (``gate`` then names the single input projection).
    """

    def __init__(self, *, gate: str = "w1", up: Optional[str] = "w3", down: str = "w2",
                 output_layouts=None) -> None:
        out = _output_layout(type(self).__name__, output_layouts, Partial())
        self.gate, self.up, self.down = gate, up, down
        self.output_layouts = out
        self._reduce = isinstance(out, Replicate)

    def __repr__(self) -> str:
        return (f"GroupedExpertsTensorParallel(gate={self.gate!r}, up={self.up!r}, "
                f"down={self.down!r}, output_layouts={self.output_layouts!r})")

    def _names(self) -> List[str]:
        return [n for n in (self.gate, self.up, self.down) if n is not None]

    def _layout(self, module: nn.Module) -> Tuple[int, int, int]:
        """``(experts, intermediate, hidden)``, or a ``ValueError`` naming what to change."""
        what = f"tpx.GroupedExpertsTensorParallel on {type(module).__name__}"
        params = dict(module.named_parameters(recurse=False))
        for name in self._names():
            if name not in params:
                raise ValueError(f"{what}: the module has no parameter {name!r} (it has "
                                 f"{sorted(params)}); name the expert weights with gate=..., "
                                 "up=... and down=...")
            p = params[name]
            if isinstance(p, DTensor):
                raise ValueError(f"{what}: {name!r} is already a DTensor (sharded already, by "
                                 "tpx or another library); start from the unsharded model")
            if p.dim() != 3:
                raise ValueError(f"{what}: {name!r} must be a 3-D [experts, out, in] weight; "
                                 f"got shape {tuple(p.shape)}")
        dn = params[self.down]
        experts, hidden, inter = dn.shape
        for name in self._names()[:-1]:
            if tuple(params[name].shape) != (experts, inter, hidden):
                raise ValueError(
                    f"{what}: {name!r} {tuple(params[name].shape)} does not fit "
                    f"[E, I, H] = {(experts, inter, hidden)} given {self.down!r} "
                    f"{tuple(dn.shape)} ([E, H, I])")
        return experts, inter, hidden

    def validate(self, module: nn.Module, ctx: TPContext) -> None:
        self._layout(module)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        experts, inter, hidden = self._layout(module)
        world, rank = pg.size(), dist.get_rank(pg)
        shards = self._plan(module, experts, inter, world)
        shard_in_place(module, shards, ctx.group, ctx.src_rank, type(self).__name__,
                       dict(experts=experts, inter=inter, hidden=hidden, names=self._names(),
                            reduce=self._reduce))
        module._shards = lambda shards=shards: list(shards)
        module.group = pg
        module._tpx_dtensor_params = True
        describe_params(module)  # DTensors of the global shapes (Shard(1) / Shard(2), Shard(0))
        compute_on_locals(module, [(module, name) for name, _, _ in shards])
        if world > 1:
            self._install_hooks(module, pg, shards[0][2][rank][0])
        return module

    def _plan(self, module: nn.Module, experts: int, inter: int, world: int):
        """``[(param name, dim, rows per rank)]``: the intermediate features split."""
        rows = tuple((shard_bounds(inter, r, world),) for r in range(world))
        return [(n, 2 if n == self.down else 1, rows) for n in self._names()]

    def _install_hooks(self, module: nn.Module, pg: dist.ProcessGroup, mine) -> None:
        call = _Arguments(module)

        def pre(mod, args, kwargs):
            # each rank's input gradient is a partial sum: summed in the backward, one
            # all-reduce
            args = list(args)
            x = call.get(args, kwargs, 0)
            if isinstance(x, Tensor) and x.is_floating_point():
                call.put(args, kwargs, 0, mappings.all_reduce_grad(x, pg))
            return tuple(args), kwargs

        module.register_forward_pre_hook(copied_with_module(pre), with_kwargs=True)
        if self._reduce:
            module.register_forward_hook(
                copied_with_module(lambda mod, args, out: mappings.all_reduce_sum(out, pg)
                                   if isinstance(out, Tensor) else out))


class _Arguments:
    """The experts' first arguments (``x``, ``num_tokens_per_expert``), passed by position or by
    name."""

    def __init__(self, module: nn.Module) -> None:
        self.names = list(_expert_args(module)[:2])

    def get(self, args: list, kwargs: dict, i: int):
        return args[i] if i < len(args) else kwargs.get(self.names[i])

    def put(self, args: list, kwargs: dict, i: int, value) -> None:
        if i < len(args):
            args[i] = value
        else:
            kwargs[self.names[i]] = value


def rows_of(rows, rank: int) -> int:
    """How many entries rank ``rank`` holds of a split given as row ranges per rank."""
    return sum(e - s for s, e in rows[rank])


class GroupedExpertsParallel(GroupedExpertsTensorParallel):
    """Expert parallelism over the TP group for the same grouped experts as
    :class:`GroupedExpertsTensorParallel` (torchtitan's ``GroupedExperts``): each rank keeps
    WHOLE experts, experts ``tpx.shard_range(E)`` (``gate``, ``up`` and ``down`` ``Shard(0)``
    ``DTensor`` parameters of the global shapes), and runs the module's own forward on the rows
    of ``x`` routed to them (the tokens arrive grouped by expert, so they are one block of
    rows, found from ``num_tokens_per_expert``: one copy of the counts to the host per call);
    the other rows of its output are zeros. The tokens are replicated over the group, as
    everywhere in 1-D TP, so none moves: the same one all-reduce of the output and one of the
    input's gradient as expert TP, but whole experts (larger GEMMs) on fewer tokens per rank.
    Every rank must hold at least one expert (``E`` large enough for ``tpx.shard_range``'s
    split over the group).

    Placements: as :class:`GroupedExpertsTensorParallel` (input R, its gradient summed in the
    backward; output P by default, R with ``output_layouts=Replicate()``)."""

    def __repr__(self) -> str:
        return (f"GroupedExpertsParallel(gate={self.gate!r}, up={self.up!r}, "
                f"down={self.down!r}, output_layouts={self.output_layouts!r})")

    def _plan(self, module: nn.Module, experts: int, inter: int, world: int):
        rows = tuple((shard_bounds(experts, r, world),) for r in range(world))
        if any(rows_of(rows, r) == 0 for r in range(world)):
            raise ValueError(
                f"tpx.GroupedExpertsParallel on {type(module).__name__}: {experts} experts split "
                f"over {world} ranks as tpx.shard_range does leave rank(s) "
                f"{[r for r in range(world) if rows_of(rows, r) == 0]} without an expert; use "
                "a group of fewer ranks, or GroupedExpertsTensorParallel (every rank a slice "
                "of every expert)")
        return [(n, 0, rows) for n in self._names()]

    def _install_hooks(self, module: nn.Module, pg: dist.ProcessGroup, mine) -> None:
        e0, e1 = mine
        call = _Arguments(module)
        calls = []  # per call in flight: (rows of x, first row of this rank's block, its rows)

        def pre(mod, args, kwargs):
            args = list(args)
            x, counts = call.get(args, kwargs, 0), call.get(args, kwargs, 1)
            if x.is_floating_point():
                x = mappings.all_reduce_grad(x, pg)
            per_expert = [int(c) for c in counts.tolist()]
            start, n = sum(per_expert[:e0]), sum(per_expert[e0:e1])
            calls.append((x.shape[0], start, n))
            call.put(args, kwargs, 0, x[start:start + n])
            call.put(args, kwargs, 1, counts[e0:e1])
            return tuple(args), kwargs

        def post(mod, args, out):
            # always called (an exception in the forward too): this call's entry goes
            rows, start, n = calls.pop()
            if not isinstance(out, Tensor):
                return out
            out = torch.cat([out.new_zeros((start,) + tuple(out.shape[1:])), out[:n],
                             out.new_zeros((rows - start - n,) + tuple(out.shape[1:]))])
            return mappings.all_reduce_sum(out, pg) if self._reduce else out

        module.register_forward_pre_hook(copied_with_module(pre), with_kwargs=True)
        module.register_forward_hook(copied_with_module(post), always_call=True)


class MoEIdentityExpert(ParallelStyle):
    """An expert that returns its input (Hugging Face's ``moe_identity_expert``, the "zero
    experts" of some MoE models) inside a block whose output is summed over the group: its input
    is divided by the TP size, so that the sum adds it once. Placement: input R -> output P."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        pg = ctx.group
        world = pg.size()
        if world > 1:
            def pre(mod, args):
                if args and isinstance(args[0], Tensor):
                    return (args[0] / world,) + tuple(args[1:])
                return args

            module.register_forward_pre_hook(copied_with_module(pre))
        return module

    def __repr__(self) -> str:
        return "MoEIdentityExpert()"
