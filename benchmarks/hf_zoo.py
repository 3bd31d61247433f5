"""The Hugging Face zoo under tensor parallelism, tpx's plans and transformers' own: which
architectures run, at which TP size, and whether they compute what one device computes.

For every causal-LM model type of transformers whose config carries a TP plan
(``base_model_tp_plan``; listed from transformers' own registry by ``tests/hf_tiny.py``, tiny
random configs, nothing downloaded), or with ``--set no-plan`` every one whose config carries
none (tpx derives their plans), and every TP size asked for, the ranks (gloo, CPU) build
the same unsharded model from the same seed and a copy sharded by

* ``tpx``: ``tpx.parallelize_module(model, None, tpx.plans.auto(model))``;
* ``tpx-derive``: the same with ``tpx.plans.auto(model, derive=True)``: the plan derived
  from the model's computation and proved on a copy (``tpx.parallel.derive``), even where the
  model ships a plan (a model without one gets a derived plan under ``tpx`` already);
* ``tpx-sp``: the same with ``tpx.plans.auto(model, sequence_parallel=True)``, on batches of 15
  positions (padded to a multiple of the TP size inside: the uneven case);
* ``tpx-load``: the unsharded model written by transformers' ``save_pretrained`` and read
  back with ``tpx.from_pretrained(path, dtype=...)`` (built on the meta device, each rank
  reading its slices, the Hub's layouts converted); after the steps, written back with
  ``model.save_pretrained(path)`` on every rank and read on one device by transformers'
  ``from_pretrained``, whose parameters must equal the unsharded model's;
* ``hf``: transformers' own tensor parallelism applied to the built model
  (``model._resolve_parallel_plans(DistributedConfig(tp_size=P))`` then
  ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``: what
  ``from_pretrained(..., distributed_config=...)`` does after loading; ``from_pretrained``
  with ``tp_plan`` / ``distributed_config`` itself needs ``accelerate``, recorded as such when
  it is not installed),

then train both for two AdamW steps on the same batches and compare the logits and the loss of
each step and every parameter after the last one with the unsharded model, in float64 by
default (``--dtype float32``: the tests' precision; Adam turns float32 rounding of gradients
near zero into differences of a parameter near the tolerances below, e.g. Gemma 3's tied
embedding, which float64 shows to be rounding: 1e-10 there). A case is ``pass``
(within the tests' tolerances: ``|sharded - unsharded| <= 2e-5 + 1e-4 * |unsharded|`` for
the first step's logits and every gradient of it, ``1e-4 + 1e-4 * |unsharded|`` for the logits
after a step and the parameters after the last (Adam's normalised step turns rounding of a
gradient near zero into up to that: Gemma 3's norms compute in float32 inside a float64 model,
so their gradients agree to 3e-7 relative and its logits after one step at TP 4 to 3.3e-5),
``1e-5 + 1e-5 * |unsharded|`` for the loss), ``wrong`` (it runs, the
numbers differ: the first tensor out of tolerance is named), ``refused`` (an error from
the library that says it does not take the model, before training), ``crash`` (any other
exception, a hang or a dead rank; the exception's first line) or ``broken`` (the unsharded
model itself fails to build or to train one step, before any library shards it: a model of
an older transformers on an older torch; for ``tpx-load``, also the model transformers itself
reads from the written files: XLNet's bare ``FloatTensor`` parameters stay float32 in a
float64 model, and its forward fails).

    python benchmarks/hf_zoo.py [--tp 2 4] [--set plan|no-plan] [--archs llama,qwen3,...]
                                [--impls tpx,hf,tpx-sp,tpx-load,tpx-derive]

prints the table and writes ``benchmarks/results/hf_zoo.json``. ``--share`` measures instead
how much of each model one rank holds at its released size (``benchmarks/zoo_share.py``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import hf_tiny  # noqa: E402
from common import (append_jsonl, environment, format_table, run_case_group,  # noqa: E402
                    status_of_error, write_json)

STEPS = 2


def tiny(arch: str):
    """The tests' tiny model of ``arch`` (``tests/test_hf_zoo.py``'s configs where it has
    one, ``tests/hf_tiny.py``'s generic one for the rest)."""
    import test_hf_zoo

    return test_hf_zoo.tiny(arch)


def _excess(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float):
    """(how far the worst element is beyond ``atol + rtol * |b|``, largest absolute
    difference): the tests' ``torch.testing.assert_close`` criterion."""
    a, b = a.detach().double(), b.detach().double()
    if not b.numel():
        return 0.0, 0.0
    diff = (a - b).abs()
    return float((diff - (atol + rtol * b.abs())).max()), float(diff.max())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_SCRATCH = {"dir": None}  # a directory every rank of the group sees (tpx-load's files)


