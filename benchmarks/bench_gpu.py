"""One GPU: tpx's CUDA kernels and layer calls against PyTorch on the same device, in one run.

Every section first checks tpx's result against the PyTorch computation on fresh random
inputs, then times the variants round robin (``--rounds`` rounds; CUDA events around each
sample on a GPU, ``time.perf_counter`` on the CPU) and reports medians and ratios taken in this
run. tpx runs on a world-size-1 process group (NCCL on a GPU, gloo on the CPU): the kernels and
layers are the ones a TP rank runs, without a peer.

1. ``ce``: cross-entropy forward + backward (``torch.autograd.grad`` of the mean loss w.r.t. the
   logits), N tokens x V, fp32 and bf16, V = 32000 and 128256, ~3% ``ignore_index``:
   ``torch F.cross_entropy`` vs ``tpx.vocab_parallel_cross_entropy`` (its CUDA kernels) and the
   same with ``inplace_backward=True`` (a fresh copy of the logits per sample, made untimed).
   Extra peak = ``torch.cuda.max_memory_allocated`` during one sample minus the memory
   allocated before it (inputs excluded, returned gradient included).
2. ``lce``: LM head + loss forward + backward (gradients of hidden and weight), bf16, N x d ->
   V: ``unfused`` = ``hidden @ weight.T`` then F.cross_entropy, vs ``tpx.linear_cross_entropy``
   at its default chunk size and at larger ones.
3. ``emb``: embedding lookup (forward) and its weight gradient (forward + backward), bf16 and
   fp32, N ids into a V x D table: ``nn.Embedding`` vs ``tpx.VocabParallelEmbedding`` (its
   kernels; the variant under ``torch.use_deterministic_algorithms`` takes the sorted kernel
   whatever the dtype).
4. ``gemm``: the price of the overlap's pipeline. An all-gather + GEMM at TP W with pipeline
   depth c runs W * c GEMMs of M / (W * c) rows each, writing into one output; a GEMM +
   reduce-scatter likewise. Shapes are one TP-8 rank's GEMMs of Llama-2-7B and Llama-3-70B
   (M = 8192 tokens), bf16: one ``torch.matmul`` (pieces = 1) against 8, 16 and 32 row pieces
   (TP 8, chunks 1, 2 and 4).
5. ``host``: the calling thread's CPU time (``time.thread_time``) per layer call, kernels left
   queued (a GPU runs them asynchronously: this is the host cost that bounds small-batch
   decoding): ``nn.Linear`` vs ``tpx.ColumnParallelLinear`` / ``tpx.RowParallelLinear`` vs
   PyTorch's DTensor TP (``ColwiseParallel`` / ``RowwiseParallel``), bf16, d x d weights, a
   decode call (1 token, ``no_grad``) and a training call (8 tokens, forward + backward).

Run:
    python benchmarks/bench_gpu.py --out bench_gpu.json          # one GPU
    python benchmarks/bench_gpu.py --device cpu --quick           # CPU smoke test, small sizes
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench_loss import extra_peak_mib
from common import environment, format_table, print_env, write_json

SEED, IGNORE = 1234, -100
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BF16 = torch.bfloat16

FULL = dict(ce_tokens=8192, vocabs=(32000, 128256), lce_tokens=8192, lce_d=4096,
            lce_chunks=(1024, 4096, 8192),
            emb_tokens=8192, emb_dim=4096, gemm_m=8192, host_d=4096, rounds=15, host_calls=200)
QUICK = dict(ce_tokens=256, vocabs=(1000, 3001), lce_tokens=256, lce_d=64, lce_chunks=(64,),
             emb_tokens=256, emb_dim=64, gemm_m=256, host_d=64, rounds=3, host_calls=20)
# One TP-8 rank's GEMMs (K, N per rank), M tokens: Llama-2-7B (d 4096, 32 heads, FFN 11008) and
# Llama-3-70B (d 8192, 64 heads of which 8 KV, FFN 28672).
GEMMS = {
    "7B qkv": (4096, 3 * 4096 // 8), "7B o": (4096 // 8, 4096),
    "7B gate+up": (4096, 2 * 11008 // 8), "7B down": (11008 // 8, 4096),
    "70B qkv": (8192, (8192 + 2 * 1024) // 8), "70B o": (8192 // 8, 8192),
    "70B gate+up": (8192, 2 * 28672 // 8), "70B down": (28672 // 8, 8192),
}
QUICK_GEMMS = {"tiny a": (64, 48), "tiny b": (48, 64)}
PIECES = (1, 8, 16, 32)  # 1: one torch.matmul; 8 * c: TP 8 with pipeline depth c


# --- timing ------------------------------------------------------------------------------------

class Timer:
    """Times one call on ``device``: CUDA events on a GPU, perf_counter on the CPU (ms)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, arg):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(arg)
            end.record()
            end.synchronize()
            return start.elapsed_time(end), out
        t0 = time.perf_counter()
        out = fn(arg)
        return (time.perf_counter() - t0) * 1e3, out


