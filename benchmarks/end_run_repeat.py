"""Runs a short two-rank tpx training script many times, each ending with ``tpx.end_run()``,
and counts the runs that did not end cleanly (a non-zero exit code: an abort at exit, or a
hang past the timeout).

    python benchmarks/end_run_repeat.py --runs 20          # with this interpreter's torch
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

SCRIPT = r'''
import torch, torch.distributed as dist, tpx
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(tpx.ColumnParallelLinear(64, 256), nn.GELU(), tpx.RowParallelLinear(256, 64),
                      tpx.ColumnParallelLinear(64, 96, gather_output=True))
opt = torch.optim.AdamW(model.parameters())
for _ in range(5):
    loss = tpx.vocab_parallel_cross_entropy(model[:3](torch.randn(32, 64)) @ torch.randn(64, 7), torch.randint(0, 7 * dist.get_world_size(), (32,)))
    loss.backward(); opt.step(); opt.zero_grad()
    x = model(torch.randn(8, 64)).sum(); x.backward()
tpx.end_run()
'''


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    fd, path = tempfile.mkstemp(suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(SCRIPT)
    bad, t0 = [], time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for i in range(args.runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(29600 + i % 50), path]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                               start_new_session=True)
            if r.returncode != 0:
                bad.append((i, f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"))
        except subprocess.TimeoutExpired:
            bad.append((i, "timeout"))
    import torch

    print(f"torch {torch.__version__}: {args.runs - len(bad)} of {args.runs} runs ended cleanly "
          f"({time.time() - t0:.0f} s)")
    for i, why in bad:
        print(f"  run {i}: {why}")
    os.unlink(path)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
