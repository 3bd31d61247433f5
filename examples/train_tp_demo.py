"""Train a small Llama-style decoder with tensor parallelism, and check it against one process.

The model (examples/tiny_llama.py) is plain PyTorch; tpx.parallelize_module shards it over a
TP group. The data are the Python standard library's own .py sources, read from this machine
and tokenised byte by byte: nothing is downloaded. Rank 0 shows a progress bar, then:

- clips the gradient norm of the whole model (``tpx.clip_grad_norm_``, ``--clip``), saves model
  and optimizer state every ``--ckpt-every`` steps (``tpx.checkpoint.save(..., optimizer=)``),
  and at the end reloads the last of them into a fresh model and optimizer and replays the
  next steps: the losses must equal the uninterrupted run's ("resume check");
- replays the first steps on one process with the same seed and prints the largest loss
  difference (it must be at rounding level);
- saves the loss curve (PNG) and a full checkpoint (safetensors) that loads into the
  unsharded model, and checks that it does;
- prints a few lines sampled from the trained model.

    torchrun --nproc-per-node 2 examples/train_tp_demo.py [--steps 600] [--sequence-parallel]
        [--loss-parallel] [--compile] [--device cpu|cuda] [--out demo_out] [--clip 1.0]
        [--ckpt-every 200] [--amp]
    torchrun --nproc-per-node 1 examples/train_tp_demo.py --resume demo_out/ckpt-400
        (continues at another TP degree; compared with demo_out/losses.json of the first run)

Beyond 1-D, ``--layout 2d`` (q x q processes, e.g. 4), ``--layout 2.5d --depth 2`` (2 x q x q,
e.g. 8) or ``--layout 3d`` (q x q x q, e.g. 8) shards the same model over a mesh from
``tpx.init_mesh`` with ``tpx.plans.auto(model, layout=...)`` (``make demo LAYOUT=2d``).
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import re
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpx  # noqa: E402
import tpx.checkpoint  # noqa: E402
from tiny_llama import Decoder, tp_plan  # noqa: E402

VOCAB = 256  # bytes


def parse_args():
    p = argparse.ArgumentParser(description="Tensor-parallel training demo (tpx).")
    p.add_argument("--tp", type=int, default=None,
                   help="TP degree; must equal the number of processes torchrun started")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check-steps", type=int, default=5,
                   help="steps replayed on one process to check the TP run")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--loss-parallel", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", default="demo_out", help="folder for the plot and the checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["1d", "2d", "2.5d", "3d"], default="1d",
                   help="1d: TP over all processes; 2d / 2.5d / 3d: a mesh (tpx.init_mesh)")
    p.add_argument("--depth", type=int, default=2, help="depth of the 2.5d layout")
    p.add_argument("--clip", type=float, default=1.0,
                   help="clip the gradient norm of the whole model to this (0: no clipping)")
    p.add_argument("--ckpt-every", type=int, default=200,
                   help="save model and optimizer state every N steps to OUT/ckpt-STEP (0: never)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint directory OUT/ckpt-STEP (any TP degree), "
                        "or 'latest': the newest complete one in OUT")
    p.add_argument("--resume-check", type=int, default=3,
                   help="after training, reload the last mid-run checkpoint and replay this many "
                        "steps: the losses must equal the uninterrupted run's")
    p.add_argument("--amp", action="store_true",
                   help="compute under torch.autocast in bfloat16 (parameters, gradients and "
                        "optimizer state stay float32)")
    args = p.parse_args()
    for name in ("steps", "batch", "seq", "dim", "layers", "heads", "kv_heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.ckpt_every < 0 or args.resume_check < 0 or args.clip < 0:
        p.error("--ckpt-every, --resume-check and --clip must be >= 0")
    if args.check_steps < 0 or args.check_steps > args.steps:
        p.error("--check-steps must lie in [0, --steps]")
    if args.dim % args.heads or args.heads % args.kv_heads:
        p.error("--dim must divide by --heads, and --heads by --kv-heads")
    if "RANK" not in os.environ:
        p.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 "
                "examples/train_tp_demo.py (or: make demo)")
    world = int(os.environ["WORLD_SIZE"])
    if args.tp is not None and args.tp != world:
        p.error(f"--tp {args.tp} differs from the {world} processes torchrun started; "
                f"use torchrun --nproc-per-node {args.tp}")
    if args.layout != "1d":
        if args.sequence_parallel:
            p.error(f"--sequence-parallel is for --layout 1d; the {args.layout} layout splits "
                    f"every activation already")
        return args, world
    if args.kv_heads % world:
        p.error(f"--kv-heads {args.kv_heads} must divide by the TP degree {world}")
    if args.sequence_parallel and args.seq % world:
        p.error(f"--seq {args.seq} must divide by the TP degree {world} with --sequence-parallel")
    return args, world


def load_corpus(limit_bytes: int = 4 << 20) -> torch.Tensor:
    """The standard library's .py sources as one byte tensor (deterministic order)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    data, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        with open(path, "rb") as f:
            chunk = f.read()
        data.append(chunk)
        total += len(chunk)
        if total >= limit_bytes:
            break
    if total < 1 << 16:
        raise SystemExit(f"too little Python source found under {stdlib} to train on")
    return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).long()


