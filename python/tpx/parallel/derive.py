"""Plans derived from the model itself, and proved before they are used.

``tpx.plans.auto`` reads a model's own TP plan where it ships one. For a model without one
(68 of transformers' causal LMs, a plain decoder in names tpx has never seen), or on request
(``tpx.plans.auto(model, derive=True)``), :func:`derive` finds the tensor-parallel structure
from the model's computation, not from its module names:

1. **Trace.** One forward of a tiny batch (2 sequences of 7 tokens, on the model's device, in
   eval mode; a decoder with cross-attention also gets encoder states) with every tensor tagged by the projections (``nn.Linear``, Hugging Face's
   ``Conv1D``) and embeddings it was computed from (a ``TorchFunctionMode``). Each projection's
   input tags say which projections feed it. The model's modules are put back as they were
   after it (tensors, plain attributes, children).
2. **Pairs.** A projection ``E`` whose input is computed from the outputs of projections
   ``S`` only, each of which feeds nothing but ``E``, is a column -> row pair: ``S``
   column-parallel, ``E`` row-parallel (q, k, v -> o of attention; gate, up -> down of an MLP;
   a fused ``query_key_value`` -> ``dense``; cross-attention's k and v read from the encoder).
3. **Units.** Autograd says which output features of ``S`` each input column of ``E`` depends
   on. Columns that share features form units: a single column (elementwise: an MLP) or an
   attention head (its query, and the key and value heads it reads). Each rank takes the
   columns of ``E`` of the contiguous split and, of every ``S``, exactly the rows its columns
   depend on: a fused projection in any layout (``[q | k | v]``, per-head ``[q k v]``,
   Falcon's groups, GPT BigCode's multi-query) is split correctly without being recognised,
   and KV heads read by several ranks are held by each of them (their gradients summed).
   A pair whose every unit needs all features of a projection (a norm over all heads before
   the output projection) is left whole, unless that norm computes Llama's RMS norm over the
   row-parallel projection's whole input (BitNet's sub-norms): the model is then traced again
   with the norm's statistic cut from the gradient, and the norm is split with the columns,
   each rank's sums of squares added over the group (:class:`UnitNorm`).
4. **The attention module** (the smallest module holding a pair split in heads) is told its
   local head counts: its integer attributes equal to the query heads, the KV heads or their
   widths are set to this rank's; a tensor input with a dimension of one entry per head
   (Bloom's and MPT's ALiBi biases) is cut to this rank's heads.
5. **Kept whole**: everything else (norms, position embeddings, routers) stays whole on every
   rank, as ``Replicate()`` ``DTensor`` s; a module with parameters between a pair's
   projections (a per-head norm of the queries) has its gradient summed over the ranks.
   The input embedding is split over the vocabulary and the LM head over its outputs; a
   bias the head shares with a module above it (BERT's ``cls.predictions.bias``) is split
   with it and tied again.
6. **Mamba mixers and experts** (a chain of projections, not a pair) take their own styles:
   Mamba-2's split by heads, Mamba-1's by channels (:mod:`tpx.parallel.ssm`), JetMoE's MoE
   MLP and mixture of attention by features and heads (:mod:`tpx.parallel.scatter_moe`);
   pairs inside them are not split again. Fused experts a model's ``base_model_ep_plan``
   names (ZAYA's, which ships no TP plan) are split as a completed plan splits them. A chain
   ``a -> b -> c`` of projections is split once, as the pair ``a -> b``.
7. **What the TP size cannot split** (attention with fewer heads than ranks) stays whole on
   every rank, with a warning (``ModelPlan.fit_to``).

The result is a :class:`DerivedPlan`. It is **proved before use**: ``tpx.parallelize_module``
first applies it to a copy of the model and runs that copy beside the unsharded model on the
example batch, forward and backward (``tpx.plans.check``). If the copy fails, or any
module's output, any gradient or any replica differs, the entries that hold the module it
points at (the whole pair, or the mixer, at every layer of its pattern) are left whole, with a
warning naming them, and the rest is proved again (at most :data:`MAX_ROUNDS` times); where
no entry can be blamed it raises ``ValueError`` naming the first module that differs and
leaves the model untouched. Cost: two extra copies of the model in memory and one forward and
backward of each on the tiny batch, on every rank, per round.
"""

