"""A derived plan for a model on the meta device, found and proved on its twins.

:func:`tpx.parallel.derive.derive` traces the model's computation, which a model without
values (as ``tpx.from_pretrained`` builds it, at any size) cannot run. :func:`derive_on_twins`
derives instead on two twins of the model (:mod:`tpx.parallel.twin`: its class at small
sizes, the heads and KV heads kept), the second with every width doubled, and carries the
plan to the model:

1. **The same structure.** Both twins give the same pairs, attention modules and kept-whole
   modules, layer for layer, and every layer of a kind the same entries: the plan's keys
   become patterns over the layers (``transformer.h.*.mlp.dense_h_to_4h``), and the model's
   modules under each pattern are of the twin's classes.
2. **Rows that scale.** Each pair's row ranges, read on the first twin, are mapped to the
   second twin's sizes by one rule and must equal what the second twin's trace found:
   attention heads scale with the head width (every boundary times the width's ratio, a
   fused ``[q | k | v]`` or per-head ``[q k v]`` alike), elementwise units keep their place
   in each segment of the sink's width (``[gate | up]``: unit ``i`` reads rows ``i`` and
   ``I + i``). The rule that held between the twins gives the model's rows.
3. **Proved on the twin.** ``tpx.parallelize_module`` proves the first twin's plan against
   the unsharded twin at the group's TP size, as a derived plan is proved on a copy, before
   it changes anything; what that proof leaves whole stays whole on the model, at every
   layer of its pattern; then the model's plan is applied.

The twins are built in float64; a model whose forward does not run in float64 (XGLM fills
its mask from the default dtype) in float32. The second twin's config is built again by its
class, so that the widths it derives from the doubled ones are derived again.

A model this cannot carry (layers of several kinds, rows that do not scale, a twin that does
not build or trace) raises ``ValueError`` naming what differs, before anything is changed.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import inspect
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .base import TPContext
from .derive import LAYER_INDEX, DerivedPlan, derive, layer_pattern
from .module_styles import ShardedAttention
from .sequence import Chain
from .example import example_inputs
from .trace import Pair
from .unit_styles import HeadInputs, UnitColwise, UnitNorm, UnitRowwise, local_counts
from .hf_styles import text_config
from .twin import build, layer_map, twin

__all__ = ["derive_on_twins", "TwinDerivedPlan"]

_WIDTHS = ("hidden_size", "n_embd", "d_model", "intermediate_size", "ffn_dim", "n_inner",
           "head_dim", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "d_ff", "d_kv",
           "emb_dim", "d_inner", "word_embed_proj_dim", "embedding_dim", "lru_width",
           "hidden_size_global")


def _widened(model: nn.Module, base: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The second twin: ``base``'s config with every width doubled, built again by its class
    so that the widths it derives are derived again (Zamba2's Mamba head dim)."""
    cfg = copy.deepcopy(base.config)
    for k in _WIDTHS:
        if isinstance(getattr(type(cfg), k, None), property):
            continue  # derived from the others (Falcon's head_dim)
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            setattr(cfg, k, 2 * v)
    try:
        cfg = _rebuilt(cfg)
    except Exception:  # noqa: BLE001 - a class that cannot rebuild its own fields: as set
        pass
    return build(type(model), cfg, dtype)


def _rebuilt(cfg):
    """``cfg`` built again by its class from the fields it declares, so that what the class
    derives from them is derived again; a field it neither declares nor derives is kept."""
    fields = cfg.to_dict()
    if dataclasses.is_dataclass(type(cfg)):
        declared = {f.name for f in dataclasses.fields(type(cfg))}
    else:
        params = inspect.signature(type(cfg).__init__).parameters
        declared = set(fields) if any(p.kind is p.VAR_KEYWORD for p in params.values()) and \
            len(params) <= 3 else set(params)
    out = type(cfg)(**{k: v for k, v in fields.items() if k in declared})
    missing = object()
    for k, v in fields.items():
        if k not in declared and getattr(out, k, missing) is missing:
            setattr(out, k, v)
    out._attn_implementation = cfg._attn_implementation
    out._experts_implementation = getattr(cfg, "_experts_implementation", "eager")
    return out


def _features(model: nn.Module, name: str, out: bool) -> int:
    mod = model.get_submodule(name)
    if hasattr(mod, "nf"):  # Hugging Face's Conv1D
        return mod.nf if out else mod.weight.shape[0]
    return mod.out_features if out else mod.in_features