def batches(corpus, steps, batch, seq, seed):
    """The same random windows on every rank (and in the replay)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=gen)
        rows = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()])
        yield rows[:, :-1], rows[:, 1:]


def loss_fn(model_out, target, loss_parallel, mesh=None):
    if loss_parallel and mesh is not None:  # the layout's blocks of the logits
        with tpx.loss_parallel(mesh):
            return F.cross_entropy(model_out.reshape(-1, model_out.shape[-1]), target.reshape(-1))
    if loss_parallel:  # vocab-sharded logits, never gathered
        return tpx.vocab_parallel_cross_entropy(model_out, target, vocab_size=VOCAB)
    return F.cross_entropy(model_out.reshape(-1, VOCAB), target.reshape(-1))


def build(args, device):
    torch.manual_seed(args.seed)
    return Decoder(vocab=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                   n_kv_heads=args.kv_heads, hidden=int(args.dim * 8 / 3) // 8 * 8).to(device)


@torch.no_grad()
def sample(model, prompt: bytes, length: int, device, args, gen, mesh=None) -> str:
    ids = torch.tensor([list(prompt)], device=device)
    world = dist.get_world_size()
    for _ in range(length):
        context = ids[:, -args.seq:]
        if mesh is not None:  # the batch must fill the layout's batch blocks: repeat the row
            logits = model(context.expand(args.batch, -1))
            if args.loss_parallel:
                kw = {"hidden_mesh_dim": "weight"} if args.layout == "3d" else {}
                logits = tpx.gather_output(logits, mesh, **kw)
            probs = torch.softmax(logits[:1, -1].float() / 0.8, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=gen).to(device)
            ids = torch.cat([ids, nxt], 1)
            continue
        if args.sequence_parallel and context.shape[1] % world:  # pad to a multiple of the TP size
            pad = torch.full((1, world - context.shape[1] % world), ord("\n"), device=device)
            context = torch.cat([pad, context], 1)
        logits = model(context)[:, -1]
        if args.loss_parallel:  # gather the vocab shards of the last position only
            logits = tpx.mappings.gather_last_dim(logits, tpx.group.shard_sizes(VOCAB, dist.get_world_size()),
                                                  tpx.shard_range(VOCAB)[0], dist.group.WORLD)
        probs = torch.softmax(logits.float() / 0.8, -1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        ids = torch.cat([ids, nxt], 1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def main():
    args, world = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU is visible")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    corpus = load_corpus()

    reference = build(args, device)  # identical on every rank (same seed)
    mesh = None
    if args.layout == "1d":
        model = tpx.parallelize_module(copy.deepcopy(reference), None,
                                       tp_plan(args.sequence_parallel, args.loss_parallel))
    else:
        mesh = tpx.init_mesh(args.layout, **({"depth": args.depth} if args.layout == "2.5d"
                                             else {}), device_type=device.type)
        model = copy.deepcopy(reference)
        tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=args.layout,
                                                           loss_parallel=args.loss_parallel))
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n_params = sum(p.numel() for p in reference.parameters())
    if rank == 0:
        print(f"tpx {tpx.__version__}: Llama-style decoder, {n_params / 1e6:.2f} M parameters, "
              f"TP={world} ({args.layout}{'' if mesh is None else ' mesh ' + str(tuple(mesh.shape))}"
              f") over {backend}, sequence_parallel={args.sequence_parallel}, "
              f"loss_parallel={args.loss_parallel}, compile={args.compile}; data: "
              f"{corpus.numel() / 1e6:.1f} MB of the standard library's Python sources")

    from tqdm import tqdm

    losses, start, original = [], 0, None   # losses[i]: the loss of step i + 1
    if args.resume:
        start, losses = resume(args, model, opt, rank)
        previous = os.path.join(args.out, "losses.json")
        if os.path.exists(previous):   # the curve of the run that wrote the checkpoint
            with open(previous) as f:
                original = json.load(f)["losses"]
        dist.barrier()
    t0 = time.perf_counter()
    bar = tqdm(total=args.steps, initial=start, disable=rank != 0, unit="step",
               dynamic_ncols=True)
    saved = []
    for step, (x, y) in enumerate(batches(corpus, args.steps, args.batch, args.seq, args.seed)):
        if step < start:
            continue  # the batches a resumed run has already trained on
        losses.append(train_step(args, step_fn, opt, model, x.to(device), y.to(device), mesh))
        tok_s = (step + 1 - start) * x.numel() / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:,.0f}")
        bar.update()
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0 and step + 1 < args.steps:
            # The replica guard: every parameter the plan leaves whole (norms, ...) must be
            # the same on every rank; one small all-gather of checksums.
            tpx.check_replicas(model, grads=False, strict=True)
            saved.append(save_checkpoint(args, model, opt, step + 1, losses, rank))
    bar.close()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump({"losses": losses}, f)
    resume_report = check_resume(args, reference, saved, losses, corpus, device, mesh, rank)
    if args.resume:
        resume_report = compare_with_original(args, start, losses, original) or resume_report

    # The same first steps on one process, unsharded, with the same seed and batches.
    worst = 0.0
    if rank == 0 and args.check_steps and not args.resume:
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0)
        for step, (x, y) in enumerate(batches(corpus, args.check_steps, args.batch, args.seq,
                                              args.seed)):
            x, y = x.to(device), y.to(device)
            with autocast(args, device):
                ref_loss = F.cross_entropy(reference(x).reshape(-1, VOCAB).float(), y.reshape(-1))
            ref_opt.zero_grad(set_to_none=True)
            ref_loss.backward()
            if args.clip:  # one process: torch's own clipping is right
                torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip)
            ref_opt.step()
            worst = max(worst, abs(ref_loss.item() - losses[step]))
    dist.barrier()

    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    gen = torch.Generator().manual_seed(args.seed)
    samples = [sample(model, p, 60, device, args, gen, mesh)
               for p in (b"def ", b"import ", b"    return ")]
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {elapsed:.0f} s "
              f"({(args.steps - start) * args.batch * args.seq / elapsed:,.0f} tokens/s)")
        if resume_report:
            print(resume_report)
        if args.check_steps and not args.resume:
            print(f"self-check: the first {args.check_steps} steps replayed on one process; "
                  f"largest loss difference {worst:.2e}")
        os.makedirs(args.out, exist_ok=True)
        save_outputs(args, losses, full, device)
        print("samples:")
        for s in samples:
            print("  " + repr(s))
    tpx.end_run()  # every rank: barrier, a pause for gloo's threads, the groups destroyed
    limit = 3e-2 if args.amp else 1e-3   # bfloat16 GEMMs round differently in the two runs
    if rank == 0 and (worst > limit or losses[-1] >= losses[0]):
        raise SystemExit("the TP run does not match one process, or the loss did not fall")
    if rank == 0 and resume_report and "DIFFER" in resume_report:
        raise SystemExit("resuming from the checkpoint does not continue the loss curve")


def autocast(args, device):
    """``torch.autocast`` in bfloat16 with ``--amp``, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)