from __future__ import annotations

import copy
import fnmatch
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..comm import collectives
from .base import ModelPlan, ParallelStyle, TPContext
from .generate import with_generate
from .hf_styles import VocabParallelEmbeddingStyle, own_embedding_forward
from .module_styles import ReplicatedWithGradAllReduce, ShardedAttention
from .sequence import Chain
from .style import ColwiseParallel, Replicate, Shard
from .example import example_inputs
from .trace import Pair, analyse, is_projection, norms_between, pairs, trace
from .unit_styles import HeadInputs, UnitColwise, UnitNorm, UnitRowwise, local_counts

__all__ = ["derive", "DerivedPlan"]

Plan = Dict[str, ParallelStyle]
MAX_ROUNDS = 8  # proofs of a derived plan, each leaving whole what the last one blamed


LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a numeric part of a module name


def layer_pattern(name: str) -> str:
    """``name`` with its layer index (the first numeric part) as ``*``: the modules of a
    Sequential inside a layer keep theirs (CTRL's ``ffn.0`` and ``ffn.2`` differ)."""
    return LAYER_INDEX.sub("*", name, count=1)


class DerivedPlan(ModelPlan):
    """A plan :func:`derive` found in the model (module names to styles, as any plan), to be
    proved before it is used: ``tpx.parallelize_module(model, group, plan)`` first runs it on
    a copy of the model beside the unsharded one (:meth:`prove_before_use`) and raises before changing
    anything if they differ. ``kept_whole``: the column -> row pairs left whole, and why."""

    def __init__(self, plan: Plan, *, model_name: str, example: Dict[str, Tensor],
                 proof_plan: Plan, kept_whole: Dict[str, str],
                 members: Optional[Dict[str, Pair]] = None) -> None:
        super().__init__(plan)
        self.model_name, self.example = model_name, example
        self.proof_plan, self.kept_whole = proof_plan, kept_whole
        self.members = dict(members or {})  # entry -> the pair it splits
        self.report = None
        self.failed_at: Optional[str] = None  # the module a failed proof names
        self.suspects: List[str] = []  # the modules it points at, the most telling first
        self.failed_in_forward = False  # the last proof raised (else: its report differs)
        self.dropped: Dict[str, str] = {}  # entries a failed proof left whole, and why

    def unsplittable_entries(self, world: int) -> Dict[str, str]:
        """:meth:`ModelPlan.unsplittable_entries`, and every entry of a pair that cannot be
        split over ``world`` ranks (:func:`unsplittable`: its attention module's, its
        projections', those in between)."""
        out = super().unsplittable_entries(world)
        for key, pair in self.members.items():
            why = unsplittable(pair, world)
            if why is not None:
                out[key] = why
        return out

    def fit_to(self, model: nn.Module, world: int) -> Dict[str, str]:
        """:meth:`ModelPlan.fit_to`, on the plan that is proved too."""
        shown = super().fit_to(model, world)
        for key in getattr(self, "unsplit", ()):
            self.proof_plan.pop(key, None)
            self.members.pop(key, None)
        return shown

    def _shown(self, dropped: Dict[str, str]) -> Dict[str, str]:
        # of an elementwise pair, its row-parallel projection
        return {k: why for k, why in super()._shown(dropped).items()
                if k not in self.members or self.members[k].heads
                or isinstance(self.get(k), UnitRowwise)}

    def prove_before_use(self, model: nn.Module, target, src_rank: Optional[int]) -> None:
        """Proves the plan (:meth:`prove_once`). Entries that make the copy fail or differ
        are left whole, with a warning naming them, and the rest proved again: the pair
        (or mixer, embedding, head) whose entry holds the module the proof names, at every
        layer of its pattern. ``ValueError`` where no entry is left to blame. The plan is
        updated in place; :attr:`dropped` says what was left whole and why."""
        for _ in range(MAX_ROUNDS):
            try:
                self.prove_once(model, target, src_rank)
                return
            except ValueError as e:
                keys = self.blamed(self.suspects)
                if not keys:
                    raise
                if self.failed_in_forward:
                    # every rank failed here (a plan's sizes are the same on each), or the
                    # ranks diverge: one collective before the next round says which (a rank
                    # still inside the proof meets it with another and both raise)
                    pg = TPContext.of(target, src_rank).group
                    collectives.all_reduce(torch.ones(1, dtype=torch.float64), pg)
                self.leave_whole(keys, str(e).split("\n")[0])
        self.prove_once(model, target, src_rank)

    def blamed(self, modules: List[str]) -> List[str]:
        """The entries that hold the first of ``modules`` that any entry holds (the entry
        of the module itself or of one above it; else those under it, or under the modules
        above it, nearest first), with the other entries of their pairs, at every layer."""
        keys: List[str] = []
        for m in modules:
            keys = [k for k in self if k and (m == k or m.startswith(k + "."))]
            up = m
            while not keys and "." in up:  # not up to the base model: that holds them all
                keys = [k for k in self if k.startswith(up + ".")]
                up = up.rpartition(".")[0]
            if keys:
                break
        pairs_of = {id(self.members[k]) for k in keys if k in self.members}
        keys += [k for k, p in self.members.items() if id(p) in pairs_of]
        patterns = {layer_pattern(k) for k in keys}
        return [k for k in self if layer_pattern(k) in patterns]

    def leave_whole(self, keys: List[str], reason: str) -> None:
        """Removes the entries ``keys`` (their modules stay whole on every rank), with a
        warning naming them and ``reason``."""
        for k in keys:
            self.forget(k, reason)
        shown = sorted({layer_pattern(k) for k in keys})
        warnings.warn(
            f"tpx.plans.auto: the entries of the plan tpx derived for {self.model_name} at "
            f"{', '.join(shown[:6])}{' and more' if len(shown) > 6 else ''} make a copy of the "
            f"model fail or differ from the unsharded one, so those modules stay whole on "
            f"every rank ({reason})", UserWarning, stacklevel=5)

    def forget(self, key: str, why: str, shown_as: Optional[str] = None) -> None:
        """Removes the entry ``key`` (its module stays whole), recording ``why`` in
        :attr:`dropped` and in :attr:`kept_whole` (under ``shown_as``, else ``key``)."""
        self.pop(key, None)
        self.proof_plan.pop(key, None)
        self.members.pop(key, None)
        self.dropped[key] = self.kept_whole[shown_as or key] = why

    def prove_once(self, model: nn.Module, target, src_rank: Optional[int]) -> None:
        """Applies the plan to a copy of ``model`` and compares it with the unsharded model
        on the traced batch (collective over ``target``); ``ValueError`` if they differ,
        with :attr:`suspects` the modules it points at."""
        from ..layout.initial import broadcast_
        from .check import check

        pg = TPContext.of(target, src_rank).group
        self.fit_to(model, pg.size())
        device = next(model.parameters()).device
        example = {k: v.to(device) if isinstance(v, Tensor) else v
                   for k, v in self.example.items()}
        args, kwargs = (((example["input_ids"],), {})
                        if getattr(model, "config", None) is None and list(example) == ["input_ids"]
                        else ((), example))
        # In float64 first: a gradient that is zero in exact arithmetic (a key bias, which
        # softmax does not see) is rounding noise, different in any two orders of summation,
        # and float64 keeps that noise below what the comparison resolves. A model that does
        # not run in float64 is proved in its own dtype.
        for dtype in (torch.float64, None):
            trial = copy.deepcopy(model)
            if src_rank is not None and pg.size() > 1:
                broadcast_(pg, src_rank, [t.data for t in trial.parameters()]
                           + [t for t in trial.buffers()])
            trial.eval()
            if dtype is not None:
                trial.to(dtype)
                kwargs = {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point()
                          else v for k, v in kwargs.items()}  # (encoder states)
            failing: List[str] = []  # the innermost module a failing forward was in
            for name, mod in trial.named_modules():
                mod.register_forward_hook(_note_failure(name, failing), always_call=True)
            try:
                with warnings.catch_warnings():  # said once, when the plan is applied
                    warnings.filterwarnings("ignore", message=r"tpx\.parallelize_module: .* "
                                            r"plain tensors")
                    report = check(trial, target, dict(self.proof_plan), *args, rtol=1e-3,
                                   **kwargs)
                break
            except Exception as e:  # the same on every rank: the plan fails before it computes
                if dtype is not None and isinstance(e, RuntimeError):
                    continue
                where = f" in {failing[0]!r}" if failing else ""
                self.failed_at = failing[0] if failing else ""
                self.suspects = failing[:1]
                self.failed_in_forward = True
                raise ValueError(
                    f"tpx.plans.auto: the plan tpx derived for {self.model_name} fails on a copy "
                    f"of the model at TP {pg.size()}{where}: {type(e).__name__}: {e}. Nothing "
                    "was changed; write the plan for that module by hand, or use a TP size the "
                    "error allows") from e
            finally:
                del trial
        self.report = report
        self.failed_in_forward = False
        if not report.ok:
            self.failed_at = (report.first_divergent_module[0]
                              if report.first_divergent_module else "")
            self.suspects = report.suspects()
            where = (f"the first module whose output differs is "
                     f"{report.first_divergent_module[0]!r}"
                     if report.first_divergent_module else
                     "the gradients differ: " + ", ".join(n for n, _ in report.grad_errors[:4])
                     if report.grad_errors else "the replicas differ")
            raise ValueError(
                f"tpx.plans.auto: the plan tpx derived for {self.model_name} does not compute "
                f"what the unsharded model computes at TP {pg.size()} ({where}); nothing was "
                "changed. Write the plan for that module by hand (a dict of module names to "
                "styles), or leave it whole by removing its entries from the plan.\n"
                + str(report))


