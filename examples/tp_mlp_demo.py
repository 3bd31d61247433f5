"""A small tensor-parallel training run on the CPU, checked against one process.

Every rank builds the same plain-PyTorch MLP from the same seed, shards it with
``tpx.ColumnParallelLinear.from_linear`` / ``tpx.RowParallelLinear.from_linear`` and trains it
with SGD to imitate a fixed random "teacher" network. Each rank also trains the unsharded model
on the same batches, so the run checks itself: the TP loss must follow the single-device loss
to rounding level, step after step.

    torchrun --nproc-per-node 2 examples/tp_mlp_demo.py [--steps 200] [--sequence-parallel]
"""

import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch import nn

import tpx


def mlp(d, h):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--h", type=int, default=512)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sequence-parallel", action="store_true")
    args = p.parse_args()
    if args.steps < 1 or args.batch < 1 or args.seq < 1 or args.d < 1 or args.h < 1:
        p.error("--steps, --batch, --seq, --d and --h must be positive")

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.sequence_parallel and args.seq % world:
        p.error(f"--seq {args.seq} must divide by the world size {world} with --sequence-parallel")

    torch.manual_seed(0)
    teacher = mlp(args.d, args.h)
    reference = mlp(args.d, args.h)
    kw = dict(sequence_parallel=args.sequence_parallel, sequence_dim=1)
    tp_model = nn.Sequential(
        tpx.ColumnParallelLinear.from_linear(copy.deepcopy(reference[0]), **kw),
        nn.ReLU(),
        tpx.RowParallelLinear.from_linear(copy.deepcopy(reference[2]), **kw),
    )
    opt_tp = torch.optim.SGD(tp_model.parameters(), lr=args.lr)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)
    s = args.seq // world if args.sequence_parallel else args.seq
    lo = rank * s if args.sequence_parallel else 0

    if rank == 0:
        print(f"tpx {tpx.__version__}: MLP {args.d}->{args.h}->{args.d}, TP={world} over gloo, "
              f"sequence_parallel={args.sequence_parallel}, {args.steps} steps")
    worst, first, t0 = 0.0, None, time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.seq, args.d, generator=data)
        with torch.no_grad():
            target = teacher(x)
        # Tensor-parallel step. Under sequence parallelism each rank holds a slice of the
        # sequence and the loss is the sum of the ranks' partial losses.
        x_tp, t_tp = x[:, lo:lo + s], target[:, lo:lo + s]
        loss_tp = ((tp_model(x_tp) - t_tp) ** 2).sum() / target.numel()
        opt_tp.zero_grad()
        loss_tp.backward()
        opt_tp.step()
        loss_tp = loss_tp.detach()
        if args.sequence_parallel:
            dist.all_reduce(loss_tp)
        # The same step on the unsharded model.
        loss_ref = ((reference(x) - target) ** 2).mean()
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()

        diff = abs(loss_tp.item() - loss_ref.item())
        worst = max(worst, diff)
        first = loss_tp.item() if first is None else first
        if rank == 0 and (step == 1 or step % max(1, args.steps // 10) == 0):
            print(f"step {step:5d}  loss {loss_tp.item():.6f}  (one process {loss_ref.item():.6f}, "
                  f"|diff| {diff:.2e})", flush=True)

    # Every shard against the matching slice of the unsharded weights.
    col, row = tp_model[0], tp_model[2]
    w_diff = max((col.weight - reference[0].weight[col.out_start:col.out_end]).abs().max().item(),
                 (row.weight - reference[2].weight[:, row.in_start:row.in_end]).abs().max().item())
    if rank == 0:
        elapsed = time.perf_counter() - t0
        print(f"loss {first:.6f} -> {loss_tp.item():.6f} in {elapsed:.1f} s; largest loss "
              f"difference to one process {worst:.2e}; largest weight difference {w_diff:.2e}")
    ok = worst < 1e-4 and w_diff < 1e-4 and loss_tp.item() < first
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: the TP run diverged from the single-process run")


if __name__ == "__main__":
    main()
