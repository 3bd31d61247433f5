"""Host CPU time per call: tpx against plain ``nn.Linear`` and PyTorch's DTensor tensor
parallelism, at TP 2 over gloo on the CPU.

What is measured is the CPU time of the calling thread (``time.thread_time``) spent inside one
call, so time spent waiting for the other rank is not counted: the numbers are the Python,
dispatch and bookkeeping cost each library adds on the host, plus the compute itself (one
intra-op thread per rank). The CPU time of the whole process (``time.process_time``: also
gloo's threads and any worker thread) is recorded next to it.

Cases (fp32, every variant built from the same seeded module, so every rank starts alike):

* ``mlp fwd``      ``nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))`` on an
                   input of 8 tokens x 64, forward under ``torch.no_grad()``;
* ``mlp fwd+bwd``  the same block, forward and ``out.sum().backward()`` (the input needs no
                   gradient; gradients are set to None between calls, outside the timed part);
* ``llama train``  a small Hugging Face Llama (vocabulary 1003, hidden 64, MLP 88, 2 layers,
                   8 query / 2 key-value heads): one training step on 2 x 16 tokens -- forward
                   with labels, ``loss.backward()``, an SGD step and ``zero_grad``;
* ``embedding``    ``nn.Embedding(32000, 256)``: a lookup of 8 ids (a decode step of a batch
                   of 8) under ``torch.no_grad()``;
* ``llama decode`` the same model, one token of a greedy loop with a KV cache
                   (``model(input_ids=last_token, past_key_values=cache, use_cache=True)`` under
                   ``torch.no_grad()`` and the argmax), 16 tokens after an 8-token prompt; the
                   prompt's forward is not timed.

Variants of each case:

* ``unsharded``    the whole module on every rank, no communication (``nn.Linear``);
* ``tpx``          ``tpx.parallelize_module(module, None, plan)``: for the MLP
                   ``{"0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel()}``, for the
                   embedding ``RowwiseParallel(input_layouts=Replicate())`` (its vocabulary
                   split), for Llama ``tpx.plans.auto(model)``;
* ``local + all-reduce`` (MLP only) the least any TP 2 over gloo can cost: this rank's
                   shards as plain parameters, ``F.linear`` -> ReLU -> ``F.linear`` and one
                   ``torch.distributed.all_reduce`` of the output (identity backward), no
                   checks, no ``DTensor``;
* ``PyTorch TP``   ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D CPU
                   DeviceMesh: for the MLP the same plan with torch's styles; for Llama
                   transformers' own ``base_model_tp_plan`` (q, k, v, gate, up column-wise;
                   o, down row-wise) written with torch's ``ColwiseParallel`` /
                   ``RowwiseParallel``, the embedding, norms and LM head left replicated.

Before any timing, the outputs of tpx and PyTorch TP are checked against the unsharded
module's: the MLP's output (rtol = atol = 1e-5), Llama's logits and loss, and the logits of a
few decode steps fed the same tokens (rtol 1e-4, atol 2e-5).

Timing: after ``--warmup`` untimed calls of every variant, ``--rounds`` rounds; in each round
every variant makes its ``--iters`` calls back to back (for decode: ``--iters`` generated
sequences), the order of the variants rotated from round to round. Every call is timed on
its own; the table shows the median per call over all rounds, in microseconds, on rank 0 and
the maximum of the ranks' medians, and each variant's ratio to ``unsharded`` (rank 0).

    torchrun --nproc-per-node 2 benchmarks/bench_host.py [--rounds 30] [--iters N]
    python benchmarks/bench_host.py          # the same, the 2 ranks spawned here

prints the table and writes ``benchmarks/results/bench_host_cpu_tp2.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common import environment, format_table, print_env, spawn_ranks, write_json

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEED = 1234
MLP_SHAPE = dict(tokens=8, d=64, h=256)
LLAMA_CONFIG = dict(vocab_size=1003, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                    tie_word_embeddings=False)
TRAIN_BATCH, TRAIN_SEQ = 2, 16
PROMPT, NEW_TOKENS = 8, 16
MLP_TOL = dict(rtol=1e-5, atol=1e-5)
LLAMA_TOL = dict(rtol=1e-4, atol=2e-5)
CASES = ("mlp fwd", "mlp fwd+bwd", "embedding", "llama train", "llama decode")
# Calls per variant per round (decode: generated sequences) and untimed warmup calls, per case.
ITERS = {"mlp fwd": 40, "mlp fwd+bwd": 40, "embedding": 40, "llama train": 5, "llama decode": 1}
WARMUP = {"mlp fwd": 20, "mlp fwd+bwd": 20, "embedding": 20, "llama train": 3,
          "llama decode": 1}
EMBEDDING = dict(vocab=32000, d=256, ids=8)
UNSHARDED, TPX, TORCH_TP, FLOOR = "unsharded", "tpx", "PyTorch TP", "local + all-reduce"


def measure(fn) -> tuple:
    """(thread CPU ns, process CPU ns) of one call of ``fn``."""
    p0 = time.process_time_ns()
    t0 = time.thread_time_ns()
    fn()
    t1 = time.thread_time_ns()
    p1 = time.process_time_ns()
    return t1 - t0, p1 - p0


def agree(error: str, what: str) -> None:
    """Raises on every rank when any rank found ``error`` (so that no rank is left waiting in
    a collective of the next step)."""
    flag = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise RuntimeError(error or f"{what}: another rank disagrees with the unsharded "
                                    "reference; see its error message")


def check_close(what: str, got: dict, want: dict, tol: dict) -> None:
    error = ""
    for key in want:
        try:
            torch.testing.assert_close(got[key], want[key], **tol)
        except AssertionError as e:
            error = f"{what}: the {key} differs from the unsharded reference on rank " \
                    f"{dist.get_rank()}:\n{e}"
            break
    agree(error, what)


# ----------------------------------------------------------------------------------- MLP --

class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks in the forward; the backward hands the gradient through (each rank
    holds the same output, as a row-parallel layer's)."""

    @staticmethod
    def forward(ctx, y):
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class LocalMLP(nn.Module):
    """The MLP block at TP ``world`` with nothing but this rank's shards, two ``F.linear`` and
    one all-reduce: a lower bound for any TP implementation's host time over gloo."""

    def __init__(self, ref: nn.Sequential, rank: int, world: int) -> None:
        super().__init__()
        h = ref[0].out_features
        lo, hi = rank * h // world, (rank + 1) * h // world
        self.w1 = nn.Parameter(ref[0].weight.detach()[lo:hi].clone())
        self.b1 = nn.Parameter(ref[0].bias.detach()[lo:hi].clone())
        self.w2 = nn.Parameter(ref[2].weight.detach()[:, lo:hi].clone())
        self.b2 = nn.Parameter(ref[2].bias.detach().clone())

    def forward(self, x):
        y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, self.w1, self.b1)),
                                       self.w2)
        return (_AllReduceSum.apply(y) if torch.is_grad_enabled() else
                _AllReduceSum.forward(None, y)) + self.b2