def _note_failure(name: str, failing: List[str]):
    """A forward hook called even when the forward raises (then with no output): the first
    module it reports that way is the innermost one the error came from."""
    def hook(mod, args, out):
        if out is None and not failing:
            failing.append(name)
    return hook


def _shared_elsewhere(model: nn.Module, head: str, emb) -> bool:
    """Whether a parameter of ``head`` is also a parameter of a module outside it other than
    the input embedding's table and the modules above ``head`` (BERT's LM head bias,
    ``cls.predictions.bias``, is ``cls.predictions.decoder.bias``: tied again when the head is
    split)."""
    mine = {id(p) for p in model.get_submodule(head).parameters()}
    table = id(emb.weight) if isinstance(emb, nn.Embedding) else None
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        above = owner == "" or head.startswith(owner + ".")
        if id(p) in mine and id(p) != table and not name.startswith(head + ".") and not above:
            return True
    return False


def _pair_entries(model: nn.Module, tr) -> Tuple[Plan, Dict[str, str], Dict[str, Pair]]:
    """The entries of the traced column -> row pairs (steps 2 to 4 of the module docstring),
    the pairs left whole and why, and each entry's pair (the attention module's, the
    projections', and those of the modules in between)."""
    from .scatter_moe import scatter_moe_style
    from .mixers import mixer_style

    plan: Plan = {}
    kept: Dict[str, str] = {}
    why: Dict[str, str] = {}
    members: Dict[str, Pair] = {}
    # Mamba mixers (a chain of projections, no column -> row pair) and ScatterMoE's experts
    # (JetMoE's MLP and mixture of attention): split by their styles
    mixers = []
    for name, mod in model.named_modules():
        style = (mixer_style(mod) or scatter_moe_style(mod)) if name and not any(
            name.startswith(m + ".") for m in mixers) else None
        if style is not None:
            plan[name] = style
            mixers.append(name)
    for sources, sink in pairs(tr):
        if any(n.startswith(m + ".") for n in sources + [sink] for m in mixers):
            continue
        taken = [n for n in sources + [sink] if n in members]
        if taken:  # a chain (a -> b -> c): b is the sink of the first pair, not a source
            first = members[taken[0]]
            role = ("the row-parallel end of a pair" if first.sink == taken[0]
                    else f"a source of the pair ending at {first.sink}")
            why[sink] = f"{taken[0]} is already {role}"
            continue
        odd = [n for n in sources + [sink] if not tr.linear_like.get(n, True)]
        if odd:
            why[sink] = f"{odd[0]} subclasses nn.Linear with a forward that is not F.linear"
            continue
        pair = analyse(model, tr, sources, sink, why)
        if pair is None:
            continue
        if pair.heads:  # the attention module first: its head-count check is the error seen
            owner = pair.owner
            if owner in plan:  # two pairs under one module (self- and cross-attention)
                kept[sink] = f"a second attention under {owner!r}"
                continue
            plan[owner] = _attention_style(pair)
            members[owner] = pair
        for s in sources:
            plan[s] = UnitColwise(pair, s)
        plan[sink] = UnitRowwise(pair)
        for r in pair.region:
            plan[r] = (UnitNorm(pair, tr.detached[r]) if r in tr.detached
                       else ReplicatedWithGradAllReduce())
        members.update({n: pair for n in sources + [sink] + list(pair.region)})
    kept.update(why)
    return plan, kept, members