def measure(variants: dict, rounds: int, device, reps: int = 3) -> dict:
    """``variants``: {name: (prepare() -> arg, fn(arg))}. Warms each up once, then ``rounds``
    round-robin rounds of ``reps`` samples per variant. Returns {name: record}."""
    timer = Timer(device)
    for prepare, fn in variants.values():
        fn(prepare())
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, (prepare, fn) in variants.items():
            for _ in range(reps):
                arg = prepare()
                ms, out = timer(fn, arg)
                del out
                times[k].append(ms)
    out = {}
    for k, (prepare, fn) in variants.items():
        out[k] = dict(variant=k, median_ms=statistics.median(times[k]), min_ms=min(times[k]),
                      samples=len(times[k]),
                      # device memory only (None on the CPU, where RSS would be noise here)
                      extra_peak_mib=extra_peak_mib(fn, prepare(), device)
                      if device.type == "cuda" else None)
    return out


def ratios(records: dict, base: str) -> list:
    rows = []
    for r in records.values():
        r["time_vs_base"] = r["median_ms"] / records[base]["median_ms"]
        bp = records[base]["extra_peak_mib"]
        r["peak_vs_base"] = (r["extra_peak_mib"] / bp) if r["extra_peak_mib"] is not None and bp \
            else None
        r["base"] = base
        rows.append(r)
    return rows


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = rel_err(got, want)
    if not err <= tol:
        raise SystemExit(f"bench_gpu: {what} differs from the reference: relative error "
                         f"{err:.2e} > {tol:.0e}")
    return err


# --- sections ----------------------------------------------------------------------------------

def _target(n, v, device, gen):
    t = torch.randint(0, v, (n,), generator=gen, device=device)
    t[torch.rand(n, generator=gen, device=device) < 0.03] = IGNORE
    return t


def bench_ce(cfg, args, device, gen) -> list:
    import tpx
    import tpx.nn.functional

    rows = []
    for v in cfg["vocabs"]:
        for dtype in (torch.float32, BF16):
            n = cfg["ce_tokens"]
            base = torch.randn(n, v, generator=gen, device=device).mul_(2).to(dtype)
            target = _target(n, v, device, gen)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            ref_in = base.double().requires_grad_(True)
            ref = F.cross_entropy(ref_in, target, ignore_index=IGNORE)
            ref_grad, = torch.autograd.grad(ref, ref_in)
            del ref_in

            def loss_of(name, x):
                if name.startswith("torch"):
                    return F.cross_entropy(x, target, ignore_index=IGNORE)
                return tpx.vocab_parallel_cross_entropy(x, target, ignore_index=IGNORE,
                                                        vocab_size=v,
                                                        inplace_backward="inplace" in name)

            def fwd_bwd(name):
                return lambda x: torch.autograd.grad(loss_of(name, x), x)

            names = ("torch F.cross_entropy", "tpx", "tpx inplace_backward")
            shared = base.clone().requires_grad_(True)
            fresh = lambda: base.clone().requires_grad_(True)  # noqa: E731
            errs = {}
            for name in names:
                x = fresh()
                loss = loss_of(name, x)
                grad, = torch.autograd.grad(loss, x)
                what = f"ce {name} V={v} {dtype}"
                errs[name] = dict(loss=check(f"{what} loss", loss, ref, tol),
                                  grad=check(f"{what} grad", grad, ref_grad, tol))
                del x, loss, grad
            del ref_grad
            recs = measure({k: (fresh if "inplace" in k else (lambda: shared), fwd_bwd(k))
                            for k in names}, cfg["rounds"], device)
            for r in ratios(recs, names[0]):
                r.update(case=f"N={n} V={v} {str(dtype)[6:]}", rel_err=errs[r["variant"]],
                         logits_gb=n * v * base.element_size() / 1e9)
                rows.append(r)
            del base, shared
    return rows