def train_step(args, step_fn, opt, model, x, y, mesh) -> float:
    with autocast(args, x.device):
        loss = loss_fn(step_fn(x), y, args.loss_parallel, mesh)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if args.clip:
        # The norm of the whole model, the same on every rank (torch's clip_grad_norm_ would
        # see only this rank's shards).
        tpx.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    return loss.item()


def save_checkpoint(args, model, opt, step, losses, rank) -> str:
    """Model and optimizer state (each tensor with its global shape: it loads at any TP
    degree) and the loss curve so far."""
    path = os.path.join(args.out, f"ckpt-{step}")
    tpx.checkpoint.save(model, path, optimizer=opt)
    if rank == 0:
        with open(os.path.join(path, "progress.json"), "w") as f:
            json.dump({"step": step, "losses": losses}, f)
    dist.barrier()
    return path


def latest_checkpoint(out: str) -> str:
    """The newest checkpoint in `out` that a save finished (a run killed while saving leaves
    an incomplete one behind, which tpx.checkpoint.save replaces later)."""
    done = {int(m.group(1)): d for d in glob.glob(os.path.join(out, "ckpt-*"))
            if (m := re.fullmatch(r"ckpt-(\d+)", os.path.basename(d)))
            and tpx.checkpoint.is_complete(d) and os.path.exists(os.path.join(d, "progress.json"))}
    if not done:
        raise SystemExit(f"--resume latest: no complete checkpoint in {out} (OUT/ckpt-STEP)")
    return done[max(done)]