class _UnreadByTransformers(Exception):
    """transformers' own ``from_pretrained`` of the written files does not train a step: the
    case is ``broken`` (not tpx's to pass)."""


def _load(ref, arch: str, dtype: torch.dtype, images: bool):
    """``tpx-load``: ``ref`` written by transformers, read back sharded by tpx, with the
    model's own class (a text config some auto class does not map, Mllama's, is read so)."""
    import torch.distributed as dist

    import tpx

    path = os.path.join(_SCRATCH["dir"], arch)
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    # its config object: the tiny configs' eager attention and experts (float64) are settings
    # of the object that config.json does not carry
    config = copy.deepcopy(ref.config)
    try:  # what transformers itself reads from the files must train a step
        back = type(ref).from_pretrained(path, dtype=dtype, config=copy.deepcopy(config))
        back.train()(**_batch(0, "tpx-load", ref if images else None, dtype)).loss.backward()
    except Exception as e:  # noqa: BLE001 - recorded
        line = (str(e).strip().splitlines() or [""])[0]
        raise _UnreadByTransformers(f"transformers' from_pretrained of the files: "
                                    f"{type(e).__name__}: {line}") from None
    return tpx.from_pretrained(path, dtype=dtype, config=config,
                               model_class=type(ref)).train()


def _saved_back(model, ref, full, arch: str, dtype: torch.dtype):
    """``tpx-load`` after the steps: written by every rank, read by transformers on one
    device; ``None`` or the first parameter that differs from ``full``, the sharded model's
    own full state (compared with ``ref``'s before): the files hold what the ranks hold,
    exactly."""
    import torch.distributed as dist
    import transformers

    path = os.path.join(_SCRATCH["dir"], arch + "-saved")
    model.save_pretrained(path)
    if dist.get_rank() != 0:
        return None
    back = type(ref).from_pretrained(path, dtype=dtype).state_dict()
    for key in ref.state_dict():
        if key not in back:
            return f"{key} missing from the saved directory"
        excess, diff = _excess(back[key], full[key].to(back[key].dtype), 0.0, 0.0)
        if excess > 0:
            return (f"{key} as saved and read on one device: largest difference {diff:.1e} "
                    "from the sharded model's")
    return None


def _shard(impl: str, model, world: int):
    if impl in ("tpx", "tpx-sp", "tpx-derive"):
        import tpx

        tpx.parallelize_module(model, None, tpx.plans.auto(
            model, sequence_parallel=impl == "tpx-sp", derive=impl == "tpx-derive"))
        return
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=world))
    apply_tensor_parallelism(model, init_device_mesh("cpu", (world,)), tp_plan)


def _grads_wrong(impl: str, model, ref):
    """The first gradient of the sharded ``model`` that differs from ``ref``'s (this rank's
    part of it where tpx describes the parameter's layout), or None."""
    sharded = {}
    if impl.startswith("tpx"):
        import tpx.checkpoint

        sharded = {sh.key: sh for sh in tpx.checkpoint.sharded_params(model)}
    expected = dict(ref.named_parameters())
    for key, p in model.named_parameters():
        want = expected[key].grad if key in expected else None
        if (want is None) != (p.grad is None):
            return (f"gradient of {key}: unsharded {'none' if want is None else 'has one'}, "
                    f"sharded {'none' if p.grad is None else 'has one'}")
        if want is None:
            continue
        got = p.grad
        if key in sharded and tuple(getattr(got, "to_local", lambda: got)().shape) != \
                tuple(want.shape):
            got, want = getattr(got, "to_local", lambda: got)(), sharded[key].slice_of(want)
        else:
            got = _full(got)
        excess, diff = _excess(got.detach(), want.detach(), 1e-4, 2e-5)
        if excess > 0:
            return f"gradient of {key} at step 0: largest difference {diff:.1e}"
    return None


def _full_state(impl: str, model):
    if impl in ("tpx", "tpx-sp", "tpx-load", "tpx-derive"):
        import tpx.checkpoint

        return tpx.checkpoint.full_state_dict(model)
    return {k: _full(v) for k, v in model.state_dict().items()}