def bench_lce(cfg, args, device, gen) -> list:
    import tpx
    import tpx.nn.functional

    rows = []
    n, d = cfg["lce_tokens"], cfg["lce_d"]
    for v in cfg["vocabs"]:
        hidden = torch.randn(n, d, generator=gen, device=device).to(BF16)
        weight = (torch.randn(v, d, generator=gen, device=device) / d ** 0.5).to(BF16)
        target = _target(n, v, device, gen)
        h64 = hidden.double().requires_grad_(True)
        w64 = weight.double().requires_grad_(True)
        ref = F.cross_entropy(h64 @ w64.t(), target, ignore_index=IGNORE)
        ref_gh, ref_gw = torch.autograd.grad(ref, (h64, w64))
        del h64, w64

        def unfused(hw):
            h, w = hw
            loss = F.cross_entropy(h @ w.t(), target, ignore_index=IGNORE)
            return (loss,) + torch.autograd.grad(loss, (h, w))

        def fused(chunk_size=None):
            def run(hw):
                h, w = hw
                loss = tpx.linear_cross_entropy(h, w, target, ignore_index=IGNORE, vocab_size=v,
                                                chunk_size=chunk_size)
                return (loss,) + torch.autograd.grad(loss, (h, w))
            return run

        default = tpx.nn.functional.default_chunk_size(v, 1)
        variants = {"unfused": unfused,
                    f"tpx linear_cross_entropy (default chunk_size={default})": fused()}
        for c in cfg["lce_chunks"]:
            if c != default:
                variants[f"tpx linear_cross_entropy chunk_size={c}"] = fused(c)

        pair = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
        errs = {}
        for name, fn in variants.items():
            loss, gh, gw = fn(pair)
            errs[name] = dict(loss=check(f"lce {name} V={v} loss", loss, ref, 1e-2),
                              grad_hidden=check(f"lce {name} V={v} grad hidden", gh, ref_gh, 2e-2),
                              grad_weight=check(f"lce {name} V={v} grad weight", gw, ref_gw, 2e-2))
            del loss, gh, gw
        recs = measure({k: (lambda: pair, fn) for k, fn in variants.items()}, cfg["rounds"],
                       device)
        for r in ratios(recs, "unfused"):
            r.update(case=f"N={n} d={d} V={v} bf16", rel_err=errs[r["variant"]])
            rows.append(r)
        del hidden, weight, pair, ref_gh, ref_gw
    return rows


