"""A Hugging Face model's own TP plan, completed where it leaves splittable modules whole
(:mod:`tpx.parallel.complete`'s rules), and proved before it is used.

``tpx.plans.auto`` reads a model's plan through :func:`translate`: the shipped entries as
:func:`tpx.parallel.hf_plan.translate` reads them, plus the entries the rules add, each group
of them kept only where the translation takes it. Where anything was added the result is a
:class:`CompletedPlan`, which ``tpx.parallelize_module`` proves before it changes anything:
on a copy of the model beside the unsharded one (as a derived plan), or, for a model on the
meta device, on its twin (:func:`prove_on_twin`). A group the proof finds wrong is left whole
with a warning that names it, and the rest is proved again; the shipped entries are applied
as before.
"""

from __future__ import annotations

import copy
import fnmatch
import warnings
from typing import Dict, List

from torch import nn

from .base import TPContext
from .complete import Completion, complete
from .derive import DerivedPlan
from .hf_plan import translate_entries, hf_tp_plan
from .example import example_inputs
from .twin import twin

__all__ = ["translate", "CompletedPlan", "prove_on_twin"]


def translate(model: nn.Module, *, sequence_parallel: bool = False,
              loss_parallel: bool = False, experts: str = "tp"):
    """The model's own plan (:func:`tpx.parallel.hf_plan.translate`) with the entries
    :func:`tpx.parallel.complete.complete` adds: a :class:`CompletedPlan` where it added any,
    the plain translation otherwise."""
    from .hf_plan import translate as shipped_translate

    plain = shipped_translate(model, sequence_parallel=sequence_parallel,
                              loss_parallel=loss_parallel, experts=experts)  # its errors first
    hf = hf_tp_plan(model)
    kw = dict(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, experts=experts)
    done = complete(model, hf, lambda trial: translate_entries(model, trial, **kw))
    if sequence_parallel:
        for label in [g for g in done.groups if g.startswith("mixer ")]:
            done = done.without(label, "a Mamba-2 mixer scans the whole sequence: under "
                                "sequence parallelism it stays whole")
    if not done:
        return plain
    plan = _translated(model, {**hf, **done.entries}, kw)
    proof = plan if not loss_parallel else _translated(
        model, {**hf, **done.entries}, dict(kw, loss_parallel=False))
    return CompletedPlan(plan, model=model, completion=done, proof_plan=proof,
                         translate_kwargs=kw, shipped=hf)


NOT_RUN = ("the proof's batch (token ids) does not run these modules (a vision or audio "
           "tower), so nothing proves them")


def _translated(model: nn.Module, entries: Dict[str, object], kw) -> Dict[str, object]:
    """``entries`` as a tpx plan: the Hugging Face style names translated, a tpx style (an
    entry no Hugging Face style states: a Mamba-2 mixer) as it is."""
    plan = translate_entries(model, {k: v for k, v in entries.items() if isinstance(v, str)},
                             **kw)
    plan.update({k: v for k, v in entries.items() if not isinstance(v, str)})
    return plan


