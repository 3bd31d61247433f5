"""Plans derived from the model itself, and proved before they are used.

``tpx.plans.auto`` reads a model's own TP plan where it ships one. For a model without one
(68 of transformers' causal LMs, a plain decoder in names tpx has never seen), or on request
(``tpx.plans.auto(model, derive=True)``), :func:`derive` finds the tensor-parallel structure
from the model's computation, not from its module names:

1. **Trace.** One forward of a tiny batch (2 sequences of 7 tokens, on the model's device, in
   eval mode) with every tensor tagged by the projections (``nn.Linear``, Hugging Face's
   ``Conv1D``) and embeddings it was computed from (a ``TorchFunctionMode``). Each projection's
   input tags say which projections feed it.
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
   the output projection) is left whole.
4. **The attention module** (the smallest module holding a pair split in heads) is told its
   local head counts: its integer attributes equal to the query heads, the KV heads or their
   widths are set to this rank's; a tensor input with a dimension of one entry per head
   (Bloom's and MPT's ALiBi biases) is cut to this rank's heads.
5. **Kept whole**: everything else (norms, position embeddings, routers) stays whole on every
   rank, as ``Replicate()`` ``DTensor`` s; a module with parameters between a pair's
   projections (a per-head norm of the queries) has its gradient summed over the ranks.
   The input embedding is split over the vocabulary and the LM head over its outputs.

The result is a :class:`DerivedPlan`. It is **proved before use**: ``tpx.parallelize_module``
first applies it to a copy of the model and runs that copy beside the unsharded model on the
example batch, forward and backward (``tpx.plans.check``); if any module's output, any
gradient or any replica differs, it raises ``ValueError`` naming the first module that
differs and leaves the model untouched. Cost: two extra copies of the model in memory and one
forward and backward of each on the tiny batch, on every rank, once.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..comm.groups import shard_bounds
from .base import ParallelStyle, TPContext
from .generate import with_generate
from .hf_styles import VocabParallelEmbeddingStyle, text_config
from .module_styles import ReplicatedWithGradAllReduce, ShardedAttention
from .sequence import Chain
from .style import ColwiseParallel, Replicate, RowwiseParallel, Shard, _is_conv1d

__all__ = ["derive", "DerivedPlan"]

Plan = Dict[str, ParallelStyle]

BATCH, SEQ = 2, 7  # the traced batch; odd length, so no size is mistaken for a head count


def _is_projection(module: nn.Module) -> bool:
    """``nn.Linear`` (a subclass too: its traced output is then held against ``F.linear``)
    or Hugging Face's ``Conv1D``."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _own_forward(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward


def _tensors(tree) -> List[Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]


class _Tags(TorchFunctionMode):
    """Tags every tensor a function makes with the union of its inputs' tags."""

    def __init__(self) -> None:
        super().__init__()
        self.tags = WeakIdKeyDictionary()

    def of(self, tree) -> Set[str]:
        out: Set[str] = set()
        for t in _tensors(tree):
            out |= self.tags.get(t, frozenset())
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tags = self.of((args, kwargs))
        if tags:
            name = getattr(func, "__name__", "")
            targets = _tensors(out)
            if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
                targets += _tensors(args[:1])  # in place: the tensor written to
            for t in targets:
                self.tags[t] = frozenset(self.tags.get(t, frozenset()) | tags)
        return out


@dataclass
class _Trace:
    order: List[str] = field(default_factory=list)          # projections, first-call order
    feeds: Dict[str, Set[str]] = field(default_factory=dict)  # projection -> input tags
    inputs: Dict[str, Tensor] = field(default_factory=dict)   # first call's input
    outputs: Dict[str, Tensor] = field(default_factory=dict)  # first call's output (a leaf)
    module_inputs: Dict[str, Set[str]] = field(default_factory=dict)  # any module's input tags
    call_args: Dict[str, list] = field(default_factory=dict)  # module -> [(key, tensor)]
    out_tags: Set[str] = field(default_factory=set)
    linear_like: Dict[str, bool] = field(default_factory=dict)  # subclass -> computes F.linear