def bench_emb(cfg, args, device, gen) -> list:
    import tpx

    rows = []
    v, d, n = cfg["vocabs"][-1], cfg["emb_dim"], cfg["emb_tokens"]
    for dtype in (BF16, torch.float32):
        torch.manual_seed(SEED)
        ref = nn.Embedding(v, d, device=device, dtype=dtype)
        emb = tpx.VocabParallelEmbedding.from_embedding(ref)
        ids = torch.randint(0, v, (n,), generator=gen, device=device)
        gy = torch.randn(n, d, generator=gen, device=device).to(dtype)
        if not torch.equal(emb(ids).detach(), ref(ids).detach()):
            raise SystemExit("bench_gpu: tpx embedding forward differs from nn.Embedding")
        w64 = ref.weight.detach().double().requires_grad_(True)
        F.embedding(ids, w64).backward(gy.double())
        tol = 1e-2 if dtype == BF16 else 1e-5

        def fwd_bwd(m):
            m.weight.grad = None
            m(ids).backward(gy)
            return m.weight.grad

        def fwd(m):
            with torch.no_grad():
                return m(ids)

        def fwd_bwd_deterministic(m):
            was = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                return fwd_bwd(m)
            finally:
                torch.use_deterministic_algorithms(was)

        names = ("nn.Embedding", "tpx VocabParallelEmbedding",
                 "tpx VocabParallelEmbedding (deterministic)")
        err = {}
        for name, m, step in zip(names, (ref, emb, emb), (fwd_bwd, fwd_bwd, fwd_bwd_deterministic)):
            g = step(m)
            err[name] = check(f"embedding {name} {dtype} grad",
                              g.to_local() if hasattr(g, "to_local") else g, w64.grad, tol)
        for what, fn in (("lookup (no_grad)", fwd), ("lookup + weight grad", fwd_bwd)):
            variants = {names[0]: (lambda: ref, fn), names[1]: (lambda: emb, fn)}
            if fn is fwd_bwd:  # tpx's other kernel: the sorted one under deterministic mode
                variants[names[2]] = (lambda: emb, fwd_bwd_deterministic)
            recs = measure(variants, cfg["rounds"], device)
            for r in ratios(recs, names[0]):
                r.update(case=f"{what} N={n} V={v} D={d} {str(dtype)[6:]}",
                         rel_err=err[r["variant"]] if "grad" in what else 0.0)
                rows.append(r)
        del ref, emb, w64
    return rows