def _scale_heads(p: Pair, model_a: nn.Module, model_x: nn.Module, names: Dict[str, str]):
    """``p`` (a heads pair of twin A) at ``model_x``'s sizes: every boundary times the ratio
    of the projection's width; ``None`` where a boundary does not scale to a whole row."""
    def ratio(name, out):
        a, x = _features(model_a, name, out), _features(model_x, names[name], out)
        return x, a

    wx, wa = ratio(p.sink, False)
    if (wx * p.units[0][1]) % wa:
        return None
    units = [(s * wx // wa, e * wx // wa) for s, e in p.units]
    rows = {}
    for src in p.sources:
        ox, oa = ratio(src, True)
        per = []
        for unit in p.rows[src]:
            if any((b * ox) % oa for rng in unit for b in rng):
                return None
            per.append([(s * ox // oa, e * ox // oa) for s, e in unit])
        rows[src] = per
    return dataclasses.replace(p, width=wx, units=units, rows=rows)


def _scale_elementwise(p: Pair, model_a: nn.Module, model_x: nn.Module, names: Dict[str, str]):
    """``p`` (an elementwise pair of twin A) at ``model_x``'s sizes: column ``i`` of the sink
    reads row ``k * width + i`` of each segment ``k`` its unit reads on the twin (units of
    any one size); ``None`` where the twin's rows are not of that form."""
    wa, size = p.width, p.units[0][1] - p.units[0][0]
    if p.units != [(j * size, (j + 1) * size) for j in range(wa // size)] or wa % size:
        return None
    wx = _features(model_x, names[p.sink], False)
    segments = {}
    for src in p.rows:
        first = _merged(sorted(p.rows[src][0]))
        ks = sorted(s // wa for s, _ in first)
        if any(s % wa or e - s != size for s, e in first) or any(
                _merged(sorted(p.rows[src][j])) != [(k * wa + j * size, k * wa + (j + 1) * size)
                                                    for k in ks]
                for j in range(wa // size)):
            return None
        segments[src] = ks
    rows = {src: [[(k * wx + i, k * wx + i + 1) for k in ks] for i in range(wx)]
            for src, ks in segments.items()}
    return dataclasses.replace(p, width=wx, units=[(i, i + 1) for i in range(wx)], rows=rows)


def _merged(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _scaled(p: Pair, model_a, model_x, names) -> Optional[Pair]:
    return (_scale_heads if p.heads else _scale_elementwise)(p, model_a, model_x, names)


def _same(p: Pair, q: Pair) -> bool:
    """Whether the pairs give every rank the same rows at TP 2 to 8, and one unit per rank
    (where both split)."""
    if p.width != q.width:
        return False
    compared = 0
    worlds = list(range(2, 9)) + ([len(q.units)] if 8 < len(q.units) <= 512 else [])
    for world in worlds:  # (a prime head count splits only into single heads)
        try:
            mine = {s: p.rank_rows(s, world) for s in p.sources}
            theirs = {s: q.rank_rows(s, world) for s in q.sources}
        except ValueError:
            continue
        if mine != theirs:
            return False
        compared += 1
    return compared > 0


def _identity(model: nn.Module) -> Dict[str, str]:
    return {n: n for n, _ in model.named_modules()}


class TwinDerivedPlan(DerivedPlan):
    """A plan :func:`derive_on_twins` carried from the model's twin (module docstring):
    ``tpx.parallelize_module`` proves the twin's plan on the twin (collective over the
    group), then applies this one."""

    def __init__(self, plan, *, model_name: str, twin_model: nn.Module, twin_plan: DerivedPlan,
                 kept_whole: Dict[str, str], members: Dict[str, Pair]) -> None:
        super().__init__(plan, model_name=model_name, example=twin_plan.example,
                         proof_plan=dict(plan), kept_whole=kept_whole, members=members)
        self.twin_model, self.twin_plan = twin_model, twin_plan

    def fit_to(self, model: nn.Module, world: int) -> Dict[str, str]:
        """:meth:`DerivedPlan.fit_to` on the model and on its twin, which share the pairs'
        head counts (the warning is the model's)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.twin_plan.fit_to(self.twin_model, world)
        return super().fit_to(model, world)

    def prove_before_use(self, model: nn.Module, target, src_rank) -> None:
        """Proves the twin's plan (:meth:`DerivedPlan.prove_before_use`); what it leaves
        whole stays whole on the model, at every layer of its pattern."""
        self.fit_to(model, TPContext.of(target, None).group.size())
        self.twin_plan.prove_before_use(self.twin_model, target, None)
        self.report = self.twin_plan.report
        patterns = {layer_pattern(k): why for k, why in self.twin_plan.dropped.items()}

        def pattern(k: str) -> str:  # a key carried as a pattern is one already
            return k if "*" in k else layer_pattern(k)

        for k in [k for k in self if pattern(k) in patterns]:
            self.forget(k, patterns[pattern(k)], shown_as=pattern(k))


def derive_on_twins(model: nn.Module, *, loss_parallel: bool = False) -> TwinDerivedPlan:
    """The derived plan of the Hugging Face ``model`` (on the meta device, or any size),
    found on its twins and carried to it (module docstring)."""
    name = (f"Hugging Face model_type={model.config.model_type!r} ({type(model).__name__})"
            if getattr(getattr(model, "config", None), "model_type", None)
            else type(model).__name__)

    def refuse(why: str):
        return ValueError(
            f"tpx.plans.auto: {name} ships no TP plan (or one tpx cannot apply as written); "
            "on the meta device tpx derives one on "
            f"small twins of the model and carries it over, which cannot be done here: {why}. "
            "Load the model with its weights first (transformers' from_pretrained), then "
            "tpx.parallelize_module(model, None, tpx.plans.auto(model)); or pass plan= with a "
            "plan of your own")

    # In float64 (the proof's rounding noise stays below what it resolves); a model whose
    # forward does not run in float64 (XGLM fills its mask from the default dtype) in float32
    for dtype in (torch.float64, torch.float32):
        try:
            a = twin(model, dtype)
            b = _widened(model, a, dtype)
            plan_a = derive(a, loss_parallel=loss_parallel, example=example_inputs(a))
            plan_b = derive(b, loss_parallel=loss_parallel, example=example_inputs(b))
            break
        except ValueError:  # derive's own refusal, naming the module
            raise
        except Exception as e:  # noqa: BLE001 - a twin that does not build or trace: said
            if dtype is torch.float64 and isinstance(e, RuntimeError):
                continue
            raise refuse(f"its twin fails ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    if [(k, type(v)) for k, v in plan_a.items()] != [(k, type(v)) for k, v in plan_b.items()]:
        raise refuse("its two twins give different plans")
    real_names = {n: type(m) for n, m in model.named_modules()}
    twin_names = {n: type(m) for n, m in a.named_modules()}
    # 1. one entry per pattern, every layer of the twin alike
    by_pattern, named = _layer_entries(plan_a, twin_names, real_names, refuse,
                                       layer_map(model.config))
    # 2. every pair scales from twin A to twin B by the rule, then to the model
    real_plan: Dict[str, object] = {}
    members: Dict[str, Pair] = {}
    scaled: Dict[int, Pair] = {}
    kinds = layer_map(model.config) or _by_layer_types(model, a)
    for pat, keys in by_pattern.items():
        classes = {twin_names.get(k) for k in keys}  # (several: carried by class, named)
        if len({(twin_names.get(k), _signature(plan_a, k)) for k in keys}) > len(classes):
            # the twin's layers of several kinds split differently (Inkling's sliding layers
            # hold 16 KV heads, its full ones 8): each module takes its kind's entry
            if kinds is None:
                raise refuse(f"the twin's layers differ at {pat!r}")
            own = named.get(pat) or [n for n in real_names if layer_pattern(n) == pat]
            _carry_by_kind(own, keys, kinds, plan_a, refuse, real_plan, members,
                           lambda k: _carried(plan_a[k], k, a, b, plan_b, model, scaled,
                                              refuse, kinds), scaled)
            continue
        st = plan_a[keys[0]]
        carried = _carried(st, keys[0], a, b, plan_b, model, scaled, refuse)
        # fnmatch's * also matches dots: a pattern that would name other modules too (BERT's
        # layer.*.output.dense, its attention's attention.output.dense) names its own
        own = named.get(pat) or [n for n in real_names if layer_pattern(n) == pat]
        if pat in named or pat and any(fnmatch.fnmatchcase(n, pat) and layer_pattern(n) != pat
                                         for n in real_names):
            real_plan.update({n: carried for n in own})
        else:
            own = [pat]
            real_plan[pat] = carried
        if keys[0] in plan_a.members:  # the pair at the model's sizes, where carried
            p = plan_a.members[keys[0]]
            members.update({n: scaled.get(id(p), p) for n in own})
    return TwinDerivedPlan(real_plan, model_name=name, twin_model=a, twin_plan=plan_a,
                           kept_whole={layer_pattern(k): v for k, v in plan_a.kept_whole.items()},
                           members=members)


def _layer_index(name: str) -> Optional[int]:
    m = LAYER_INDEX.search(name)
    return int(m.group()) if m else None


def _by_kind(keys: List[str], every: List[str], real: List[str],
             kinds: Optional[List[int]]) -> Optional[List[str]]:
    """The model's modules ``real`` whose twin module of their layer's kind is among
    ``keys`` (``kinds[i]``: the twin's layer of layer ``i``'s kind, :func:`layer_map`);
    ``None`` where the layers under this pattern are not the ones ``kinds`` describes."""
    if kinds is None or not real:
        return None
    twin_layers = {_layer_index(n) for n in every}
    real_layers = {_layer_index(n) for n in real}
    if None in twin_layers or None in real_layers or len(real_layers) != len(real) or \
            not twin_layers <= set(range(max(kinds) + 1)) or max(real_layers) >= len(kinds):
        return None
    # the layers holding this module are those whose kind's twin layer holds it
    if real_layers != {i for i, j in enumerate(kinds) if j in twin_layers}:
        return None
    out = []
    for n in real:
        t = LAYER_INDEX.sub(str(kinds[_layer_index(n)]), n, count=1)
        if t not in every:
            return None
        if t in keys:
            out.append(n)
    return out


def _layer_entries(plan_a, twin_names, real_names, refuse, kinds=None):
    """The twin's plan keys by pattern (:func:`_pattern`), each pattern checked to carry to
    the model, and the patterns whose entries are carried by the model's module names:
    those only some layers have (where the model's layers are the twin's), and those whose
    layers hold modules of several classes there (RecurrentGemma's ``temporal_block``, an
    attention or a recurrent block: the entry goes to the modules of the twin's class)."""
    by_pattern: Dict[str, List[str]] = {}
    for k in plan_a:
        by_pattern.setdefault(layer_pattern(k), []).append(k)
    named: Dict[str, List[str]] = {}
    absent: List[str] = []
    for pat, keys in by_pattern.items():
        if len({type(plan_a[k]) for k in keys}) != 1:
            raise refuse(f"the twin's layers differ at {pat!r}")
        if not pat:
            continue
        want = {twin_names[k] for k in keys if k in twin_names}
        have = {c for n, c in real_names.items() if layer_pattern(n) == pat}
        if not have and "*" in pat:
            # a kind of layer the twin has and the model does not (Inkling: every layer's MLP
            # is a mixture of experts; its twin has a dense one too, for checkpoints with them)
            absent.append(pat)
            continue
        if not have or not want <= have:
            raise refuse(f"the model's modules at {pat!r} are {sorted(c.__name__ for c in have)}"
                         f", the twin's {sorted(c.__name__ for c in want)}")
        every = sorted(n for n, c in twin_names.items() if layer_pattern(n) == pat and c in want)
        if sorted(keys) != every:
            # (Gemma 3n: the MLPs of its first layers keep the activations above a statistic
            # of all features and stay whole; the others split)
            real = sorted(n for n, c in real_names.items() if layer_pattern(n) == pat and c in want)
            named[pat] = list(keys) if real == every else _by_kind(keys, every, real, kinds)
            if named[pat] is None:
                raise refuse(f"{len(keys)} of the twin's {len(every)} modules at {pat!r} are "
                             "split, and the model's layers are not the twin's")
        elif have != want:
            named[pat] = [n for n, c in real_names.items() if layer_pattern(n) == pat and c in want]
    for pat in absent:
        del by_pattern[pat]
    return by_pattern, named


def _real_names(model: nn.Module, twin_names: List[str],
                kinds: Optional[List[int]] = None) -> Dict[str, str]:
    """Twin module name -> the model's module of the same pattern (its first; with
    ``kinds``, :func:`layer_map`, the first in a layer of the twin layer's kind)."""
    first: Dict[str, str] = {}
    for n, _ in model.named_modules():
        first.setdefault(layer_pattern(n), n)
    out = {t: first.get(layer_pattern(t), t) for t in twin_names}
    if kinds is not None:
        for t in twin_names:
            j = _layer_index(t)
            if j is not None and j in kinds:
                out[t] = LAYER_INDEX.sub(str(kinds.index(j)), t, count=1)
    return out


def _by_layer_types(model: nn.Module, a: nn.Module) -> Optional[List[int]]:
    """For each layer of ``model``, the twin's first layer of the same ``layer_types`` entry,
    where the twin's layers are set by type (:data:`tpx.parallel.twin.TYPES`); ``None``
    where either config has no such list or a kind has no twin layer."""
    mine = getattr(text_config(model), "layer_types", None)
    theirs = getattr(text_config(a), "layer_types", None)
    if not isinstance(mine, list) or not isinstance(theirs, list) or \
            not set(mine) <= set(theirs):
        return None
    return [theirs.index(kind) for kind in mine]


def _signature(plan_a, key: str):
    """What the entry ``key`` of twin A splits, without its module names: two layers' entries
    of one pattern with different signatures cannot be carried as one."""
    pair = _pair_of(plan_a[key]) or plan_a.members.get(key)
    if pair is not None:
        rows = tuple(tuple(tuple(map(tuple, unit)) for unit in r) for r in pair.rows.values())
        return (pair.width, tuple(map(tuple, pair.units)), rows, pair.heads, pair.kv_heads)
    st = plan_a[key]
    parts = list(st.styles) if isinstance(st, Chain) else [st]
    return tuple((type(p).__name__, getattr(p, "num_heads", None),
                  getattr(p, "num_kv_heads", None),
                  tuple(getattr(getattr(p, "update", None), "_tpx_counts", (None,) * 3)[:3]))
                 for p in parts)


def _carry_by_kind(own: List[str], keys: List[str], kinds: List[int], plan_a, refuse,
                   real_plan: dict, members: dict, carry, scaled: Dict[int, Pair]) -> None:
    """Each of the model's modules ``own`` takes the entry of its layer's kind in twin A
    (``carry(key)``: that entry for the model)."""
    done: Dict[str, object] = {}
    for n in own:
        i = _layer_index(n)
        t = LAYER_INDEX.sub(str(kinds[i]), n, count=1) if i is not None and i < len(kinds) \
            else None
        if t not in keys:
            raise refuse(f"{n} has no entry of its layer's kind in the twin's plan")
        if t not in done:
            done[t] = carry(t)
        real_plan[n] = done[t]
        if t in plan_a.members:
            p = plan_a.members[t]
            members[n] = scaled.get(id(p), p)


def _pair_of(st) -> Optional[Pair]:
    if isinstance(st, (UnitColwise, UnitRowwise, UnitNorm)):
        return st.pair
    return None


def _carried(st, key: str, a, b, plan_b, model, scaled: Dict[int, Pair], refuse,
             kinds: Optional[List[int]] = None):
    """The style ``st`` of twin A's entry ``key``, for the model (with ``kinds``: sized by
    the model's first layer of the kind of ``key``'s layer)."""
    if isinstance(st, (UnitColwise, UnitRowwise, UnitNorm)):
        p = st.pair
        if id(p) not in scaled:
            names = list(p.sources) + [p.sink]
            to_b = _scaled(p, a, b, _identity(b))
            pb = _pair_of(plan_b[key])
            if to_b is None or pb is None or not _same(to_b, pb):
                raise refuse(f"the rows of {p.sink}'s pair do not scale between the twins")
            real = _scaled(p, a, model, _real_names(model, names, kinds))
            if real is None:
                raise refuse(f"the rows of {p.sink}'s pair do not scale to the model's sizes")
            scaled[id(p)] = real
        new = copy.copy(st)
        new.pair = scaled[id(p)]
        return new
    if isinstance(st, (ShardedAttention, Chain)):
        return _carried_attention(st, model, kinds)
    return st


def _carried_attention(st, model: nn.Module, kinds: Optional[List[int]] = None):
    """An attention style of the twin with the model's widths in its update."""
    parts = list(st.styles) if isinstance(st, Chain) else [st]
    out = []
    for part in parts:
        if isinstance(part, ShardedAttention):
            update = part.update
            info = getattr(update, "_tpx_counts", None)
            if info is not None:
                heads, kv, _, projections, sink = info
                width = _features(model, _real_names(model, [sink], kinds)[sink], False)
                update = local_counts(heads, kv, width, projections, sink=sink)
            part = ShardedAttention(part.num_heads, part.num_kv_heads, update=update,
                                    out_proj=part.out_proj, uneven=part.uneven)
        out.append(part)  # HeadInputs: counts of heads, the same on the model
    return Chain(*out) if len(out) > 1 else out[0]
