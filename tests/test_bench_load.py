"""benchmarks/bench_load.py runs end to end (tiny size): every way of loading is checked
against the one-device model's logits, every way of saving by reading the directory back on
one device, and both are measured."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_load_tiny(tmp_path):
    out = tmp_path / "load.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_load.py"),
                    "--size", "tiny", "--tp", "2", "--methods", "tpx", "whole-then-shard",
                    "--out", str(out)], check=True, timeout=600, cwd=ROOT)
    records = json.loads(out.read_text())["results"]
    assert {(r["model"], r["method"]) for r in records} == {
        (m, k) for m in ("llama", "moe") for k in ("tpx", "whole-then-shard")}
    for r in records:
        assert r["status"] == "ok" and r["save_status"] == "ok", r
        assert r["part_bytes"] > 0 and r["seconds"] > 0 and r["peak_bytes"] >= 0