def bench_gemm(cfg, args, device, gen) -> list:
    rows = []
    m = cfg["gemm_m"]
    dtype = BF16 if device.type == "cuda" else torch.float32
    for name, (k, n) in (GEMMS if not args.quick else QUICK_GEMMS).items():
        a = (torch.randn(m, k, generator=gen, device=device) / k ** 0.5).to(dtype)
        b = torch.randn(k, n, generator=gen, device=device).to(dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        want = torch.matmul(a.double(), b.double())

        def pieces_fn(p):
            if p == 1:
                return lambda _: torch.matmul(a, b)

            def run(_):
                lo = 0
                for i in range(p):
                    hi = lo + m // p + (i < m % p)
                    torch.matmul(a[lo:hi], b, out=out[lo:hi])
                    lo = hi
                return out
            return run

        variants = {}
        for p in PIECES:
            out.fill_(float("nan"))
            check(f"gemm {name} pieces={p}", pieces_fn(p)(None), want,
                  1e-2 if dtype == BF16 else 1e-5)
            variants[f"pieces={p}"] = (lambda: None, pieces_fn(p))
        recs = measure(variants, cfg["rounds"], device, reps=5)
        for r in ratios(recs, "pieces=1"):
            r.update(case=f"{name} M={m} K={k} N={n} {str(dtype)[6:]}",
                     tflops=2 * m * k * n / r["median_ms"] / 1e9)
            rows.append(r)
    return rows


def bench_host(cfg, args, device, gen) -> list:
    import tpx
    import tpx.nn.functional
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    d, calls = cfg["host_d"], cfg["host_calls"]
    dtype = BF16 if device.type == "cuda" else torch.float32
    torch.manual_seed(SEED)
    lin = nn.Linear(d, d, bias=False, device=device, dtype=dtype)
    mesh = init_device_mesh(device.type, (1,))
    layers = {
        "nn.Linear": lin,
        "tpx ColumnParallelLinear": tpx.ColumnParallelLinear.from_linear(lin),
        "tpx RowParallelLinear": tpx.RowParallelLinear.from_linear(lin),
        "DTensor ColwiseParallel": parallelize_module(copy.deepcopy(lin), mesh, ColwiseParallel()),
        "DTensor RowwiseParallel": parallelize_module(copy.deepcopy(lin), mesh, RowwiseParallel()),
    }
    x1 = torch.randn(1, 1, d, generator=gen, device=device).to(dtype)
    x8 = torch.randn(1, 8, d, generator=gen, device=device).to(dtype)
    want = lin(x8).detach()
    unavailable = []
    for name, layer in list(layers.items()):
        try:
            got = layer(x8)
            if name.startswith("DTensor"):  # PyTorch's TP: its backward must run too
                (got.to_local() if hasattr(got, "to_local") else got).sum().backward()
        except Exception as e:  # noqa: BLE001 - PyTorch's TP on an older torch: reported
            if not name.startswith("DTensor"):
                raise
            del layers[name]
            unavailable.append(dict(case="host", variant=name,
                                    skipped=f"{type(e).__name__}: {str(e)[:200]}"))
            print(f"{name}: not measured, PyTorch's TP failed on torch {torch.__version__}: "
                  f"{type(e).__name__}: {str(e)[:200]}")
            continue
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        check(f"host {name} forward", got, want, 1e-2 if dtype == BF16 else 1e-5)

    def decode(layer):
        with torch.no_grad():
            for _ in range(calls):
                layer(x1)

    def train(layer):
        for _ in range(calls):
            layer.zero_grad(set_to_none=True)
            y = layer(x8)
            y = y.to_local() if hasattr(y, "to_local") else y
            y.sum().backward()

    rows = []
    for what, fn in (("decode: 1 token, no_grad forward", decode),
                     ("train: 8 tokens, forward + backward", train)):
        for layer in layers.values():  # warm-up
            fn(layer)
        times = {k: [] for k in layers}
        for _ in range(cfg["rounds"] * 2):
            for k, layer in layers.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.thread_time()
                fn(layer)
                times[k].append((time.thread_time() - t0) / calls * 1e6)
        base = statistics.median(times["nn.Linear"])
        for k, t in times.items():
            med = statistics.median(t)
            rows.append(dict(case=f"{what}, d={d} {str(dtype)[6:]}", variant=k, median_us=med,
                             min_us=min(t), samples=len(t), time_vs_base=med / base,
                             base="nn.Linear"))
    return rows + unavailable


SECTIONS = {"ce": bench_ce, "lce": bench_lce, "emb": bench_emb, "gemm": bench_gemm,
            "host": bench_host}


def report(name: str, rows: list) -> None:
    fmt = lambda v, p=3: "" if v is None else f"{v:.{p}f}"  # noqa: E731
    if name == "host":
        print(format_table(["case", "variant", "median us/call", "min us/call", "vs nn.Linear"],
                           [[r["case"], r["variant"], fmt(r["median_us"], 1), fmt(r["min_us"], 1),
                             fmt(r["time_vs_base"], 2)] for r in rows if "skipped" not in r],
                           text_columns=2))
        return
    extra = "TFLOP/s" if name == "gemm" else "extra peak MiB"
    print(format_table(
        ["case", "variant", "median ms", "min ms", "vs base", extra, "peak vs base"],
        [[r["case"], r["variant"], fmt(r["median_ms"]), fmt(r["min_ms"]),
          fmt(r["time_vs_base"]),
          fmt(r["tflops"], 1) if name == "gemm" else fmt(r["extra_peak_mib"], 1),
          "" if name == "gemm" else fmt(r["peak_vs_base"], 3)] for r in rows], text_columns=2))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {list(SECTIONS)}")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {list(SECTIONS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu: --device cuda but torch sees no GPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds:
        cfg["rounds"] = args.rounds
    tmp = tempfile.mkdtemp(prefix="bench_gpu_")
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        env = environment(device, 1, backend)
        print_env(env)
        gen = torch.Generator(device).manual_seed(SEED)
        results, failed = {}, {}
        for name in sections:
            print(f"\n== {name}", flush=True)
            t0 = time.perf_counter()
            try:
                results[name] = SECTIONS[name](cfg, args, device, gen)
            except SystemExit as e:  # a failed correctness check: the other sections still run
                failed[name] = str(e)
                print(f"FAILED: {e}", flush=True)
                continue
            report(name, results[name])
            print(f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        path = Path(args.out or RESULTS_DIR / f"bench_gpu_{device.type}.json")
        payload = dict(benchmark="bench_gpu: tpx's kernels and layer calls against PyTorch, one "
                                 "device", config=dict(vars(args), sizes=cfg, seed=SEED),
                       environment=env, results=results, failed=failed)
        print(f"\nwrote {write_json(path, payload)}")
        if failed:
            raise SystemExit(f"bench_gpu: correctness checks failed in {sorted(failed)}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