class CompletedPlan(DerivedPlan):
    """A Hugging Face plan with :func:`complete`'s entries added (``completion``: what was
    added and what was left whole), proved before it is used like a derived plan:
    ``tpx.parallelize_module`` runs it on a copy of the model beside the unsharded one and
    raises, changing nothing, where they differ. A model on the meta device (as
    ``tpx.from_pretrained`` builds it) has no values to run: the plan is proved on its twin
    instead (:mod:`tpx.parallel.twin`: the same class with a small config that keeps the
    structure the plan reads), completed by the same rules (:func:`prove_on_twin`)."""

    def __init__(self, plan, *, model: nn.Module, completion: Completion, proof_plan,
                 translate_kwargs: Dict[str, object], shipped: Dict[str, str]) -> None:
        cfg = getattr(model, "config", None)
        name = (f"Hugging Face model_type={cfg.model_type!r} ({type(model).__name__})"
                if getattr(cfg, "model_type", None) else type(model).__name__)
        super().__init__(plan, model_name=name, example=example_inputs(model),
                         proof_plan=proof_plan, kept_whole=dict(completion.left))
        self.completion = completion
        self.translate_kwargs = dict(translate_kwargs)
        self.shipped = dict(shipped)  # the model's own plan, in Hugging Face's style names

    def prove_before_use(self, model: nn.Module, target, src_rank) -> None:
        """Proves the plan (module docstring). A group of added entries that makes the copy
        differ, or that the proof's batch does not run (a vision tower, given token ids), is
        left whole, with a warning naming it, and the rest proved again; the model's own
        entries are applied as shipped. The plan is updated in place."""
        if any(p.device.type == "meta" for p in model.parameters()):
            prove_on_twin(model, self, target)
            return
        while self.completion:
            try:
                self.prove_once(model, target, src_rank)
                labels = self.not_run([n for n, _ in self.report.module_errors])
                if not labels:
                    return
                reason = NOT_RUN
            except ValueError as e:
                label = self.completion.group_of(self.failed_at)
                labels = [label] if label is not None else list(self.completion.groups)
                reason = str(e).split("\n")[0]
            self.leave_whole(model, labels, reason)

    def not_run(self, ran: List[str]) -> List[str]:
        """The added groups none of whose modules are among ``ran`` (module names: those a
        forward of the proof's batch called)."""
        return [label for label, keys in self.completion.groups.items()
                if not any(n == k or fnmatch.fnmatchcase(n, k) for n in ran for k in keys)]

    def leave_whole(self, model: nn.Module, labels: List[str], reason: str) -> None:
        """Removes the added groups ``labels``, with a warning naming each and ``reason``;
        the plan is translated again without them (in place)."""
        for label in labels:
            self.completion = self.completion.without(label, reason)
            what = ("are not run by the proof" if reason == NOT_RUN
                    else "do not compute what the unsharded model computes on a copy of it")
            warnings.warn(
                f"tpx.plans.auto: the entries tpx added to {self.model_name}'s TP plan for "
                f"{label} {what}, so that module stays whole on every rank ({reason})",
                UserWarning, stacklevel=5)
        self._retranslate(model)

    def _retranslate(self, model: nn.Module) -> None:
        hf = {**self.shipped, **self.completion.entries}
        plan = _translated(model, hf, self.translate_kwargs)
        self.proof_plan = (dict(plan) if not self.translate_kwargs.get("loss_parallel") else
                           _translated(model, hf, dict(self.translate_kwargs,
                                                       loss_parallel=False)))
        unsplit = getattr(self, "unsplit", {})  # left whole for the TP size (fit_to)
        for key in unsplit:
            plan.pop(key, None)
            self.proof_plan.pop(key, None)
        self.clear()
        self.update(plan)
        self.kept_whole = dict(self.completion.left, **self._shown(unsplit))


def prove_on_twin(model: nn.Module, plan, target) -> None:
    """Proves ``plan`` (a :class:`~tpx.parallel.complete.CompletedPlan` of ``model``) on the
    model's twin: the twin's plan, completed by the same rules, must add the same groups and
    compute what the unsharded twin computes (:meth:`DerivedPlan.prove_before_use`). A group
    the twin leaves whole or disproves is left whole on ``model`` too (the plan is updated in
    place, with a warning naming it). Collective over ``target``."""
    name = plan.model_name
    try:
        small = twin(model)
    except Exception as e:  # noqa: BLE001 - a config the rules cannot shrink: said, not hidden
        why = f"its twin could not be built ({type(e).__name__}: {str(e).splitlines()[0]})"
        for label in list(plan.completion.groups):
            plan.completion = plan.completion.without(label, why)
        warnings.warn(
            f"tpx.plans.auto: the entries tpx would add to {name}'s TP plan are proved on a "
            f"twin of the model (its class at a small size), and {why}: the modules they "
            "split stay whole on every rank. To have them split, load the model with its "
            "weights (transformers' from_pretrained) and shard it with "
            "tpx.parallelize_module, where the plan is proved on a copy", UserWarning,
            stacklevel=5)
        plan._retranslate(model)
        return
    small_plan = translate(small, **plan.translate_kwargs)
    groups = getattr(getattr(small_plan, "completion", None), "groups", {})
    for label in [g for g in plan.completion.groups if g not in groups]:
        plan.completion = plan.completion.without(label, "its twin does not take these entries")
    if small_plan is not None and getattr(small_plan, "completion", None):
        for label in [g for g in small_plan.completion.groups if g not in plan.completion.groups]:
            small_plan.completion = small_plan.completion.without(label, "not in the model")
        small_plan._retranslate(small)
        with warnings.catch_warnings():  # the model's own fit says it
            warnings.simplefilter("ignore")
            small_plan.fit_to(small, TPContext.of(target, None).group.size())
        small_plan.prove_before_use(small, target, None)
        for label, why in small_plan.completion.left.items():
            if label in plan.completion.groups:
                plan.completion = plan.completion.without(label, why)
    else:
        plan.completion = copy.copy(plan.completion)
        for label in list(plan.completion.groups):
            plan.completion = plan.completion.without(label, "its twin does not take them")
    plan._retranslate(model)