def resume(args, model, opt, rank):
    if args.resume == "latest":
        args.resume = latest_checkpoint(args.out)
    progress = os.path.join(args.resume, "progress.json")
    if not os.path.exists(progress):
        raise SystemExit(f"--resume {args.resume}: no progress.json there; pass a directory "
                         f"the demo saved (OUT/ckpt-STEP)")
    with open(progress) as f:
        info = json.load(f)
    tpx.checkpoint.load(model, args.resume, optimizer=opt)
    if rank == 0:
        print(f"resumed from {args.resume} at step {info['step']} "
              f"(TP={dist.get_world_size()} now)")
    return info["step"], list(info["losses"])


def compare_with_original(args, start, losses, original):
    """With --resume: the steps trained again compared with the losses the original run wrote
    to OUT/losses.json (when it trained that far)."""
    if not original:
        return None
    n = min(len(original) - start, len(losses) - start)
    if n <= 0:
        return None
    worst = max(abs(a - b) for a, b in zip(losses[start:start + n], original[start:start + n]))
    verdict = "equal" if worst <= (3e-2 if args.amp else 1e-4) else "DIFFER from"
    return (f"resume check: steps {start + 1}-{start + n} after resuming {verdict} the original "
            f"run's (largest loss difference {worst:.1e})")


def check_resume(args, reference, saved, losses, corpus, device, mesh, rank):
    """Reloads the last mid-run checkpoint into a fresh model and optimizer and replays the
    next steps: their losses must equal the uninterrupted run's."""
    if not saved or not args.resume_check:
        return None
    path = saved[-1]
    step0 = int(os.path.basename(path).split("-")[-1])
    fresh = copy.deepcopy(reference)
    if mesh is None:
        tpx.parallelize_module(fresh, None, tp_plan(args.sequence_parallel, args.loss_parallel))
    else:
        tpx.parallelize_module(fresh, mesh, tpx.plans.auto(fresh, layout=args.layout,
                                                           loss_parallel=args.loss_parallel))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=args.lr, weight_decay=0.0)
    tpx.checkpoint.load(fresh, path, optimizer=fresh_opt)
    n = min(args.resume_check, args.steps - step0)
    worst = 0.0
    for step, (x, y) in enumerate(batches(corpus, step0 + n, args.batch, args.seq, args.seed)):
        if step < step0:
            continue
        loss = train_step(args, fresh, fresh_opt, fresh, x.to(device), y.to(device), mesh)
        worst = max(worst, abs(loss - losses[step]))
    verdict = "equal" if worst <= (3e-2 if args.amp else 1e-4) else "DIFFER from"
    return (f"resume check: steps {step0 + 1}-{step0 + n} replayed from {path} (model and "
            f"optimizer state) {verdict} the uninterrupted run (largest loss difference "
            f"{worst:.1e})")


def save_outputs(args, losses, full, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from safetensors.torch import load_file, save_file

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)",
           title=f"tpx TP={dist.get_world_size()} ({args.layout}) training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "loss.png")
    fig.savefig(png, dpi=120)
    path = os.path.join(args.out, "checkpoint.safetensors")
    save_file({k: v.contiguous().cpu() for k, v in full.items()}, path)
    # The checkpoint is the unsharded model's: it loads with strict key and shape checks.
    plain = build(args, "cpu")
    plain.load_state_dict(load_file(path), strict=True)
    print(f"saved {png} and {path} (loads into the unsharded model)")


if __name__ == "__main__":
    main()