def example_inputs(model: nn.Module) -> Dict[str, Tensor]:
    """The traced batch: ``BATCH`` x ``SEQ`` token ids (the same on every rank), as keyword
    arguments a Hugging Face model takes (``decoder_input_ids`` too for an encoder-decoder),
    or ``{"input_ids": ids}`` for a plain module (passed positionally)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(text_config(model), "vocab_size", None) if cfg is not None else None
    if not vocab:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise ValueError(f"tpx.plans.derive: {type(model).__name__} has no nn.Embedding to "
                             "take token ids; pass example_inputs=")
        vocab = emb.num_embeddings
    p = next(model.parameters(), None)
    device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, min(int(vocab), 1000), (BATCH, SEQ), generator=gen).to(device)
    kwargs = {"input_ids": ids}
    if cfg is not None:
        if getattr(cfg, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        params = inspect.signature(model.forward).parameters
        if "use_cache" in params:
            kwargs["use_cache"] = False
    return kwargs


def _call(model: nn.Module, example: Dict[str, Tensor]):
    if getattr(model, "config", None) is None and list(example) == ["input_ids"]:
        return model(example["input_ids"])
    return model(**example)


def _first_tensor(out) -> Optional[Tensor]:
    from .check import _first_tensor as first

    return first(out)


def _trace(model: nn.Module, example: Dict[str, Tensor]) -> _Trace:
    tr = _Trace()
    mode = _Tags()
    hooks = []
    modules = dict(model.named_modules())

    def pre(name, mod):
        def hook(m, args, kwargs):
            tags = mode.of((args, kwargs))
            tr.module_inputs.setdefault(name, set()).update(tags)
            if name not in tr.call_args:
                tr.call_args[name] = [(k, v, mode.of(v)) for k, v in
                                      list(enumerate(args)) + list(kwargs.items())
                                      if isinstance(v, Tensor)]
            if _is_projection(mod):
                tr.feeds.setdefault(name, set()).update(tags)
                if name not in tr.order:
                    tr.order.append(name)
                    tr.inputs[name] = args[0]
        return hook

    def post(name, mod):
        def hook(m, args, out):
            if not isinstance(out, Tensor):
                return None
            if _is_projection(mod):
                if _own_forward(mod) and name not in tr.linear_like:
                    with torch.no_grad():
                        want = nn.functional.linear(args[0], mod.weight, mod.bias)
                    tr.linear_like[name] = (want.shape == out.shape and bool(
                        torch.allclose(want, out, rtol=1e-5, atol=1e-6)))
                leaf = out.detach().requires_grad_()
                tr.outputs.setdefault(name, leaf)
                out = leaf.clone()
            mode.tags[out] = frozenset({name})
            return out
        return hook

    for name, mod in modules.items():
        if not name:
            continue
        hooks.append(mod.register_forward_pre_hook(pre(name, mod), with_kwargs=True))
        if _is_projection(mod) or isinstance(mod, nn.Embedding):
            hooks.append(mod.register_forward_hook(post(name, mod)))
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), mode:
            out = _call(model, example)
        first = _first_tensor(out)
        tr.out_tags = set(mode.tags.get(first, frozenset())) if first is not None else set()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return tr


# ------------------------------------------------------------------ pairs and their units

@dataclass
class _Pair:
    sources: List[str]           # column-parallel projections, in call order
    sink: str                    # the row-parallel projection
    width: int                   # the sink's input features
    units: List[Tuple[int, int]]  # column ranges of the sink's input, in order
    rows: Dict[str, List[List[Tuple[int, int]]]]  # source -> per unit, its row ranges
    heads: Optional[int] = None  # split in attention heads (else elementwise)
    kv_heads: Optional[int] = None
    owner: Optional[str] = None  # the attention module (heads only)
    region: List[str] = field(default_factory=list)  # modules with parameters in between
    head_inputs: List[Tuple[object, int]] = field(default_factory=list)  # (arg key, dim)

    def rank_rows(self, source: str, out_f: int, world: int) -> List[List[Tuple[int, int]]]:
        out = []
        for r in range(world):
            a, b = shard_bounds(self.width, r, world)
            held = [i for i, (s, e) in enumerate(self.units) if s >= a and e <= b]
            if sum(self.units[i][1] - self.units[i][0] for i in held) != b - a:
                unit = self.units[1][1] - self.units[1][0] if len(self.units) > 1 else self.width
                raise ValueError(
                    f"tpx.plans.derive: {self.sink} reads {len(self.units)} units of {unit} "
                    f"features ({'attention heads' if self.heads else 'columns'}); the TP size "
                    f"{world} does not split them whole: use a TP size that divides "
                    f"{len(self.units)}")
            out.append(_merge([rng for i in held for rng in self.rows[source][i]]))
        return out


def _merge(ranges: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, e in sorted(set(ranges)):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _ranges(mask: Tensor) -> List[Tuple[int, int]]:
    idx = mask.nonzero().flatten().tolist()
    out: List[Tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _pairs(tr: _Trace) -> List[Tuple[List[str], str]]:
    projections = set(tr.order)
    consumers: Dict[str, Set[str]] = {p: set() for p in projections}
    for q, tags in tr.feeds.items():
        for t in tags:
            if t in consumers:
                consumers[t].add(q)
    for t in tr.out_tags:
        if t in consumers:
            consumers[t].add("<output>")
    out = []
    for e in tr.order:
        sources = tr.feeds.get(e, set())
        if not sources or not sources <= projections or e in sources:
            continue
        if all(consumers[s] == {e} for s in sources):
            out.append((sorted(sources, key=tr.order.index), e))
    return out


def _block(width: int) -> int:
    b = 1
    while width // b > 1024 and width % (2 * b) == 0:
        b *= 2
    return b


def _depends(tr: _Trace, sources: List[str], sink: str):
    """Per block of the sink's input columns and per source, which of the source's output
    features it depends on (bool [blocks, features])."""
    x = tr.inputs[sink]
    if not x.requires_grad:
        return None, 1
    width = x.shape[-1]
    b = _block(width)
    leaves = [tr.outputs[s] for s in sources]
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype).to(x.device)
    masks = [[] for _ in sources]
    for start in range(0, width, b):
        sel = torch.zeros_like(x)
        sel[..., start:start + b] = weights[..., start:start + b]
        grads = torch.autograd.grad((x * sel).sum(), leaves, retain_graph=True,
                                    allow_unused=True)
        for i, g in enumerate(grads):
            n = leaves[i].shape[-1]
            masks[i].append(torch.zeros(n, dtype=torch.bool) if g is None
                            else (g.detach().reshape(-1, n) != 0).any(0).cpu())
    return [torch.stack(m) for m in masks], b


def _elementwise_filled(mask: Tensor, width: int, b: int) -> Tensor:
    """An elementwise source (the columns of block ``i`` read features ``c + j * width`` of
    their own columns ``c`` only, for the offsets ``j`` seen) with the features the traced
    batch left at a zero gradient (a ReLU negative at every traced position) filled in by
    that pattern."""
    n = mask.shape[1]
    if n % width:
        return mask
    blocks, feats = mask.nonzero(as_tuple=True)
    if not len(blocks) or bool((((feats % width) // b) != blocks).any()):
        return mask
    full = torch.zeros_like(mask)
    for j in sorted(set((feats // width).tolist())):
        for i in range(mask.shape[0]):
            full[i, j * width + i * b: j * width + (i + 1) * b] = True
    return full


def _components(masks: List[Tensor]) -> List[List[int]]:
    n = masks[0].shape[0]
    adj = torch.zeros(n, n, dtype=torch.bool)
    for m in masks:
        f = m.double()
        adj |= (f @ f.T) > 0
    seen, comps = [False] * n, []
    for i in range(n):
        if seen[i]:
            continue
        stack, comp = [i], []
        seen[i] = True
        while stack:
            j = stack.pop()
            comp.append(j)
            for k in adj[j].nonzero().flatten().tolist():
                if not seen[k]:
                    seen[k] = True
                    stack.append(k)
        comps.append(sorted(comp))
    return sorted(comps)


def _head_count(model: nn.Module, owner: nn.Module, width: int, groups: int,
                masks: List[Tensor], b: int) -> Optional[int]:
    """The query heads of an attention module whose input columns fall in ``groups`` groups
    that share features (the KV heads). Candidates: the integers the module and the config
    hold and ``groups``; a candidate ``h`` is a head count if each block of ``width / h``
    columns reads a feature no other column reads (its query); the largest such wins (heads
    of one feature are not considered: every single column reads a value feature of its
    own)."""
    cands = {groups}
    cfg = text_config(model) if getattr(model, "config", None) is not None else None
    values = list(vars(owner).values())
    if cfg is not None:
        values += [getattr(cfg, a, None) for a in ("num_attention_heads", "n_head", "num_heads",
                                                   "decoder_attention_heads",
                                                   "encoder_attention_heads")]
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > groups and width % v == 0 \
                and v % groups == 0 and (width // v) % b == 0 and width // v >= 2:
            cands.add(v)
    reads = torch.cat(masks, 1)
    for h in sorted(cands, reverse=True):
        per = width // h // b
        ok = True
        for i in range(h):
            inside = torch.zeros(reads.shape[0], dtype=torch.bool)
            inside[i * per:(i + 1) * per] = True
            common = reads[inside].all(0)
            outside = reads[~inside].any(0) if bool((~inside).any()) else torch.zeros_like(common)
            if not bool((common & ~outside).any()):
                ok = False
                break
        if ok:
            return h
    return None


def _common_owner(names: Sequence[str]) -> str:
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _analyse(model: nn.Module, tr: _Trace, sources: List[str], sink: str,
             why: Dict[str, str]) -> Optional[_Pair]:
    masks, b = _depends(tr, sources, sink)
    if masks is None:
        why[sink] = "its input does not depend on the projections before it"
        return None
    width = tr.inputs[sink].shape[-1]
    masks = [_elementwise_filled(m, width, b) for m in masks]
    for s, m in zip(sources, masks):
        if not bool(m.any(0).all()):
            why[sink] = f"some output features of {s} reach none of its inputs"
            return None
    comps = _components(masks)
    for c in comps:
        if c != list(range(c[0], c[-1] + 1)):
            why[sink] = "the features its input columns share are not contiguous"
            return None
    pair = _Pair(sources, sink, width, [], {s: [] for s in sources})
    if all(len(c) == 1 for c in comps):  # elementwise (an MLP)
        blocks = [[i] for i in range(len(comps))]
    else:
        owner = _common_owner(sources + [sink])
        heads = _head_count(model, model.get_submodule(owner), width, len(comps), masks, b)
        if heads is None:
            why[sink] = (f"its {width} input columns fall in {len(comps)} groups that share "
                         "features, but in no number of heads tpx could find")
            return None
        if heads == 1:
            why[sink] = ("every input column reads every output feature of the projections "
                         "before it (a statistic over all features between them)")
            return None
        per = width // heads
        if per % b or any((c[0] * b) % per or ((c[-1] + 1) * b) % per for c in comps):
            why[sink] = (f"the columns its inputs share ({len(comps)} groups) do not fall in "
                         f"whole heads of {per} features")
            return None
        blocks = [list(range(h * per // b, (h + 1) * per // b)) for h in range(heads)]
        largest = max(range(len(sources)), key=lambda i: masks[i].shape[1])
        if heads > 1 and any(bool(masks[largest][blk].any(0).all()) for blk in blocks):
            why[sink] = (f"each head reads every output feature of {sources[largest]} "
                         "(a statistic over all heads between the projections)")
            return None
        pair.heads, pair.kv_heads, pair.owner = heads, len(comps), owner
    for blk in blocks:
        pair.units.append((blk[0] * b, (blk[-1] + 1) * b))
        for s, m in zip(sources, masks):
            pair.rows[s].append(_ranges(m[blk].any(0)))
    # Modules with parameters computing on the sources' outputs only (a per-head norm).
    inside = set(sources)
    for name, tags in tr.module_inputs.items():
        mod = model.get_submodule(name)
        if (tags and tags <= inside and not _is_projection(mod)
                and any(True for _ in mod.parameters(recurse=False))):
            pair.region.append(name)
    if pair.heads:  # inputs computed from no projection with one entry per head: ALiBi
        for key, t, tags in tr.call_args.get(pair.owner, []):
            d = next((d for d, n in enumerate(t.shape)
                      if n in (pair.heads, BATCH * pair.heads) and n != SEQ), None)
            if not tags and d is not None and t.is_floating_point():
                pair.head_inputs.append((key, d))
    return pair


# ------------------------------------------------------------------ styles


class _UnitColwise(ColwiseParallel):
    """A source of a derived pair: column-parallel, each rank holding the rows its units of
    the row-parallel projection read."""

    def __init__(self, pair: _Pair, source: str) -> None:
        super().__init__()
        self.pair, self.source = pair, source

    def _plain_split(self) -> bool:
        return False

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module._tpx_plain_equivalent = True  # traced: its forward computes F.linear
        return super().apply(module, ctx)

    def _out_rows(self, out_f: int, world: int):
        return self.pair.rank_rows(self.source, out_f, world)

    def __repr__(self) -> str:
        kind = f"{self.pair.heads} heads" if self.pair.heads else "columns"
        return f"ColwiseParallel(derived: the rows {self.pair.sink}'s {kind} read)"


class _Rowwise(RowwiseParallel):
    """The row-parallel projection of a derived pair (a subclass of ``nn.Linear`` whose
    traced forward computes ``F.linear`` is replaced as a plain one)."""

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        module._tpx_plain_equivalent = True
        return super().apply(module, ctx)


class _HeadInputs(ParallelStyle):
    """Cuts the attention module's tensor inputs that hold one entry per head (ALiBi biases:
    ``[heads, ...]`` or ``[batch * heads, ...]``) to this rank's heads."""

    def __init__(self, heads: int, where: List[Tuple[object, int]]) -> None:
        self.heads, self.where = heads, list(where)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        world, rank = ctx.group.size(), dist.get_rank(ctx.group)
        h = self.heads // world
        lo = rank * h

        def cut(t: Tensor, d: int) -> Tensor:
            n = t.shape[d]
            if n == self.heads:
                return t.narrow(d, lo, h)
            if n % self.heads == 0:
                shape = list(t.shape)
                v = t.reshape(shape[:d] + [n // self.heads, self.heads] + shape[d + 1:])
                v = v.narrow(d + 1, lo, h)
                return v.reshape(shape[:d] + [n // self.heads * h] + shape[d + 1:])
            return t

        def hook(mod, args, kwargs):
            args = list(args)
            for key, d in self.where:
                if isinstance(key, int) and key < len(args) and isinstance(args[key], Tensor):
                    args[key] = cut(args[key], d)
                elif isinstance(key, str) and isinstance(kwargs.get(key), Tensor):
                    kwargs[key] = cut(kwargs[key], d)
            return tuple(args), kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadInputs({self.where})"


_NOT_COUNTS = ("dim", "size", "idx", "layer", "window", "position", "bucket", "rotary", "rope")


def _local_counts(heads: int, kv_heads: int, width: int, projections: List[str]):
    """``update`` for the attention module of a derived pair: the integer attributes equal to
    the heads, the KV heads or their widths, of the module and of the modules under it on the
    way to its projections (BERT's ``attention.self``), take this rank's values."""
    per = width // heads

    def update(module: nn.Module, h: int, kv: int) -> None:
        names = {n for p in projections for n in _path(p)}
        for name, sub in module.named_modules():
            if not name or name in names:
                _set_counts(sub, h, kv)

    def _path(proj: str) -> List[str]:  # the modules above a projection, under the owner
        parts = proj.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    def _set_counts(module: nn.Module, h: int, kv: int) -> None:
        local = {"q": h, "kv": kv, "groups": h // kv}
        widths = {width: h * per, kv_heads * per: kv * per}
        counts = {heads: h, kv_heads: kv}
        for attr, value in list(vars(module).items()):
            if attr.startswith("_") or not isinstance(value, int) or isinstance(value, bool):
                continue
            if attr in ShardedAttention.HEAD_ATTRIBUTES:
                setattr(module, attr, local[ShardedAttention.HEAD_ATTRIBUTES[attr]])
            elif value in widths and value != per:
                setattr(module, attr, widths[value])
            elif value in counts and not any(w in attr for w in _NOT_COUNTS):
                setattr(module, attr, counts[value])
    return update


class DerivedPlan(dict):
    """A plan :func:`derive` found in the model (module names to styles, as any plan), to be
    proved before it is used: ``tpx.parallelize_module(model, group, plan)`` first runs it on
    a copy of the model beside the unsharded one (:meth:`prove`) and raises before changing
    anything if they differ. ``kept_whole``: the column -> row pairs left whole, and why."""

    def __init__(self, plan: Plan, *, model_name: str, example: Dict[str, Tensor],
                 proof_plan: Plan, kept_whole: Dict[str, str]) -> None:
        super().__init__(plan)
        self.model_name, self.example = model_name, example
        self.proof_plan, self.kept_whole = proof_plan, kept_whole
        self.report = None

    def prove(self, model: nn.Module, target, src_rank: Optional[int]) -> None:
        """Applies the plan to a copy of ``model`` and compares it with the unsharded model
        on the traced batch (collective over ``target``); ``ValueError`` if they differ."""
        from ..layout.initial import broadcast_
        from .check import check

        pg = TPContext.of(target, src_rank).group
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
            try:
                report = check(trial, target, dict(self.proof_plan), *args, rtol=1e-3,
                               **kwargs)
                break
            except Exception as e:  # the same on every rank: the plan fails before it computes
                if dtype is not None and isinstance(e, RuntimeError):
                    continue
                raise ValueError(
                    f"tpx.plans.auto: the plan tpx derived for {self.model_name} fails on a copy "
                    f"of the model at TP {pg.size()}: {type(e).__name__}: {e}. Nothing was "
                    "changed; write the plan by hand, or use a TP size the error allows") from e
            finally:
                del trial
        self.report = report
        if not report.ok:
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


def _shared_elsewhere(model: nn.Module, head: str, emb) -> bool:
    """Whether a parameter of ``head`` is also a parameter of a module outside it other than
    the input embedding's table (BERT's LM head bias, ``cls.predictions.bias``)."""
    mine = {id(p) for p in model.get_submodule(head).parameters()}
    table = id(emb.weight) if isinstance(emb, nn.Embedding) else None
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in mine and id(p) != table and not name.startswith(head + "."):
            return True
    return False


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
    example = dict(example) if example is not None else example_inputs(model)
    tr = _trace(model, example)
    plan: Plan = {}
    kept: Dict[str, str] = {}
    why: Dict[str, str] = {}
    for sources, sink in _pairs(tr):
        odd = [n for n in sources + [sink] if not tr.linear_like.get(n, True)]
        if odd:
            why[sink] = f"{odd[0]} subclasses nn.Linear with a forward that is not F.linear"
            continue
        pair = _analyse(model, tr, sources, sink, why)
        if pair is None:
            continue
        for s in sources:
            plan[s] = _UnitColwise(pair, s)
        plan[sink] = _Rowwise()
        for r in pair.region:
            plan[r] = ReplicatedWithGradAllReduce()
        if pair.heads:
            owner = pair.owner
            style = ShardedAttention(pair.heads, pair.kv_heads,
                                     update=_local_counts(pair.heads, pair.kv_heads, pair.width,
                                                          [n[len(owner) + 1:] if owner else n
                                                           for n in pair.sources + [pair.sink]]),
                                     out_proj=sink[len(owner) + 1:] if owner else sink)
            if pair.head_inputs:
                style = Chain(style, _HeadInputs(pair.heads, pair.head_inputs))
            if owner in plan:  # two pairs under one module (self- and cross-attention)
                kept[sink] = f"a second attention under {owner!r}"
                for s in sources:
                    del plan[s]
                del plan[sink]
                continue
            plan[owner] = style
    kept.update(why)
    emb = model.get_input_embeddings() if callable(
        getattr(model, "get_input_embeddings", None)) else None
    modules = {m: n for n, m in model.named_modules()}
    if emb is None:  # a plain module: the first embedding the trace called
        emb = next((model.get_submodule(n) for n in tr.module_inputs
                    if isinstance(model.get_submodule(n), nn.Embedding)), None)
    if isinstance(emb, nn.Embedding) and emb in modules and modules[emb] not in plan:
        # with every embedding that shares its table (BART's encoder and decoder read
        # ``model.shared``'s weight through modules of their own)
        for m, n in modules.items():
            if isinstance(m, nn.Embedding) and m.weight is emb.weight and n not in plan:
                plan[n] = VocabParallelEmbeddingStyle()
    head_mod = model.get_output_embeddings() if callable(
        getattr(model, "get_output_embeddings", None)) else None
    head = modules.get(head_mod) if _is_projection(head_mod) else None
    if head is None:  # a plain module: the projection that makes the output
        outs = [t for t in tr.out_tags if t in tr.outputs]
        if len(outs) == 1 and isinstance(emb, nn.Embedding) and (
                tr.outputs[outs[0]].shape[-1] == emb.num_embeddings):
            head = outs[0]
    if head is not None and _shared_elsewhere(model, head, emb):
        kept[head] = "a parameter of it is also held by another module (a tied bias)"
        head = None
    if head is not None and head not in plan:
        plan[head] = ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate())
    elif loss_parallel:
        raise ValueError(f"tpx.plans.auto: loss_parallel=True needs a model with an LM head "
                         f"({name})")
    proof = dict(plan)
    if head is not None and head in proof:
        proof[head] = ColwiseParallel(output_layouts=Replicate())
    plan = with_generate(plan, model, head, loss_parallel)
    return DerivedPlan(plan, model_name=name, example=example, proof_plan=proof, kept_whole=kept)
