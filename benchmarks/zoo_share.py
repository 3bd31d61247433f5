"""How much of each model one rank holds at TP 8, at the model's released size.

Every causal-LM type of the installed transformers (and, with ``--set multimodal``, the
multimodal generative ones) is built on the meta device from its config class's defaults
(mostly the released sizes: ``LlamaConfig()`` is Llama-2-7B, ``GptOssConfig()``
gpt-oss-120b), then sharded with ``tpx.parallelize_module(model, None, tpx.plans.auto(model))``
as rank 0 of a simulated group of ``--tp`` ranks (torch's ``FakeProcessGroup``: one process, no
data moves, every shape real). Rank 0's local parameter elements over the model's are its
share (1/TP is the ideal); the largest modules it holds whole say what keeps it above.

The plans tpx completes or derives are proved before use by running a copy or a twin of the
model; a fake group moves no data, so here the plan is applied unproved (its proof is what
``benchmarks/hf_zoo.py`` and the tests run on real ranks), after leaving whole what the TP
size cannot split, as ``tpx.parallelize_module`` does before the proof, and after leaving whole
the added groups the proof's batch (token ids) never runs, which the proof leaves whole too
(found by one forward of the model's twin). A model that ships no plan gets the plan derived
on its twins (``tpx.parallel.derive_twin``); one whose twins cannot carry a plan is
``refused``, with tpx's message. A row above 1.3/TP says why its largest whole module is
whole (``why``: the plan's reason for it, or that no entry names it).

    python benchmarks/hf_zoo.py --share [--tp 8] [--archs llama,gpt_oss,...]

prints one row per type and writes ``benchmarks/results/hf_zoo_share.json``.
"""

from __future__ import annotations

import collections
import fnmatch
import re
import time
import warnings
from typing import Dict, List

import torch

WHOLE_SHOWN = 3


def _types(which: str) -> List[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if which == "multimodal":
        import hf_tiny

        return hf_tiny.multimodal_types()
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _local(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _leave_unrun_whole(model, plan) -> None:
    """What the proof on real ranks leaves whole because its batch never runs it (a tower
    fed token ids): the added groups none of whose modules a forward of the model's twin on
    that batch calls (one local forward, no group needed)."""
    from tpx.parallel.completed import NOT_RUN, CompletedPlan
    from tpx.parallel.example import example_inputs
    from tpx.parallel.twin import twin

    if not isinstance(plan, CompletedPlan) or not plan.completion:
        return
    try:
        small = twin(model)
    except Exception:  # noqa: BLE001 - no twin: the proof on real ranks leaves all whole too
        plan.leave_whole(model, list(plan.completion.groups), "its twin could not be built")
        return
    ran: List[str] = []
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: ran.append(n))
             for n, m in small.named_modules()]
    try:
        with torch.no_grad():
            small(**example_inputs(small))
    finally:
        for h in hooks:
            h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan.leave_whole(model, plan.not_run(ran), NOT_RUN)


def share_of(mt: str, world: int, multimodal: bool) -> Dict[str, object]:
    """One type's row: status, parameters, rank 0's share, the largest whole modules."""
    import hf_tiny
    import tpx
    from transformers import CONFIG_MAPPING

    row: Dict[str, object] = dict(arch=mt, tp=world)
    t0 = time.perf_counter()
    try:
        cfg = CONFIG_MAPPING[mt]()
        cls = hf_tiny.auto_class(mt) if multimodal else None
        with torch.device("meta"):
            if cls is None:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_config(cfg)
            else:
                model = cls.from_config(cfg)
    except Exception as e:  # noqa: BLE001 - transformers' own default does not build
        return dict(row, status="no-build", detail=f"{type(e).__name__}: {str(e)[:160]}")
    total = sum(p.numel() for p in model.parameters())
    full = {n: p.numel() for n, p in model.named_parameters()}  # before sharding
    row["parameters"] = total
    try:
        plan = tpx.plans.auto(model)
        _leave_unrun_whole(model, plan)
        fit = getattr(plan, "fit_to", None)  # what cannot be split at this TP size stays whole
        if fit is not None:
            fit(model, world)
        # applied unproved: a fake group moves no data (module docstring)
        tpx.parallelize_module(model, None, tpx.plans.ModelPlan(dict(plan)))
    except Exception as e:  # noqa: BLE001 - tpx refuses the model: its message is the row
        return dict(row, status="refused", detail=f"{type(e).__name__}: {str(e)[:400]}")
    whole: collections.Counter = collections.Counter()
    local = 0
    for name, p in model.named_parameters():
        n = _local(p)
        local += n
        if n == full.get(name, -1) and n > 0:  # an uneven split is a plain tensor: compare sizes
            whole[re.sub(r"\.\d+\.", ".*.", name)] += n
    row.update(status="split", share=local / total, seconds=round(time.perf_counter() - t0, 2),
               completed=sorted(getattr(getattr(plan, "completion", None), "groups", {})),
               left_whole=getattr(plan, "kept_whole", {}) or {},
               whole=[(k, v / total) for k, v in whole.most_common(WHOLE_SHOWN)])
    if row["share"] > 1.3 / world and row["whole"]:
        row["why"] = why_whole(row["whole"][0][0], row["left_whole"])
    return row


def why_whole(param: str, left_whole: Dict[str, str]) -> str:
    """Why the plan leaves the module of ``param`` (a pattern, ``layers.*.x.weight``) whole:
    the reason the plan gives for it or a module above it, else that no entry names it."""
    module = param.rpartition(".")[0]
    for key, why in left_whole.items():
        k = re.sub(r"\.\d+(?=\.|$)", ".*", key)
        if module == k or module.startswith(k + ".") or fnmatch.fnmatchcase(module, k):
            return f"{key}: {why}"
    return "no entry of the plan names it (no column -> row pair the trace finds there)"


def run_share(archs, world: int, which: str) -> List[Dict[str, object]]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    rows = []
    for mt in archs or _types(which):
        row = share_of(mt, world, which == "multimodal")
        rows.append(row)
        if row["status"] == "split":
            whole = ", ".join(f"{k} {v:.3f}" for k, v in row["whole"])
            print(f"  {mt:<28} {row['share']:.3f} of {row['parameters'] / 1e9:8.2f}B  "
                  f"whole: {whole}", flush=True)
            if "why" in row:
                print(f"  {'':<28} why: {row['why'][:200]}", flush=True)
        else:
            print(f"  {mt:<28} {row['status']}: {row['detail'][:150]}", flush=True)
    dist.destroy_process_group()
    return rows


def summary(rows, world: int) -> str:
    split = [r for r in rows if r["status"] == "split"]
    bands = [("<= 1.3/TP", lambda s: s <= 1.3 / world), ("up to 1/2", lambda s: s <= 0.5),
             ("over 1/2", lambda s: True)]
    lines, done = [], set()
    for label, test in bands:
        mine = [r["arch"] for r in split if r["arch"] not in done and test(r["share"])]
        done.update(mine)
        lines.append(f"{label}: {len(mine)}")
    for status in ("refused", "no-build"):
        lines.append(f"{status}: {sum(r['status'] == status for r in rows)}")
    return f"TP {world}, rank 0 holds: " + "; ".join(lines)