def mlp_variants(world: int) -> tuple:
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp

    torch.manual_seed(SEED)
    d, h = MLP_SHAPE["d"], MLP_SHAPE["h"]
    ref = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))
    x = torch.randn(MLP_SHAPE["tokens"], d)
    variants = {UNSHARDED: ref}
    variants[TPX] = tpx.parallelize_module(
        copy.deepcopy(ref), None, {"0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel()})
    variants[FLOOR] = LocalMLP(ref, dist.get_rank(), world)
    variants[TORCH_TP] = torch_tp.parallelize_module(
        copy.deepcopy(ref), init_device_mesh("cpu", (world,)),
        {"0": torch_tp.ColwiseParallel(), "2": torch_tp.RowwiseParallel()})
    with torch.no_grad():
        want = {"output": ref(x)}
        for label in (TPX, FLOOR, TORCH_TP):
            check_close(f"mlp, {label}", {"output": variants[label](x)}, want, MLP_TOL)
    return variants, x


def embedding_variants(world: int) -> tuple:
    import tpx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as torch_tp

    torch.manual_seed(SEED)
    ref = nn.Sequential(nn.Embedding(EMBEDDING["vocab"], EMBEDDING["d"]))
    ids = torch.randint(0, EMBEDDING["vocab"], (EMBEDDING["ids"],))
    variants = {UNSHARDED: ref}
    variants[TPX] = tpx.parallelize_module(
        copy.deepcopy(ref), None, {"0": tpx.RowwiseParallel(input_layouts=tpx.Replicate())})
    variants[TORCH_TP] = torch_tp.parallelize_module(
        copy.deepcopy(ref), init_device_mesh("cpu", (world,)),
        {"0": torch_tp.RowwiseParallel(input_layouts=Replicate())})
    with torch.no_grad():
        want = {"output": ref(ids)}
        for label in (TPX, TORCH_TP):
            check_close(f"embedding, {label}", {"output": variants[label](ids)}, want,
                        dict(rtol=0, atol=0))
    return variants, ids


def mlp_forward(model: nn.Module, x: torch.Tensor):
    def block(k: int) -> list:
        with torch.no_grad():
            return [measure(lambda: model(x)) for _ in range(k)]
    return block


def mlp_forward_backward(model: nn.Module, x: torch.Tensor):
    def call() -> None:
        model(x).sum().backward()

    def block(k: int) -> list:
        samples = []
        for _ in range(k):
            model.zero_grad(set_to_none=True)
            samples.append(measure(call))
        model.zero_grad(set_to_none=True)
        return samples
    return block


# --------------------------------------------------------------------------------- Llama --

def torch_tp_llama_plan(model: nn.Module) -> dict:
    """transformers' ``base_model_tp_plan`` of ``model`` with torch's styles, keyed by module
    names of the causal LM (the plan names modules of the base model, ``model.model``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for name, style in model.config.base_model_tp_plan.items():
        if style not in styles:
            raise ValueError(f"no torch style for transformers' {style!r} (on {name})")
        plan[f"{model.base_model_prefix}.{name}"] = styles[style]()
    return plan


def llama_variants(world: int, attn: str) -> tuple:
    import tpx
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp

    torch.manual_seed(SEED)
    config = transformers.LlamaConfig(**LLAMA_CONFIG)
    if attn != "default":
        config._attn_implementation = attn
    ref = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    variants = {UNSHARDED: ref}
    variants[TPX] = copy.deepcopy(ref)
    tpx.parallelize_module(variants[TPX], None, tpx.plans.auto(variants[TPX]))
    variants[TORCH_TP] = copy.deepcopy(ref)
    torch_tp.parallelize_module(variants[TORCH_TP], init_device_mesh("cpu", (world,)),
                                torch_tp_llama_plan(variants[TORCH_TP]))
    ids = torch.randint(0, LLAMA_CONFIG["vocab_size"], (TRAIN_BATCH, TRAIN_SEQ))
    prompt = torch.randint(0, LLAMA_CONFIG["vocab_size"], (1, PROMPT))

    with torch.no_grad():
        out = ref(input_ids=ids, labels=ids)
        want = {"logits": out.logits, "loss": out.loss}
        steps = decode_logits(ref, prompt, 4)
        for label in (TPX, TORCH_TP):
            out = variants[label](input_ids=ids, labels=ids)
            check_close(f"llama, {label}", {"logits": out.logits, "loss": out.loss}, want,
                        LLAMA_TOL)
            got = decode_logits(variants[label], prompt, 4, tokens=steps["tokens"])
            check_close(f"llama decode, {label}", got, steps, LLAMA_TOL)
    return variants, ids, prompt, config._attn_implementation


def decode_logits(model: nn.Module, prompt: torch.Tensor, n: int, tokens=None) -> dict:
    """The last-position logits of the prompt and of ``n`` decode steps with a KV cache, fed
    ``tokens`` (default: the greedy ones), under no_grad; plus the tokens fed."""
    import transformers

    cache = transformers.DynamicCache()
    logits = [model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]]
    fed = []
    for i in range(n):
        tok = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[:, i:i + 1]
        fed.append(tok)
        logits.append(model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1])
    out = {f"step {i} logits": t for i, t in enumerate(logits)}
    out["tokens"] = torch.cat(fed, dim=1)
    return out


def llama_train(model: nn.Module, ids: torch.Tensor, lr: float):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def call() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def block(k: int) -> list:
        model.train()
        samples = [measure(call) for _ in range(k)]
        model.eval()
        return samples
    return block


def llama_decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int):
    import transformers

    def block(k: int) -> list:
        samples = []
        with torch.no_grad():
            for _ in range(k):
                cache = transformers.DynamicCache()
                out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
                state = {"tok": out.logits[:, -1].argmax(-1, keepdim=True)}

                def call() -> None:
                    logits = model(input_ids=state["tok"], past_key_values=cache,
                                   use_cache=True).logits
                    state["tok"] = logits[:, -1].argmax(-1, keepdim=True)
                samples += [measure(call) for _ in range(new_tokens)]
        return samples
    return block


# -------------------------------------------------------------------------------- timing --

def run_case(blocks: dict, iters: int, warmup: int, rounds: int) -> dict:
    """Round robin over the variants; {variant: {"thread_us": [...], "process_us": [...]}}."""
    for block in blocks.values():
        block(warmup)
    labels = list(blocks)
    samples = {label: [] for label in labels}
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            dist.barrier()  # both ranks start each block together
            samples[label] += blocks[label](iters)
    return {label: {"thread_us": [t / 1e3 for t, _ in s], "process_us": [p / 1e3 for _, p in s]}
            for label, s in samples.items()}


def summarize(case: str, samples: dict, world: int) -> list:
    """Per variant: rank 0's median thread / process CPU time per call, the max over ranks of
    the medians, and the ratios of rank 0's thread time to the unsharded variant's."""
    labels = list(samples)
    mine = torch.tensor([[statistics.median(samples[v]["thread_us"]),
                          statistics.median(samples[v]["process_us"])] for v in labels],
                        dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    ranks = torch.stack(gathered)  # [rank, variant, (thread, process)]
    base = ranks[0, labels.index(UNSHARDED), 0].item()
    rows = []
    for i, label in enumerate(labels):
        rows.append(dict(case=case, variant=label, calls=len(samples[label]["thread_us"]),
                         thread_us_median=ranks[0, i, 0].item(),
                         thread_us_median_max_over_ranks=ranks[:, i, 0].max().item(),
                         thread_us_median_per_rank=ranks[:, i, 0].tolist(),
                         thread_us_min=min(samples[label]["thread_us"]),
                         process_us_median=ranks[0, i, 1].item(),
                         ratio_to_unsharded=ranks[0, i, 0].item() / base))
    return rows


def tpx_commit() -> dict:
    """The git commit of the tpx package that was imported (and whether its sources differ
    from it), when it lives in a git checkout."""
    import tpx

    where = Path(tpx.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=where,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {}
    return dict(tpx_commit=commit, tpx_sources_modified=bool(dirty))


def rank_main(rank: int, world: int, args, init_method) -> None:
    if init_method is not None:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    import tpx

    if rank == 0:
        print(f"tpx imported from {tpx.__file__}", flush=True)
    cases = [c.strip() for c in args.cases.split(",")]
    rows = []
    attn = None
    start = time.perf_counter()
    for case in cases:
        iters = args.iters if args.iters is not None else ITERS[case]
        warmup = args.warmup if args.warmup is not None else WARMUP[case]
        if case.startswith("mlp") or case == "embedding":
            variants, x = mlp_variants(world) if case != "embedding" else \
                embedding_variants(world)
            make = mlp_forward_backward if case == "mlp fwd+bwd" else mlp_forward
            blocks = {label: make(model, x) for label, model in variants.items()}
        else:
            variants, ids, prompt, attn = llama_variants(world, args.attn)
            if case == "llama train":
                blocks = {label: llama_train(model, ids, args.lr)
                          for label, model in variants.items()}
            else:
                blocks = {label: llama_decode(model, prompt, NEW_TOKENS)
                          for label, model in variants.items()}
        rows += summarize(case, run_case(blocks, iters, warmup, args.rounds), world)
        if rank == 0:
            print(f"{case}: done ({time.perf_counter() - start:.0f} s)", flush=True)

    if rank == 0:
        env = environment(torch.device("cpu"), world, "gloo")
        env.update(tpx_commit())
        print_env(env)
        if "tpx_commit" in env:
            print(f"tpx commit: {env['tpx_commit']}"
                  + (" (sources modified)" if env["tpx_sources_modified"] else ""))
        table = [[r["case"], r["variant"], r["calls"], f"{r['thread_us_median']:.1f}",
                  f"{r['thread_us_median_max_over_ranks']:.1f}", f"{r['process_us_median']:.1f}",
                  f"{r['ratio_to_unsharded']:.2f}"] for r in rows]
        print("\nhost CPU time per call, median (us); thread = the calling thread only")
        print(format_table(["case", "variant", "calls", "thread r0", "thread max",
                            "process r0", "x unsharded"], table, text_columns=2))
        config = dict(vars(args), world=world, mlp=MLP_SHAPE, embedding=EMBEDDING,
                      llama=LLAMA_CONFIG,
                      attn_implementation=attn, train_batch=[TRAIN_BATCH, TRAIN_SEQ],
                      prompt_tokens=PROMPT, new_tokens=NEW_TOKENS, iters_per_case=ITERS
                      if args.iters is None else args.iters,
                      warmup_per_case=WARMUP if args.warmup is None else args.warmup,
                      torch_tp_llama_plan="transformers' base_model_tp_plan with torch's "
                                          "ColwiseParallel / RowwiseParallel")
        path = write_json(args.out, dict(benchmark="bench_host", env=env, config=config,
                                         results=rows,
                                         wall_s=round(time.perf_counter() - start, 1)))
        print(f"\nwrote {path}")
    dist.barrier()
    # At exit torch may warn of "unwaited collective calls": the functional collectives of
    # PyTorch TP's forward under no_grad, whose results were used without an explicit wait.
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="round-robin rounds (default 30)")
    p.add_argument("--iters", type=int, default=None,
                   help="calls per variant per round, every case (decode: sequences of "
                        f"{NEW_TOKENS} tokens); default per case: {ITERS}")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed calls per variant first; default per case: {WARMUP}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {CASES}")
    p.add_argument("--attn", default="default",
                   help="Llama's attention implementation (default: transformers' default)")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate of the train step")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--world", type=int, default=2,
                   help="ranks to spawn when not started by torchrun (default 2)")
    p.add_argument("--out", default=str(RESULTS_DIR / "bench_host_cpu_tp2.json"))
    args = p.parse_args()
    for case in args.cases.split(","):
        if case.strip() not in CASES:
            p.error(f"unknown case {case!r}; choose from {CASES}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
    else:
        spawn_ranks(rank_main, args.world, args, "bench_host")


if __name__ == "__main__":
    main()