def _ep_experts(model: nn.Module, plan: Plan) -> Plan:
    """Fused experts the model's ``base_model_ep_plan`` names (ZAYA ships that plan and no TP
    plan): split as a completed plan splits them (expert TP, each rank a slice of every
    expert's intermediate features), one entry per experts module."""
    from .complete import ep_experts
    from .hf_plan import translate_entries

    out: Plan = {}
    names = [n for n, _ in model.named_modules() if n]
    for pat, entries in ep_experts(model, list(plan)):
        styles = translate_entries(model, entries, sequence_parallel=False, loss_parallel=False,
                                   experts="tp")
        for n in names:
            if fnmatch.fnmatchcase(n, pat) and n.count(".") == pat.count("."):
                out[n] = styles[pat]
    return out


def _vocabulary_tables(model: nn.Module, plan: Plan, emb, whole_table: bool) -> Plan:
    """Tables beside the input embedding with as many rows as a vocabulary of the config
    (Gemma 3n's per-layer embeddings), looked up as an embedding is (a plain or scaled
    forward): vocabulary-parallel, as the input embedding (proved with the plan)."""
    from .hf_styles import text_config

    cfg = text_config(model) if getattr(model, "config", None) is not None else None
    vocabularies = {getattr(cfg, k, None) for k in ("vocab_size", "vocab_size_per_layer_input")
                    } - {None}
    out: Plan = {}
    for name, mod in model.named_modules():
        if (isinstance(mod, nn.Embedding) and name and name not in plan and mod is not emb
                and mod.num_embeddings in vocabularies and not own_embedding_forward(mod)
                and not (whole_table and isinstance(emb, nn.Embedding)
                         and mod.weight is emb.weight)):
            out[name] = VocabParallelEmbeddingStyle()
    return out


