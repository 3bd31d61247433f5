"""Runs every benchmark this machine can run and writes a markdown report with plots.

    python benchmarks/run_all.py              # run the benchmarks, then write the report
    python benchmarks/run_all.py --no-run     # only rebuild the report from results/*.json

CPU benchmarks always run (TP=2 over gloo); the single-GPU variants run when torch sees a
GPU. Each benchmark writes its JSON under benchmarks/results/; the report is
benchmarks/results/REPORT.md with its plots next to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def run(cmd):
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def table(rows, columns):
    head = "| " + " | ".join(c for c, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def num(key, digits=2):
    return lambda r: "" if r.get(key) is None else f"{r[key]:.{digits}f}"


def plot_linear(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = data["shapes"] if isinstance(data.get("shapes"), list) else list(data["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6))
    axes = axes if len(shapes) > 1 else [axes]
    for ax, shape in zip(axes, shapes):
        rows = [r for r in data["results"] if r["shape"] == shape
                and r["variant"] != "single process"]
        ax.barh([r["variant"] for r in rows], [r["median_ms"] for r in rows], color="tab:blue")
        ideal = rows[0]["ideal_ms"]
        ax.axvline(ideal, color="tab:green", ls="--", label=f"ideal (1 process / TP) {ideal:.1f} ms")
        ax.set(title=f"MLP fwd+bwd, {shape}", xlabel="median ms (lower is better)")
        ax.invert_yaxis()
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_loss(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["results"]["cross_entropy"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    names = [r["variant"] for r in rows]
    a.barh(names, [r["median_ms"] for r in rows], color="tab:blue")
    a.set(title="cross-entropy fwd+bwd time", xlabel="median ms")
    b.barh(names, [r["extra_peak_mib"] or 0 for r in rows], color="tab:orange")
    b.set(title="extra peak memory", xlabel="MiB")
    for ax in (a, b):
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report():
    lines = ["# tpx benchmark report", "",
             f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, "
             f"torch {torch.__version__}, GPU: "
             f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}.", ""]
    linear = load("bench_linear_cpu_tp2.json")
    if linear:
        plot_linear(linear, RESULTS / "bench_linear.png")
        lines += ["## MLP block (column -> ReLU -> row), CPU, TP=2 over gloo", "",
                  "`python benchmarks/bench_linear.py`", "",
                  table(linear["results"], [
                      ("shape", lambda r: r["shape"]), ("variant", lambda r: r["variant"]),
                      ("median ms", num("median_ms")), ("min ms", num("min_ms")),
                      ("vs DTensor", num("vs_dtensor")), ("vs ideal", num("vs_ideal")),
                      ("vs chunks=1", num("vs_tpx_chunks1"))]),
                  "", "![MLP block](bench_linear.png)", ""]
    for size in ("small", "large"):
        sit = load(f"bench_linear_situations_cpu_tp2_{size}.json")
        if sit:
            lines += [f"## Situations (train / frozen weights / no input gradient), {size} shape, "
                      "CPU, TP=2 over gloo", "",
                      f"`python benchmarks/bench_linear.py --situations train,frozen,no-xgrad "
                      f"--shapes {size} --repeats {sit['config']['repeats']}"
                      f"{' --gloo-threads' if sit['config'].get('gloo_threads') else ''}`", "",
                      table(sit["results"], [
                          ("situation", lambda r: r["situation"]),
                          ("tpx ms", num("tpx_median_ms")),
                          ("DTensor ms", num("dtensor_median_ms")),
                          ("GEMMs alone ms", num("gemm_floor_median_ms")),
                          ("tpx/DTensor", num("ratio_median")),
                          ("ratio IQR", lambda r: f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}"),
                          ("floor/DTensor", num("floor_over_dtensor"))]), ""]
            split = [r for r in sit["results"] if "tpx_aten_gemm_median_ms" in r]
            if split:
                lines += [f"tpx's CPU GEMM here: `{split[0]['cpu_gemm']}`; the same tpx model "
                          "with `TPX_CPU_GEMM=aten`, and the step's GEMMs alone through tpx's "
                          "GEMM, in the same rounds:", "",
                          table(split, [
                              ("situation", lambda r: r["situation"]),
                              ("tpx, ATen GEMMs ms", num("tpx_aten_gemm_median_ms")),
                              ("GEMMs alone, tpx GEMM ms", num("tpx_gemm_floor_median_ms")),
                              ("tpx ATen-GEMMs/DTensor", num("tpx_aten_gemm_over_dtensor")),
                              ("tpx-GEMM floor/DTensor", num("tpx_gemm_floor_over_dtensor")),
                              ("tpx/tpx-GEMM floor", num("tpx_over_tpx_gemm_floor"))]), ""]
            other = [r for r in sit["results"] if "ratio_other_threads" in r]
            if other:
                lines += ["With gloo's event-loop threads as gloo starts them (`SCHED_OTHER`), in "
                          "the same rounds: both libraries, and tpx as it runs against DTensor "
                          "in a process without tpx:", "",
                          table(other, [
                              ("situation", lambda r: r["situation"]),
                              ("tpx ms", num("tpx_other_threads_median_ms")),
                              ("DTensor ms", num("dtensor_other_threads_median_ms")),
                              ("tpx/DTensor", num("ratio_other_threads")),
                              ("tpx (SCHED_BATCH) / DTensor (SCHED_OTHER)",
                               num("tpx_over_dtensor_other_threads"))]), ""]
    coll = load("bench_collectives_cpu_tp2.json")
    if coll:
        lines += ["## Sum over a two-rank gloo group: tpx's exchange against gloo's all-reduce",
                  "", "`python benchmarks/bench_collectives.py` (each call after "
                  f"{coll['config'].get('busy_us', 0):.0f} us of busy work)", "",
                  table(coll["results"], [
                      ("size KiB", lambda r: str(r["size_kib"])),
                      ("variant", lambda r: r["variant"]), ("median us", num("median_us", 0)),
                      ("min us", num("min_us", 0)),
                      ("vs gloo all-reduce", num("ratio_vs_gloo"))]), ""]
    loss = load("bench_loss_cpu_tp2.json")
    if loss:
        plot_loss(loss, RESULTS / "bench_loss.png")
        res = loss["results"]
        lines += ["## Vocab-parallel cross-entropy, CPU, TP=2 over gloo", "",
                  "`python benchmarks/bench_loss.py`", "",
                  table(res["cross_entropy"], [
                      ("variant", lambda r: r["variant"]), ("median ms", num("median_ms")),
                      ("extra peak MiB", num("extra_peak_mib", 1)),
                      ("time vs loss_parallel", num("time_vs_loss_parallel")),
                      ("peak vs loss_parallel", num("peak_vs_loss_parallel", 3))]),
                  "", "![loss](bench_loss.png)", "",
                  "### Fused LM head + loss", "",
                  table(res["lm_head_loss"], [
                      ("variant", lambda r: r["variant"]), ("median ms", num("median_ms")),
                      ("extra peak MiB", num("extra_peak_mib", 1)),
                      ("time vs unfused", num("time_vs_unfused")),
                      ("peak vs unfused", num("peak_vs_unfused", 3))]), ""]
    for name in sorted(RESULTS.glob("bench_*_cuda*.json")):
        lines += [f"## {name.stem}", "", "```json", name.read_text()[:4000], "```", ""]
    out = RESULTS / "REPORT.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-run", action="store_true", help="only rebuild the report")
    args = p.parse_args()
    if not args.no_run:
        py = sys.executable
        run([py, str(HERE / "bench_linear.py")])
        for size, repeats in (("small", "100"), ("large", "40")):
            run([py, str(HERE / "bench_linear.py"), "--situations", "train,frozen,no-xgrad",
                 "--shapes", size, "--repeats", repeats, "--gloo-threads", "--out",
                 str(RESULTS / f"bench_linear_situations_cpu_tp2_{size}.json")])
        run([py, str(HERE / "bench_collectives.py")])
        run([py, str(HERE / "bench_loss.py")])
        if torch.cuda.is_available():
            run([py, str(HERE / "bench_linear.py"), "--device", "cuda"])
            run([py, str(HERE / "bench_loss.py"), "--device", "cuda"])
            run([py, str(HERE / "bench_gpu.py")])
    report()


if __name__ == "__main__":
    main()
