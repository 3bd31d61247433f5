"""What a derived plan is built from (``tpx.parallel.derive``): one forward of a tiny batch
with every tensor tagged by the projections it was computed from, the column -> row pairs
found in it, and, from autograd, the units (columns, heads, KV heads) each pair splits in."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..comm.groups import head_split, shard_bounds
from .check import first_tensor
from .example import BATCH, SEQ
from .hf_styles import text_config
from .style import is_conv1d

__all__ = ["Trace", "Pair", "trace", "pairs", "analyse", "is_projection", "own_forward",
           "rms_norm_eps", "norms_between"]



def is_projection(module: nn.Module) -> bool:
    """``nn.Linear`` (a subclass too: its traced output is then held against ``F.linear``)
    or Hugging Face's ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def own_forward(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward


def _tensors(tree) -> List[Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor)]


# Functions whose result takes only the shape, dtype and device of their first tensor (a mask
# made like the hidden states: GIT's), and those whose values are their first tensor's
SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
                        "new_ones", "new_full", "new_empty", "new_tensor"})
VALUES_OF_SELF = frozenset({"type_as"})


class Tags(TorchFunctionMode):
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
        name = getattr(func, "__name__", "")
        if name in SHAPE_ONLY:  # the first tensor gives a shape and a dtype, no values
            tags = self.of((args[1:], kwargs))
        elif name in VALUES_OF_SELF:
            tags = self.of(args[:1])
        else:
            tags = self.of((args, kwargs))
        if tags:
            targets = _tensors(out)
            if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
                targets += _tensors(args[:1])  # in place: the tensor written to
            for t in targets:
                self.tags[t] = frozenset(self.tags.get(t, frozenset()) | tags)
        return out


@dataclass
class Trace:
    order: List[str] = field(default_factory=list)          # projections, first-call order
    feeds: Dict[str, Set[str]] = field(default_factory=dict)  # projection -> input tags
    inputs: Dict[str, Tensor] = field(default_factory=dict)   # first call's input
    outputs: Dict[str, Tensor] = field(default_factory=dict)  # first call's output (a leaf)
    module_inputs: Dict[str, Set[str]] = field(default_factory=dict)  # any module's input tags
    call_args: Dict[str, list] = field(default_factory=dict)  # module -> [(key, tensor)]
    out_tags: Set[str] = field(default_factory=set)
    linear_like: Dict[str, bool] = field(default_factory=dict)  # subclass -> computes F.linear
    detached: Dict[str, float] = field(default_factory=dict)  # RMS norm -> eps (statistic cut)
    seq: int = SEQ  # the traced sequence length (image tokens before the text included)


def _call(model: nn.Module, example: Dict[str, Tensor]):
    if getattr(model, "config", None) is None and list(example) == ["input_ids"]:
        return model(example["input_ids"])
    return model(**example)


def _rms_norm(x: Tensor, weight: Tensor, eps: float, cut: bool = False) -> Tensor:
    """Llama's RMS norm: in float32, cast back before the weight; ``cut``: the statistic
    computed from ``x`` detached (the same values, no gradient through the mean)."""
    h = x.to(torch.float32)
    var = (h.detach() if cut else h).pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(var + eps)).to(x.dtype)


def rms_norm_eps(module: nn.Module) -> Optional[float]:
    """The epsilon of a module that computes Llama's RMS norm over its last dimension with
    its one 1-D ``weight`` (BitNet's, Llama's and their copies: ``weight * (x * rsqrt(mean(x^2)
    + eps))`` in float32, cast back before the weight), checked on a copy with a random
    weight; ``None`` for any other module (a Gemma-style ``1 + weight``, a LayerNorm)."""
    w = getattr(module, "weight", None)
    eps = next((getattr(module, a) for a in ("variance_epsilon", "eps", "epsilon")
                if isinstance(getattr(module, a, None), float)), None)
    if (eps is None or not isinstance(w, nn.Parameter) or w.dim() != 1 or w.numel() < 2
            or w.device.type == "meta" or len(list(module.parameters())) != 1
            or any(True for _ in module.children())):
        return None
    import copy

    gen = torch.Generator().manual_seed(7)
    probe = copy.deepcopy(module)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(w.shape, generator=gen).to(w.dtype))
        x = torch.randn(3, w.numel(), generator=gen).to(w.device, w.dtype)
        try:
            got = probe(x)
        except Exception:  # noqa: BLE001 - a norm of another signature: not this one
            return None
        want = _rms_norm(x, probe.weight, eps)
    ok = isinstance(got, Tensor) and got.shape == want.shape and bool(
        torch.allclose(got, want, rtol=1e-4, atol=1e-5))
    return eps if ok else None


