"""benchmarks/hf_zoo.py: tpx's plans and transformers' own TP over the zoo of causal LMs that
ship a TP plan (``hf_tiny.zoo_types()``: transformers' registry). ``make test`` runs a cheap
subset (two layouts tpx once read wrong, one it could not take, and Llama; three read from
``save_pretrained`` files by ``tpx.from_pretrained``; two multimodal models); ``make
test-slow`` runs tpx over the whole zoo at TP 2, sharded in memory and loaded from files, and
requires that no type is silently wrong or crashes: each trains equal to one device or is
refused by tpx with an error that says so; and the same for the models that ship no plan,
through derived plans, and for the multimodal, audio and seq2seq models with a plan."""

import json
import sys
from pathlib import Path

import pytest

from harness import run_command

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _zoo(tmp_path, *args, timeout):
    out = tmp_path / "zoo.json"
    r = run_command([sys.executable, str(ROOT / "benchmarks" / "hf_zoo.py"), *args,
                     "--out", str(out)], timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())["results"]


def test_zoo_subset(tmp_path):
    import hf_tiny

    # an older transformers (as on torch 2.5) lacks CodeGen's plan: the others still run
    archs = [a for a in ["llama", "codegen", "apertus", "granite_swa"]
             if a == "llama" or hf_tiny.no_tp_plan(a) is None]
    # transformers' own TP as the benchmark applies it (5.19 and later; not 5.18)
    impls = ["tpx"] + (["hf"] if hasattr(hf_tiny.transformers.PreTrainedModel,
                                         "_resolve_parallel_plans") else [])
    rows = _zoo(tmp_path, "--tp", "2", "--archs", ",".join(archs), "--impls", ",".join(impls),
                "--timeout", "240", timeout=900)
    got = {(r["arch"], r["impl"]): r for r in rows}
    assert set(got) == {(a, i) for a in archs for i in impls}
    for a in archs:
        assert got[(a, "tpx")]["status"] == "pass", got[(a, "tpx")]
    # transformers' own TP trains Apertus' activation parameters on each rank's half only.
    if "apertus" in archs and "hf" in impls:
        assert got[("apertus", "hf")]["status"] == "wrong", got[("apertus", "hf")]


@pytest.mark.slow
def test_zoo_load_subset(tmp_path):
    # written by transformers, read by tpx.from_pretrained at TP 2 (an MoE in the per-expert
    # layout, a layer kept by a PyTorch style, a dense model), trained, written back (the fast
    # tier loads these layouts in test_pretrained.py)
    import hf_tiny

    archs = [a for a in ["llama", "qwen3_moe", "granite_swa"]
             if a == "llama" or hf_tiny.no_tp_plan(a) is None]
    rows = _zoo(tmp_path, "--tp", "2", "--archs", ",".join(archs), "--impls", "tpx-load",
                "--timeout", "240", timeout=900)
    assert {r["arch"]: r["status"] for r in rows} == {a: "pass" for a in archs}, rows


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["tpx", "tpx-load"])
def test_whole_zoo_never_silently_wrong(tmp_path, impl):
    import hf_tiny

    rows = _zoo(tmp_path, "--tp", "2", "--impls", impl, "--timeout", "300", timeout=3600)
    assert sorted(r["arch"] for r in rows) == sorted(hf_tiny.zoo_types())
    # "broken": the unsharded model fails on its own, as two of transformers 5.18's do on
    # torch 2.5 (a rope table of the tiny config, an int32 scatter index)
    from torch_compat import TORCH_VERSION

    ok = ("pass", "refused") + (("broken",) if TORCH_VERSION < (2, 6) else ())
    bad = [r for r in rows if r["status"] not in ok]
    assert not bad, json.dumps(bad, indent=1)
    assert all(r["detail"].split(": ", 1)[1].startswith("tpx") for r in rows
               if r["status"] == "refused")


def _whole_set(tmp_path, which: str, types: list, at_least: int) -> None:
    """``hf_zoo.py --set which`` with tpx at TP 2: every type of ``types`` trains equal to one
    device or is refused by tpx naming the module, never silently wrong or crashing
    ("broken": the unsharded tiny model fails on its own); at least ``at_least`` pass."""
    rows = _zoo(tmp_path, "--tp", "2", "--set", which, "--impls", "tpx", "--timeout", "300",
                timeout=3600)
    assert sorted(r["arch"] for r in rows) == sorted(types)
    bad = [r for r in rows if r["status"] not in ("pass", "refused", "broken")]
    assert not bad, json.dumps(bad, indent=1)
    assert all(r["detail"].split(": ", 1)[1].startswith("tpx") for r in rows
               if r["status"] == "refused")
    assert sum(r["status"] == "pass" for r in rows) >= at_least, rows


@pytest.mark.slow
def test_models_without_a_plan_never_silently_wrong(tmp_path):
    # every causal LM whose config ships no TP plan, through the plan tpx derives and proves
    # ("broken": 9 of transformers 5.24's 68)
    import hf_tiny

    _whole_set(tmp_path, "no-plan", hf_tiny.no_plan_types(), 50)


def test_multimodal_zoo_subset(tmp_path):
    # built by their task's auto class: LLaVA with a tiny image through its vision tower,
    # T5Gemma 2 (encoder-decoder, embeddings with their own forward kept whole)
    import hf_tiny

    archs = [a for a in ["llava", "t5gemma2"] if hf_tiny.no_tp_plan(a) is None]
    if not archs:
        pytest.skip(f"transformers {hf_tiny.transformers.__version__} ships no plan for them")
    rows = _zoo(tmp_path, "--tp", "2", "--archs", ",".join(archs), "--impls", "tpx",
                "--timeout", "240", timeout=900)
    assert {r["arch"]: r["status"] for r in rows} == {a: "pass" for a in archs}, rows
    if "llava" in archs:
        assert next(r for r in rows if r["arch"] == "llava")["inputs"] == "text and an image"


@pytest.mark.slow
def test_multimodal_zoo_never_silently_wrong(tmp_path):
    # every image / audio / video to text, multimodal-LM and seq2seq type with a plan (and
    # the causal LMs whose plan is in their text config)
    import hf_tiny

    _whole_set(tmp_path, "multimodal", hf_tiny.multimodal_types(), 60)


@pytest.mark.slow
def test_gemma4_at_tp4(tmp_path):
    # Gemma 4's full-attention layers have twice the head_dim of the others; at TP 4 their
    # replicated KV heads were split in the first layer's head size (a crash). float64, as the
    # zoo runs (in float32 an AdamW step turns rounding noise into differences near 2e-5).
    rows = _zoo(tmp_path, "--tp", "4", "--archs", "gemma4_text", "--impls", "tpx",
                "--timeout", "240", timeout=900)
    assert [r["status"] for r in rows] == ["pass"], rows



def test_case_records_read_while_written(tmp_path):
    """The benchmarks' ranks read each other's record files while a peer appends to them: a
    line still being written is not a record yet (reading it once crashed a rank)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import append_jsonl, read_jsonl

    path = tmp_path / "rank0.jsonl"
    assert read_jsonl(path) == []
    first = dict(status="pass", detail="x" * 20000)  # longer than a file buffer
    append_jsonl(path, first)
    with open(path, "a") as f:
        f.write('{"status": "cra')  # a peer caught in the middle of its write
    assert read_jsonl(path) == [first]
    with open(path, "a") as f:
        f.write('sh"}\n')
    assert read_jsonl(path) == [first, {"status": "crash"}]
