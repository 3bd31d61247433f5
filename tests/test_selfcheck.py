"""`python -m tpx.selfcheck` as a user runs it: one process (world size 1) and two ranks under
torch.distributed.run, checking the exit status, the table and the JSON; and a planted
mismatch (a wrong reference) must make it exit non-zero and name the failing checks."""

import json
import os
import sys

import torch

import tpx
from harness import run_command

TIMEOUT = float(os.environ.get("TPX_TEST_TIMEOUT", "240"))

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "replicated_matmul",
       "vocab_parallel_cross_entropy_rows", "vocab_parallel_embedding",
       "linear_cross_entropy_rows"]
LAYERS = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
          "ColumnParallelEmbedding", "VocabParallelCrossEntropyLoss", "linear_cross_entropy"]


def _run(args, tmp_path, env=None):
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return run_command([sys.executable, *args], cwd=tmp_path, env=full_env, timeout=TIMEOUT)


def _check_report(proc, path, world):
    assert proc.returncode == 0, f"selfcheck failed:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    report = json.loads(path.read_text())
    assert report["ok"] is True
    env = report["environment"]
    assert env["world_size"] == world
    assert env["tpx"] == tpx.__version__
    assert env["torch"] == torch.__version__
    assert env["tpx_build"]["cuda"] == tpx.build_info()["cuda"]
    checks = report["checks"]
    assert checks and all(c["status"] == "pass" for c in checks), checks
    names = [c["check"] for c in checks]
    for op in OPS + LAYERS:
        assert any(n.split()[0] == op for n in names), f"{op} was not checked: {names}"
    sections = {c["section"] for c in checks}
    assert f"op (world {world})" in sections and f"layer (world {world})" in sections
    # Every check compared numbers: a max error is reported for each one.
    assert all(c["max_err"] is not None and c["tol"] for c in checks)
    # The table names every check, and the summary line counts them.
    for c in checks:
        assert c["check"] in out
    assert f"OK: {len(checks)} passed, 0 failed" in out
    assert f"world size {world}" in out
    assert f"tpx {tpx.__version__}" in out and f"torch {torch.__version__}" in out
    if not torch.cuda.is_available():
        assert "no GPU found: CUDA kernels not checked" in out
        assert report["cuda_kernels_checked"] is False
        assert env["backend"] == "gloo" and env["gpus"] == []
        assert not any(c["section"].startswith("CUDA kernel") for c in checks)
        assert "communication overlap not measured" in out
    return report


def test_selfcheck_single_process(tmp_path):
    path = tmp_path / "selfcheck.json"
    proc = _run(["-m", "tpx.selfcheck", "--json", str(path)], tmp_path)
    _check_report(proc, path, world=1)


def test_selfcheck_two_ranks_torchrun(tmp_path):
    path = tmp_path / "selfcheck.json"
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "tpx.selfcheck", "--json", str(path)], tmp_path)
    report = _check_report(proc, path, world=2)
    # Only rank 0 prints the table.
    assert proc.stdout.count("OK: ") == 1, proc.stdout
    assert report["environment"]["world_size"] == 2


_PLANT = """
import sys
import torch.nn.functional as F
import tpx.selfcheck

_ce = F.cross_entropy
def wrong_cross_entropy(*args, **kwargs):
    return _ce(*args, **kwargs) * 1.001
F.cross_entropy = wrong_cross_entropy
sys.exit(tpx.selfcheck.main(sys.argv[1:]))
"""


def test_selfcheck_fails_on_mismatch(tmp_path):
    """A reference off by 0.1%: the checks that compare a cross-entropy fail, the others pass,
    and the exit status is 1."""
    path = tmp_path / "selfcheck.json"
    proc = _run(["-c", _PLANT, "--json", str(path), "--seed", "3"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    assert report["ok"] is False and report["seed"] == 3
    status = {c["check"]: c["status"] for c in report["checks"]}
    for name in ("vocab_parallel_cross_entropy_rows", "linear_cross_entropy_rows",
                 "VocabParallelCrossEntropyLoss", "linear_cross_entropy"):
        assert status[name] == "FAIL", (name, status)
    for name in ("all_gather_matmul chunks=1", "matmul_reduce_scatter chunks=default",
                 "vocab_parallel_embedding", "RowParallelLinear", "MLP column -> GELU -> row"):
        assert status[name] == "pass", (name, status)
    assert "MISMATCH" in proc.stdout
    assert "FAIL op (world 1) / vocab_parallel_cross_entropy_rows" in proc.stdout


def _kernel_checks_on_cpu(rank, world):
    import torch.distributed as dist

    import tpx.selfcheck as sc
    from tpx.selfcheck.kernels import kernel_checks

    # The bandwidth timings need a GPU; the numerics run through the ATen path.
    rep = sc.Report()
    kernel_checks(rep, sc.Inputs(17, torch.device("cpu")), dist.group.WORLD, "cpu", KERNEL_OPS,
                  bandwidth=False)
    failed = [r for r in rep.rows if r["status"] != "pass"]
    assert not failed, sc.format_table(failed)
    checked = {r["check"].split()[0] for r in rep.rows}
    assert checked == set(KERNEL_OPS), checked
    assert all(r["max_err"] is not None for r in rep.rows)


KERNEL_OPS = ["vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_backward",
              "vocab_parallel_cross_entropy_backward_", "vocab_parallel_embedding",
              "vocab_parallel_embedding_backward", "linear_cross_entropy",
              "linear_cross_entropy_backward"]


def test_kernel_checks_run_on_cpu_tensors():
    """The GPU branch's kernel checks, run on CPU tensors (the ATen path): their inputs and
    references are right, so on a GPU a FAIL means the kernel differs from ATen. The list of
    kernels is the one a CUDA build reports."""
    from harness import run_ranks

    if tpx.build_info()["cuda"]:
        assert set(tpx.build_info()["cuda_kernels"]) == set(KERNEL_OPS)
    run_ranks(_kernel_checks_on_cpu, 1)