def norms_between(model: nn.Module, tr: "Trace") -> Dict[str, float]:
    """The RMS norms that compute on a traced pair's sources only and normalise the sink's
    whole input (BitNet's ``ffn_sub_norm`` between ``[gate | up]`` and ``down_proj``, its
    ``attn_sub_norm`` before ``o_proj``): name -> epsilon. Their statistic, over every
    feature, is what makes every column depend on all of them; split, each rank sums its
    features' squares and the sums are added over the ranks."""
    out: Dict[str, float] = {}
    for sources, sink in pairs(tr):
        width = tr.inputs[sink].shape[-1]
        for name, tags in tr.module_inputs.items():
            mod = model.get_submodule(name)
            w = getattr(mod, "weight", None)
            if (tags and tags <= set(sources) and not is_projection(mod)
                    and isinstance(w, Tensor) and w.dim() == 1 and w.numel() == width):
                eps = rms_norm_eps(mod)
                if eps is not None:
                    out[name] = eps
    return out


def trace(model: nn.Module, example: Dict[str, Tensor],
          detach: Optional[Dict[str, float]] = None) -> Trace:
    """The traced forward (module docstring). ``detach``: RMS norms (name -> epsilon) whose
    statistic is cut from the gradient, so that autograd sees each feature depend on its own
    (:func:`norms_between`)."""
    tr = Trace()
    tr.detached = dict(detach or {})
    ids = example.get("input_ids")
    tr.seq = ids.shape[-1] if isinstance(ids, Tensor) else SEQ
    mode = Tags()
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
            if is_projection(mod):
                tr.feeds.setdefault(name, set()).update(tags)
                if name not in tr.order:
                    tr.order.append(name)
                    tr.inputs[name] = args[0]
        return hook

    def post(name, mod):
        def hook(m, args, out):
            if not isinstance(out, Tensor):
                return None
            if name in tr.detached:
                return _rms_norm(args[0], mod.weight, tr.detached[name], cut=True)
            if name in constant_tables:
                return None  # untagged: a constant, like a rotary table
            if is_projection(mod):
                if own_forward(mod) and name not in tr.linear_like:
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

    # Frozen tables in a model that trains (RoFormer's sinusoidal positions, read by every
    # attention): constants, not embeddings (a model frozen whole, under peft, keeps them)
    constant_tables = {n for n, m in modules.items() if isinstance(m, nn.Embedding)
                       and not m.weight.requires_grad} if any(
        p.requires_grad for p in model.parameters()) else set()
    for name, mod in modules.items():
        if not name:
            continue
        hooks.append(mod.register_forward_pre_hook(pre(name, mod), with_kwargs=True))
        if is_projection(mod) or isinstance(mod, nn.Embedding) or name in tr.detached:
            hooks.append(mod.register_forward_hook(post(name, mod)))
    was_training = model.training
    saved = _state(model)
    model.eval()
    try:
        with torch.enable_grad(), mode:
            out = _call(model, example)
        first = first_tensor(out)
        tr.out_tags = set(mode.tags.get(first, frozenset())) if first is not None else set()
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
        _restore(model, saved)
    return tr


def _state(model: nn.Module) -> list:
    """Each module's tensor and plain attributes (numbers, strings, ``None``), its buffers
    and its children, to put back after the traced forward: a model that keeps state between
    calls (RecurrentGemma's recurrent states) must not keep the traced batch's, nor one that
    changes itself by the input's length (BigBird, given fewer tokens than its block-sparse
    attention needs, turns to full attention, built again from its config, for good)."""
    return [(m, {k: v for k, v in vars(m).items() if _kept_attribute(v)},
             dict(m._buffers), dict(m._modules)) for m in model.modules()]


_PLAIN = (int, float, str, bool, type(None))


def _kept_attribute(value) -> bool:
    return isinstance(value, Tensor) or type(value) in _PLAIN


def _restore(model: nn.Module, saved: list) -> None:
    for m, attrs, buffers, children in saved:
        for k in [k for k, v in vars(m).items() if _kept_attribute(v) and k not in attrs]:
            delattr(m, k)
        for k, v in attrs.items():
            m.__dict__[k] = v
        m._buffers.clear()
        m._buffers.update(buffers)
        m._modules.clear()
        m._modules.update(children)