def _attention_style(pair: Pair) -> ParallelStyle:
    """The attention module of a pair split in heads: told this rank's head counts."""
    owner, sink = pair.owner, pair.sink
    style = ShardedAttention(pair.heads, pair.kv_heads,
                             update=local_counts(pair.heads, pair.kv_heads, pair.width,
                                                 [n[len(owner) + 1:] if owner else n
                                                  for n in pair.sources + [pair.sink]],
                                                 sink=pair.sink),
                             out_proj=sink[len(owner) + 1:] if owner else sink,
                             uneven=True)
    if pair.head_inputs:
        style = Chain(style, HeadInputs(pair.heads, pair.head_inputs, pair.kv_heads))
    return style


def unsplittable(pair: Pair, world: int) -> Optional[str]:
    """Why ``pair`` cannot be split over ``world`` ranks (fewer attention heads than ranks, a
    query head for every rank that holds a KV head, units that a TP size does not divide),
    or ``None`` where it can."""
    try:
        for s in pair.sources:
            pair.rank_rows(s, world)
    except ValueError as e:
        return str(e).removeprefix("tpx.plans.derive: ")
    return None


def derive(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False,
           example: Optional[Dict[str, Tensor]] = None) -> DerivedPlan:
    """A plan for ``model`` found from its computation (module docstring), proved when it is
    applied. ``example``: keyword inputs for the traced forward (default: token ids, see
    :func:`example_inputs`; the same on every rank)."""
    if sequence_parallel:
        raise NotImplementedError(
            "tpx.plans.auto: sequence_parallel=True is not supported for a derived plan yet; "
            "use sequence_parallel=False, or write the plan by hand")
    name = (f"Hugging Face model_type={model.config.model_type!r} ({type(model).__name__})"
            if getattr(getattr(model, "config", None), "model_type", None)
            else type(model).__name__)
    if any(type(m).__module__.startswith("tpx") for m in model.modules()):
        raise ValueError(f"tpx.plans.derive: {name} is already sharded by tpx; derive the plan "
                         "from the unsharded model")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(
            f"tpx.plans.auto: {name} ships no TP plan, and deriving one runs the model on a "
            "tiny batch, which a model on the meta device cannot (tpx.from_pretrained builds "
            "there). Load the model with its weights first (transformers' from_pretrained), "
            "then tpx.parallelize_module(model, None, tpx.plans.auto(model)); or write the "
            "plan by hand and pass it as plan=")
    example = dict(example) if example is not None else example_inputs(model)
    tr = trace(model, example)
    norms = norms_between(model, tr)
    if norms:  # traced again with their statistic cut: each feature depends on its own
        tr = trace(model, example, detach=norms)
    plan, kept, members = _pair_entries(model, tr)
    plan.update(_ep_experts(model, plan))
    emb = model.get_input_embeddings() if callable(
        getattr(model, "get_input_embeddings", None)) else None
    modules = {m: n for n, m in model.named_modules()}
    if emb is None:  # a plain module: the first embedding the trace called
        emb = next((model.get_submodule(n) for n in tr.module_inputs
                    if isinstance(model.get_submodule(n), nn.Embedding)), None)
    from .hf_plan import reads_table_rows

    head_mod = model.get_output_embeddings() if callable(
        getattr(model, "get_output_embeddings", None)) else None
    head = modules.get(head_mod) if is_projection(head_mod) else None
    if head is None:  # a plain module: the projection that makes the output
        outs = [t for t in tr.out_tags if t in tr.outputs]
        if len(outs) == 1 and isinstance(emb, nn.Embedding) and (
                tr.outputs[outs[0]].shape[-1] == emb.num_embeddings):
            head = outs[0]
    tied = (head is not None and isinstance(emb, nn.Embedding)
            and model.get_submodule(head).weight is emb.weight)
    whole_table = isinstance(emb, nn.Embedding) and reads_table_rows(model)
    if not whole_table and own_embedding_forward(emb):
        whole_table = True  # a forward of its own (Inkling's normed embedding) stays whole
        kept[modules.get(emb, "input embedding")] = "an nn.Embedding with a forward of its own"
        if tied:
            kept[head] = "tied to the input embedding, which stays whole"
            head = None
    elif whole_table:
        kept[modules.get(emb, "input embedding")] = ("the model's forward reads rows of its "
                                                     "table itself")
        if tied:
            kept[head] = "tied to the input embedding, which stays whole"
            head = None
    if head is not None and _shared_elsewhere(model, head, emb):
        kept[head] = "a parameter of it is also held by another module (a tied bias)"
        if tied:
            whole_table = True
            kept[modules.get(emb, "input embedding")] = "tied to the LM head, which stays whole"
        head = None
    if isinstance(emb, nn.Embedding) and emb in modules and modules[emb] not in plan \
            and not whole_table:
        # with every embedding that shares its table (BART's encoder and decoder read
        # ``model.shared``'s weight through modules of their own)
        for m, n in modules.items():
            if isinstance(m, nn.Embedding) and m.weight is emb.weight and n not in plan:
                plan[n] = VocabParallelEmbeddingStyle()
    plan.update(_vocabulary_tables(model, plan, emb, whole_table))
    if head is not None and head not in plan:
        plan[head] = ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())
    elif loss_parallel:
        raise ValueError(f"tpx.plans.auto: loss_parallel=True needs a model with an LM head "
                         f"({name})")
    proof = dict(plan)
    if head is not None and head in proof:
        proof[head] = ColwiseParallel(output_layouts=Replicate())
    plan = with_generate(plan, model, head, loss_parallel)
    return DerivedPlan(plan, model_name=name, example=example, proof_plan=proof, kept_whole=kept,
                       members=members)
