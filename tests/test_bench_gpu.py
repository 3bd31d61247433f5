"""benchmarks/bench_gpu.py (the single-GPU benchmark) runs its correctness checks and every
section at small sizes on the CPU, so that a GPU run does not fail on the script itself."""

import json
import os
import sys

from harness import run_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_gpu_quick_on_cpu(tmp_path):
    out = tmp_path / "bench_gpu.json"
    r = run_command([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"),
                     "--device", "cpu", "--quick", "--rounds", "1", "--out", str(out)],
                    timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failed"] == {}
    assert set(data["results"]) == {"ce", "lce", "emb", "gemm", "host"}
    for name, rows in data["results"].items():
        assert rows, name
        for row in rows:  # every timed variant was first checked against torch
            assert "skipped" in row or row["time_vs_base"] > 0, (name, row)
    host = data["results"]["host"]
    measured = {r["variant"] for r in host if "skipped" not in r}
    assert {"nn.Linear", "tpx ColumnParallelLinear", "tpx RowParallelLinear"} <= measured
    # PyTorch's TP beside them, measured or (on an older torch where it fails) said so
    assert {"DTensor ColwiseParallel", "DTensor RowwiseParallel"} <= {r["variant"] for r in host}