# ------------------------------------------------------------------ pairs and their units

@dataclass
class Pair:
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

    def head_split(self, world: int):
        """Per rank, ``(first, end)`` of the units (query heads) it holds, for a pair split in
        attention heads: dealt as :func:`tpx.comm.groups.head_split` deals them (the even
        split where they divide; blocks that differ by one head where not), each rank's
        query heads with the KV heads they read, as the attention module's counts
        (``ShardedAttention(uneven=True)``). ``None`` for an elementwise pair."""
        if not self.heads or len(self.units) != self.heads:
            return None
        try:
            return [q for q, _ in head_split(self.heads, self.kv_heads or self.heads, world)]
        except ValueError as e:
            raise ValueError(f"tpx.plans.derive: {self.sink} reads {self.heads} attention "
                             f"heads: {e}") from None

    def sink_cols(self, world: int) -> Optional[List[Tuple[int, int]]]:
        """Per rank, the sink's input columns it holds; ``None``: ``shard_range``'s."""
        split = self.head_split(world)
        if split is None:
            return None
        return [(self.units[s][0], self.units[e - 1][1]) for s, e in split]

    def rank_rows(self, source: str, world: int) -> List[List[Tuple[int, int]]]:
        split = self.head_split(world)
        if split is not None:
            return [_merge([rng for i in range(s, e) for rng in self.rows[source][i]])
                    for s, e in split]
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


def pairs(tr: Trace) -> List[Tuple[List[str], str]]:
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


def _depends(tr: Trace, sources: List[str], sink: str):
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
    masks: List[List[Tensor]] = [[] for _ in sources]
    starts = list(range(0, width, b))
    chunk = max(1, min(len(starts), (1 << 24) // max(1, x.numel())))  # probes per backward
    batched = True
    for first in range(0, len(starts), chunk):
        group = starts[first:first + chunk]
        sel = torch.zeros((len(group),) + tuple(x.shape), dtype=x.dtype, device=x.device)
        for i, start in enumerate(group):
            sel[i, ..., start:start + b] = weights[..., start:start + b]
        grads = None
        if batched:  # every probe of the chunk in one vectorised backward
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # vmap's fallback for an op, still right
                    grads = torch.autograd.grad(x, leaves, grad_outputs=sel, retain_graph=True,
                                                allow_unused=True, is_grads_batched=True)
            except Exception:  # noqa: BLE001 - an op vmap cannot batch: one probe at a time
                batched = False
        if grads is None:
            per = [torch.autograd.grad(x, leaves, grad_outputs=sel[i], retain_graph=True,
                                       allow_unused=True) for i in range(len(group))]
            grads = [None if per[0][j] is None else torch.stack([p[j] for p in per])
                     for j in range(len(leaves))]
        for i, g in enumerate(grads):
            n = leaves[i].shape[-1]
            if g is None:
                masks[i] += [torch.zeros(n, dtype=torch.bool)] * len(group)
            else:
                got = (g.detach().reshape(len(group), -1, n) != 0).any(1).cpu()
                masks[i] += list(got)
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
        for a in ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads",
                  "encoder_attention_heads"):
            try:
                values.append(getattr(cfg, a, None))
            except Exception:  # noqa: BLE001 - a per-layer value the config will not give whole
                continue
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


def analyse(model: nn.Module, tr: Trace, sources: List[str], sink: str,
             why: Dict[str, str]) -> Optional[Pair]:
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
    pair = Pair(sources, sink, width, [], {s: [] for s in sources})
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
        if (tags and tags <= inside and not is_projection(mod)
                and any(True for _ in mod.parameters(recurse=False))):
            pair.region.append(name)
    if pair.heads:  # inputs computed from no projection with one entry per head: ALiBi
        per = pair.width // pair.heads  # (a rotary table's last dimension is a head's width)
        for key, t, tags in tr.call_args.get(pair.owner, []):
            d = next((d for d, n in enumerate(t.shape)
                      if n in (pair.heads, BATCH * pair.heads) and n != tr.seq
                      and not (d == t.dim() - 1 and n == per)), None)
            if not tags and d is not None and t.is_floating_point():
                pair.head_inputs.append((key, d))
    return pair