def _batch(step: int, impl: str, model=None, dtype=torch.float32) -> dict:
    """Step ``step``'s inputs: 2 x 16 random token ids (15 for ``tpx-sp``), their labels the
    ids; given the unsharded ``model`` of a vision-language type, one tiny random image per
    sequence before them (``hf_tiny.image_batch``)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, 1003, (2, 15 if impl == "tpx-sp" else 16), generator=g)
    batch = hf_tiny.image_batch(model, ids, g) if model is not None else None
    if batch is None:
        return dict(input_ids=ids, labels=ids)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def _trains_in(model, dtype: torch.dtype, impl: str):
    """``(dtype, images)``: the dtype in which the unsharded ``model`` trains a step (on a
    copy): ``dtype``, else float32 (a few compute a part in float32 on purpose, e.g. a router
    whose weight is made float32); ``images``: whether it does so on inputs with an image
    (tried first for a vision-language model; text alone otherwise). Raises what the model
    raises when it trains in neither dtype."""
    error = None
    for dt in dict.fromkeys((dtype, torch.float32)):
        for images in (True, False):
            try:
                m = copy.deepcopy(model).to(dt)
                batch = _batch(0, impl, m if images else None, dt)
                if images and "pixel_values" not in batch:
                    continue
                m(**batch).loss.backward()
                return dt, images
            except Exception as e:  # noqa: BLE001 - the text-only try decides
                if not images:
                    error = e
    raise error


def _case(impl: str, arch: str, world: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    try:  # the unsharded model alone
        ref = tiny(arch)
        dtype, images = _trains_in(ref, dtype, impl)
    except Exception as e:  # noqa: BLE001 - recorded
        line = (str(e).strip().splitlines() or [""])[0]
        return dict(status="broken", detail=f"unsharded: {type(e).__name__}: {line}"[:300])
    ref = ref.to(dtype)
    if impl == "tpx-load":
        try:
            model = _load(ref, arch, dtype, images)
        except _UnreadByTransformers as e:
            return dict(status="broken", detail=str(e)[:300])
    else:
        model = copy.deepcopy(ref)
        _shard(impl, model, world)
    split = _split_fraction(model, ref)
    inputs = "text and an image" if images else "text"
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, model)]
    worst = (0.0, "")
    for step in range(STEPS):
        batch = _batch(step, impl, ref if images else None, dtype)
        out_ref = ref(**batch)
        out = model(**batch)
        for what, a, b, rtol, atol in (("logits", _full(out.logits), out_ref.logits, 1e-4,
                                        2e-5 if step == 0 else 1e-4),
                                       ("loss", _full(out.loss), out_ref.loss, 1e-5, 1e-5)):
            excess, diff = _excess(a, b, rtol, atol)
            if excess > 0:
                return dict(status="wrong", detail=f"{what} at step {step}: largest difference "
                                                   f"{diff:.1e}")
        out_ref.loss.backward()
        out.loss.backward()
        if step == 0:
            wrong = _grads_wrong(impl, model, ref)
            if wrong is not None:
                return dict(status="wrong", detail=wrong)
        for o in opts:
            o.step()
            o.zero_grad()
    full, expected = _full_state(impl, model), ref.state_dict()
    # A tied parameter (an LM head tied to the embedding) may appear under one name only.
    same = {}
    for k, v in expected.items():
        same.setdefault(v.data_ptr(), []).append(k)
    for names in same.values():
        for k in names:
            if k not in full:
                other = next((n for n in names if n in full), None)
                if other is not None:
                    full[k] = full[other]
    for key, value in expected.items():
        if key not in full:
            return dict(status="wrong", detail=f"{key} missing from the sharded state")
        excess, diff = _excess(full[key], value, 1e-4, 1e-4)
        if excess > 0:
            return dict(status="wrong", detail=f"{key} after {STEPS} AdamW steps: largest "
                                               f"difference {diff:.1e}")
        worst = max(worst, (diff, key))
    if impl == "tpx-load":
        wrong = _saved_back(model, ref, full, arch, dtype)
        if wrong is not None:
            return dict(status="wrong", detail=wrong)
    return dict(status="pass", split=round(split, 3), inputs=inputs,
                detail=f"largest difference of a parameter {worst[0]:.1e} "
                       f"({worst[1]}; {str(dtype)[6:]}); {split:.0%} of the parameters split; "
                       f"inputs: {inputs}")


def _split_fraction(model, ref) -> float:
    """The share of the unsharded model's parameter elements that the sharded ``model``
    splits over the ranks (a rank holds fewer elements of them than one device)."""
    full = dict(ref.named_parameters())
    total = sum(p.numel() for p in full.values()) or 1
    split = 0
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if name in full and local.numel() < full[name].numel():
            split += full[name].numel()
    return split / total


def _rank(rank: int, world: int, cases, dtype, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    _SCRATCH["dir"] = out_dir
    for arch, impl in cases:
        t = time.perf_counter()
        try:
            r = _case(impl, arch, world, dtype)
        except Exception as e:  # noqa: BLE001 - recorded
            line = (str(e).strip().splitlines() or [""])[0]
            r = dict(status=status_of_error(e), detail=f"{type(e).__name__}: {line}"[:300])
            if os.environ.get("HF_ZOO_TRACE"):
                traceback.print_exc()
        r.update(arch=arch, impl=impl, tp=world, seconds=round(time.perf_counter() - t, 1))
        append_jsonl(path, r)  # case by case: a hang loses only its own case
        dist.barrier()


def run(archs, world: int, impls, timeout: float, dtype: torch.dtype, chunk: int = 24) -> list:
    """Groups of ``world`` ranks, each running up to ``chunk`` cases (torch and transformers
    imported once per group). A case that does not finish within ``timeout`` seconds is
    recorded as a crash (a hang or a dead rank), its group killed, and the cases after it
    run in a new group. The rows of rank 0."""
    # A rank reaches parallelize_module after deriving its plan alone, which on a loaded
    # machine may take one rank much longer than another; this runner bounds hangs itself
    # (``timeout``), so tpx's check that every rank came waits as long.
    os.environ.setdefault("TPX_ENTRY_GRACE", str(max(30, int(timeout))))
    rows: list = []
    todo = [(a, i) for a in archs for i in impls]
    while todo:
        batch = todo[:chunk]
        records, codes = run_case_group(_rank, world, (batch, dtype), timeout, "hf_zoo_")
        got = records[0]
        if len(got) < len(batch):
            arch, impl = batch[len(got)]
            got.append(dict(arch=arch, impl=impl, tp=world, status="crash",
                            detail=f"did not finish within {timeout:.0f} s (a hang or a dead "
                                   f"rank; exit codes {codes})"))
        for r in got:
            print(f"  {r['arch']:<22} {r['impl']:<3} TP {world}: {r['status']:<7} "
                  f"{r['detail']}", flush=True)
        rows += got
        todo = todo[len(got):]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--archs", default=None, help="default: every zoo type")
    parser.add_argument("--set", default="plan", choices=["plan", "no-plan", "multimodal"],
                        help="without --archs: the causal LMs whose config carries a TP plan "
                             "(default), those without one (tpx derives their plans), or the "
                             "image / audio / video to text, multimodal and seq2seq models "
                             "with a plan")
    parser.add_argument("--impls", default="tpx,hf")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/"
                        "hf_zoo.json (hf_zoo_share.json with --share)")
    parser.add_argument("--share", action="store_true",
                        help="instead: each type at its released size on the meta device, "
                             "rank 0 of a simulated TP group (benchmarks/zoo_share.py); --tp "
                             "defaults to 8 there")
    args = parser.parse_args()
    if args.share:
        import zoo_share

        world = args.tp[0] if args.tp != [2, 4] else 8
        rows = zoo_share.run_share(args.archs.split(",") if args.archs else None, world,
                                   args.set)
        print(zoo_share.summary(rows, world))
        payload = dict(command="python benchmarks/hf_zoo.py " + " ".join(sys.argv[1:]),
                       environment=environment(torch.device("cpu"), 1, "fake"),
                       tp=world, results=rows)
        print("wrote", write_json(args.out or str(HERE / "results" / "hf_zoo_share.json"),
                                  payload))
        return
    args.out = args.out or str(HERE / "results" / "hf_zoo.json")
    archs = (args.archs.split(",") if args.archs else
             dict(plan=hf_tiny.zoo_types, multimodal=hf_tiny.multimodal_types,
                  **{"no-plan": hf_tiny.no_plan_types})[args.set]())
    impls = args.impls.split(",")
    accelerate = importlib.util.find_spec("accelerate") is not None
    rows = []
    for world in args.tp:
        print(f"TP {world}:", flush=True)
        rows += run(archs, world, impls, args.timeout, getattr(torch, args.dtype))
    table = []
    for arch in archs:
        cells = [arch]
        for impl in impls:
            for world in args.tp:
                r = next(x for x in rows if (x["arch"], x["impl"], x["tp"]) == (arch, impl, world))
                cells.append(r["status"])
        table.append(cells)
    headers = ["model_type"] + [f"{impl} TP {w}" for impl in impls for w in args.tp]
    print(format_table(headers, table, text_columns=len(headers)))
    for impl in impls:
        for world in args.tp:
            mine = [r for r in rows if (r["impl"], r["tp"]) == (impl, world)]
            counts = {k: sum(r["status"] == k for r in mine)
                      for k in ("pass", "refused", "crash", "wrong", "broken")}
            print(f"{impl} TP {world}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if not accelerate:
        print("from_pretrained(..., tp_plan / distributed_config=...) itself: needs accelerate, "
              "which is not installed")
    import transformers

    payload = dict(
        command="python benchmarks/hf_zoo.py " + " ".join(sys.argv[1:]),
        environment=environment(torch.device("cpu"), max(args.tp), "gloo"),
        transformers=transformers.__version__, accelerate_installed=accelerate,
        from_pretrained_tp=("not exercised: " if accelerate else
                            "ValueError: tp_plan / distributed_config in from_pretrained "
                            "requires accelerate (not installed); ") +
        "the hf rows apply transformers' apply_tensor_parallelism to the built model (what "
        "from_pretrained does after loading)",
        steps=STEPS, dtype=args.dtype, results=rows)
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
