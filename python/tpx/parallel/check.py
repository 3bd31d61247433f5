"""``tpx.plans.check``: apply a plan and hold the sharded model against the unsharded one.

A tensor-parallel plan can be wrong in ways nothing reports: a fused projection split as if
it were one (``[q | k | v]`` cut in three equal pieces of the wrong features), heads cut in
half, a replicated parameter that sees only this rank's heads. The model runs and trains on
a loss that looks normal, as another model. :func:`check` finds these by running the same
inputs through an unsharded copy and the sharded model, once, and comparing:

- every module's output, in execution order, with the unsharded module's (each rank compares
  its own part: a column-parallel layer's output with its columns of the unsharded output, an
  output split along one dimension with the block of the unsharded output it matches best,
  its own block first; no tensor is gathered), and names the first that differs;
- every parameter's gradient with the unsharded gradient (this rank's shard of it);
- every replicated parameter across the ranks (:func:`tpx.check_replicas`);
- and, as a hint, the ``nn.Linear`` / ``nn.Embedding`` modules the plan left whole.

Cost: one extra forward and backward of the unsharded model on every rank, and its memory
(a full copy of the model), plus one small all-reduce of the results. Use it on a small
config of the model (the same architecture, fewer layers or a narrower width) before a long
run, not on the full model.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm import collectives
from ..layout.sharded import mesh_params, sharded_params
from ..mesh import mesh_layout
from ..replicas import check_replicas
from .api import parallelize_module
from .base import TPContext

__all__ = ["check", "PlanReport"]


@dataclass
class PlanReport:
    """What :func:`check` found (the same on every rank). ``ok`` is True when the outputs,
    the gradients and the replicas all agree with the unsharded model."""

    first_divergent_module: Optional[Tuple[str, float]] = None  # (name, relative error)
    last_matching_module: Optional[str] = None  # the module that ended just before it
    module_errors: List[Tuple[str, float]] = field(default_factory=list)
    grad_errors: List[Tuple[str, float]] = field(default_factory=list)  # over the tolerance
    replica_errors: List[str] = field(default_factory=list)
    left_whole: List[Tuple[str, int]] = field(default_factory=list)  # (module, parameters)
    output_error: float = 0.0
    tolerance: float = 0.0

    @property
    def ok(self) -> bool:
        return (self.first_divergent_module is None and not self.grad_errors
                and not self.replica_errors and self.output_error <= self.tolerance)

    def suspects(self) -> List[str]:
        """The modules the report points at, the most telling first: the first module whose
        output differs, else the modules of the gradients, else of the replicas, that do."""
        if self.first_divergent_module is not None:
            return [self.first_divergent_module[0]]
        params = [n for n, _ in self.grad_errors] + [r.split(" (")[0]
                                                     for r in self.replica_errors]
        return list(dict.fromkeys(n.rpartition(".")[0] for n in params))

    def __str__(self) -> str:
        lines = [f"tpx.plans.check: {'OK' if self.ok else 'the sharded model DIFFERS from the unsharded one'}"
                 f" (relative tolerance {self.tolerance:.0e})"]
        lines.append(f"  model output: relative error {self.output_error:.2e}")
        if self.first_divergent_module is not None:
            name, err = self.first_divergent_module
            after = (f"; the module that ended before it, {self.last_matching_module}, still "
                     "matched" if self.last_matching_module else "")
            lines.append(f"  first module whose output differs: {name or '(the model)'} "
                         f"(relative error {err:.2e}{after})")
        for name, err in self.grad_errors:
            lines.append(f"  gradient differs: {name} (relative error {err:.2e})")
        for r in self.replica_errors:
            lines.append(f"  replicas differ across ranks: {r}")
        if self.left_whole:
            total = sum(n for _, n in self.left_whole)
            names = ", ".join(n for n, _ in self.left_whole[:6])
            more = f" and {len(self.left_whole) - 6} more" if len(self.left_whole) > 6 else ""
            lines.append(f"  hint: left whole on every rank: {names}{more} "
                         f"({total:,} parameters that could be sharded)")
        return "\n".join(lines)


def first_tensor(out):
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, Tensor):
                return o
    if isinstance(out, dict):
        for o in out.values():
            if isinstance(o, Tensor):
                return o
    last = getattr(out, "last_hidden_state", None)
    if isinstance(last, Tensor):
        return last
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, Tensor) else None


def _local(t: Tensor) -> Tensor:
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if full_tensor is not None else t


def _rel(a: Tensor, b: Tensor, floor: float = 0.0) -> float:
    a, b = a.detach().double(), b.detach().double()
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _grad_floors(params: Dict[str, Tensor]) -> Dict[str, float]:
    """Per parameter, the smallest gradient magnitude its error is taken relative to: the
    cube root of its dtype's epsilon (float32: 4.9e-3, float64: 6.1e-6) times the largest
    gradient of its module. A gradient far below its module's is rounding noise of the
    module's backward (a key bias, which softmax does not see, is zero in exact arithmetic:
    2e-13 beside its weight's 4e-6 in float32), a few epsilons of the module's gradients,
    and any two orders of summation give different noise."""
    top: Dict[str, float] = {}
    for name, p in params.items():
        if p.grad is not None and p.grad.is_floating_point() and p.grad.numel():
            mod = name.rpartition(".")[0]
            top[mod] = max(top.get(mod, 0.0), float(p.grad.detach().abs().max()))
    return {name: top.get(name.rpartition(".")[0], 0.0) * torch.finfo(p.grad.dtype).eps ** (1 / 3)
            for name, p in params.items()
            if p.grad is not None and p.grad.is_floating_point()}


def _parts_of(full: Tensor, local: Tensor, module: nn.Module, pg) -> List[Tensor]:
    """The parts of the unsharded output ``full`` that ``local`` may be: this rank's columns
    of a column-parallel layer; the whole output; or, for an output split along one
    dimension, this rank's block first and then every other block of that size (a block held
    by several ranks, as a replicated KV head, sits elsewhere than the rank's own). Empty when
    no part has ``local``'s shape, and for a module whose output interleaves this rank's
    part with the others' (``_tpx_output_interleaved``: Gated DeltaNet's per-head norm, its
    heads flattened into the rows), whose gradients and consumers are compared instead."""
    if getattr(module, "_tpx_output_interleaved", False):
        return []
    if local.shape == full.shape:
        return [full]
    rows = getattr(module, "out_rows", None)
    if rows is not None and local.dim() == full.dim() and local.shape[:-1] == full.shape[:-1]:
        part = torch.cat([full[..., s:e] for s, e in rows[dist.get_rank(pg)]], -1)
        return [part] if part.shape == local.shape else []
    if local.dim() != full.dim():
        return []
    differ = [d for d in range(full.dim()) if local.shape[d] != full.shape[d]]
    if len(differ) > 1:  # a block of a multi-dimensional layout: every block of its size
        grids = []
        for d in differ:
            w = local.shape[d]
            if w == 0 or w > full.shape[d]:
                return []
            grids.append(range(0, full.shape[d] - w + 1, w))
        starts = list(itertools.product(*grids))
        if len(starts) > 512:
            return []
        out = []
        for start in starts:
            part = full
            for d, o in zip(differ, start):
                part = part.narrow(d, o, local.shape[d])
            out.append(part)
        return out
    if not differ:
        return []
    d, width = differ[0], local.shape[differ[0]]
    if width == 0 or width > full.shape[d]:
        return []
    world, rank = pg.size(), dist.get_rank(pg)
    per = -(-full.shape[d] // world)
    own = min(rank * per, full.shape[d])
    starts = [own] if own + width <= full.shape[d] else []
    # Every offset where there are few (a split in aligned units, as the experts' 16-byte
    # strides give: 22 features as 12 + 10), else the blocks of this width.
    step = 1 if full.shape[d] - width < _ALL_OFFSETS else width
    starts += [o for o in range(0, full.shape[d] - width + 1, step) if o != own]
    return [full.narrow(d, o, width) for o in starts]


_ALL_OFFSETS = 256  # up to this many, a part of an output is looked for at every offset


def check(model: nn.Module, group, plan, *example_inputs, loss_fn: Optional[Callable] = None,
          rtol: float = 1e-4, strict: bool = False, **example_kwargs) -> PlanReport:
    """Applies ``plan`` to ``model`` (in place, as ``tpx.parallelize_module(model, group,
    plan)``; the unsharded copy is taken first) and runs ``model(*example_inputs,
    **example_kwargs)`` and a backward on both. Collective over ``group``; every rank gets the
    same :class:`PlanReport` (``print(report)`` gives a short table). ``strict=True`` raises
    ``RuntimeError`` with that table when the report is not ``ok``.

    ``loss_fn(output)`` makes the scalar to differentiate (default: the mean of the squares of
    the model's first output tensor, e.g. the logits), computed on both models; the output
    must then be whole on every rank (a ``DTensor`` is gathered; a vocab-sharded output needs
    a ``loss_fn`` written for it, e.g. inside ``tpx.loss_parallel()``). Inputs must be the same
    on every rank. Works for 1-D plans (tpx's, PyTorch's names, Hugging Face plans through
    ``tpx.plans.auto``, the older API's ``PairwiseParallel``) over a group or a 1-D mesh, and
    for the 2-D / 2.5-D / 3-D plans over a mesh from ``tpx.init_mesh`` (a module's output block
    is compared with the block of the unsharded output it matches best; replicas are compared
    over the whole mesh for the parameters no layer shards). ``rtol`` is relative to each
    tensor's largest magnitude; a gradient's, to at least the cube root of its dtype's
    epsilon times the largest gradient of its module (below that it is rounding noise)."""
    multidim = hasattr(group, "mesh_dim_names") and mesh_layout(group) in ("2d", "2.5d", "3d")
    pg = TPContext.of(group).group
    ref = copy.deepcopy(model)
    parallelize_module(model, group if multidim else pg, plan)
    names_ref = dict(ref.named_modules())
    captured: Dict[str, Tensor] = {}
    order: List[str] = []
    hooks = []

    def grab(name, store):
        def hook(mod, args, out):
            t = first_tensor(out)
            if t is not None and name not in store:
                store[name] = t.detach()
                if store is captured:
                    order.append(name)
        return hook

    sharded_outs: Dict[str, Tensor] = {}
    for name, mod in ref.named_modules():
        hooks.append(mod.register_forward_hook(grab(name, captured)))
    sharded_modules = dict(model.named_modules())
    for name, mod in sharded_modules.items():
        hooks.append(mod.register_forward_hook(grab(name, sharded_outs)))
    loss_fn = loss_fn or (lambda out: first_tensor(out).float().pow(2).mean())
    try:
        ref_out = ref(*example_inputs, **example_kwargs)
        ref_loss = loss_fn(ref_out)
        ref_loss.backward()
        out = model(*example_inputs, **example_kwargs)
        loss = loss_fn(out)
        loss = _local(loss) if hasattr(loss, "full_tensor") else loss
        loss.backward()
    finally:
        for h in hooks:
            h.remove()

    # Module outputs in the unsharded model's execution order; a module the plan replaced
    # keeps its name.
    errors = []
    for name in order:
        if name not in sharded_outs:
            continue
        local = _local(sharded_outs[name])
        parts = _parts_of(captured[name], local, sharded_modules.get(name), pg)
        errors.append(min(_rel(local, part) for part in parts) if parts else -1.0)


    shards = {sh.key: sh for sh in sharded_params(model)}
    shards.update({ms.key: ms for ms in mesh_params(model)})
    grad_names, grad_errs = [], []
    ref_params = dict(ref.named_parameters())
    floors = _grad_floors(ref_params)
    for name, p in model.named_parameters():
        rp = ref_params.get(name)
        if rp is None or rp.grad is None:
            continue
        if p.grad is None:  # trained unsharded, left out of the sharded model's graph
            grad_names.append(name)
            grad_errs.append(float("inf"))
            continue
        got = _local(p.grad)  # a DTensor's full tensor (collective, in the same order)
        want = (shards[name].slice_of(rp.grad) if name in shards and got.shape != rp.grad.shape
                else rp.grad)
        grad_names.append(name)
        grad_errs.append(_rel(got, want, floors.get(name, 0.0)) if want.shape == got.shape
                         else float("inf"))
    out_err = _rel(_local(first_tensor(out)), first_tensor(ref_out))

    # One all-reduce (max over ranks) of every number, so every rank reports the same.
    numbers = torch.tensor([out_err, *errors, *grad_errs], dtype=torch.float64)
    collectives.all_reduce(numbers, pg, op=dist.ReduceOp.MAX)
    values = numbers.tolist()
    report = PlanReport(output_error=values[0], tolerance=rtol)
    module_errs = values[1:1 + len(errors)]
    names = [n for n in order if n in sharded_outs]
    report.module_errors = list(zip(names, module_errs))
    previous = None
    for name, err in report.module_errors:
        if err > rtol:
            report.first_divergent_module = (name, err)
            report.last_matching_module = previous
            break
        if err >= 0:
            previous = name
    report.grad_errors = [(n, e) for n, e in zip(grad_names, values[1 + len(errors):])
                          if e > rtol]
    report.replica_errors = [str(m) for m in check_replicas(model, pg)]
    for name, mod in sharded_modules.items():
        if type(mod) in (nn.Linear, nn.Embedding) and name in names_ref:
            report.left_whole.append((name, sum(p.numel() for p in mod.parameters())))
    if strict and not report.ok:
        raise RuntimeError(str(report))
    return report
