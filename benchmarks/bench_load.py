"""Loading a Hugging Face checkpoint into TP: time and peak memory per rank.

For each model (a Llama and a mixture of experts with 8 experts, random weights written in
bf16 by transformers' ``save_pretrained``, per-expert layout) and TP degree, three ways, each
in fresh processes (one per rank, gloo):

- ``tpx``: ``tpx.from_pretrained(path)`` (meta, shard, ``to_empty``, each rank reads its
  slices);
- ``whole-then-shard``: ``AutoModelForCausalLM.from_pretrained(path)`` on every rank, then
  ``tpx.parallelize_module`` (the full model in every rank first);
- ``transformers-tp``: ``from_pretrained(path, tp_plan="auto")`` (transformers' own
  shard-on-read); a failure is reported as such.

Each run is checked before it counts: the loaded model's logits on fixed ids against the
one-device model's (computed once when the checkpoint is written). Peak memory is
``RssAnon`` (anonymous resident memory: the files are memory-mapped, their pages are the page
cache's) sampled every 2 ms, above the process's own after its imports (``RSS MiB``: all
resident memory, file pages read included, likewise); the target is the
rank's part of the model (every local tensor, shards and the tensors kept whole) plus the
largest one: ``peak <= 1.1 x (part + largest)``.

Then each loaded model is written back as a Hugging Face directory, timed and measured the
same way: tpx's ``model.save_pretrained`` (every rank writing its part), the whole-then-shard
way (the full state dict gathered on rank 0, then transformers' ``save_pretrained``), and
transformers' own ``save_pretrained`` of its TP model; checked by reading the directory back
on one device against the loaded model's full state dict.

``python benchmarks/bench_load.py [--size small|1b] [--tp 2 4] [--models llama moe]
[--out benchmarks/results/bench_load.json]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, format_table, print_env, write_json  # noqa: E402

SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=8, kv=2, mlp=128, vocab=1003, moe_mlp=32),
    # hidden, layers, heads, kv heads, MLP, vocab; MoE: experts of this MLP width
    "small": dict(hidden=512, layers=4, heads=8, kv=2, mlp=1536, vocab=32000, moe_mlp=384),
    "1b": dict(hidden=2048, layers=16, heads=32, kv=8, mlp=8192, vocab=128256, moe_mlp=1024),
}
METHODS = ("tpx", "whole-then-shard", "transformers-tp")


def _config(model: str, s: dict):
    import transformers

    if model == "llama":
        return transformers.LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv"], tie_word_embeddings=False, dtype="bfloat16")
    return transformers.Qwen3MoeConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["mlp"],
        moe_intermediate_size=s["moe_mlp"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
        head_dim=s["hidden"] // s["heads"], num_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False, dtype="bfloat16")


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(3))


def write_checkpoint(model: str, s: dict, path: str) -> dict:
    """The model (random, bf16), its files, and its logits on fixed ids."""
    import transformers

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(_config(model, s), dtype=torch.bfloat16)
    m.save_pretrained(path)
    with torch.no_grad():
        logits = m(input_ids=_ids(s["vocab"])).logits.float()
    torch.save(logits, os.path.join(path, "reference_logits.pt"))
    params = sum(p.numel() for p in m.parameters())
    return dict(params=params, bytes=sum(p.numel() * p.element_size() for p in m.parameters()))


def _rss(field: str = "RssAnon:") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _rss_anon() -> int:
    return _rss("RssAnon:")


class _Peak:
    def __init__(self) -> None:
        self.base = _rss_anon()
        self.peak = self.base
        self.base_all = _rss("VmRSS:")
        self.peak_all = self.base_all
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            self.peak_all = max(self.peak_all, _rss("VmRSS:"))
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_anon())
        return self.peak - self.base


def _rank(rank, world, method, path, init, out):
    import torch.distributed as dist
    import transformers

    import tpx

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from torch.distributed.tensor import DTensor

    # The model's code imported (and its lazy imports done) before the baseline: the growth
    # measured below is the load's, not the first import of the modeling module.
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    import safetensors.torch  # noqa: F401
    dist.barrier()
    peak = _Peak()
    t0 = time.perf_counter()
    try:
        if method == "tpx":
            model = tpx.from_pretrained(path)
        elif method == "whole-then-shard":
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
            tpx.parallelize_module(model, None, tpx.plans.auto(model))
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        dist.barrier()
        seconds = time.perf_counter() - t0
        grow = peak.stop()
        grow_all = peak.peak_all - peak.base_all
        status, detail = "ok", ""
    except Exception as e:  # noqa: BLE001 - reported in the table
        peak.stop()
        torch.save(dict(status="failed", detail=f"{type(e).__name__}: {str(e)[:200]}"),
                   os.path.join(out, f"{method}_{rank}.pt"))
        return
    tensors = list(model.parameters()) + list(model.buffers())
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in
             {id(t): t for t in tensors}.values()]
    part = sum(t.numel() * t.element_size() for t in local)
    largest = max(t.numel() * t.element_size() for t in local)
    ref = torch.load(os.path.join(path, "reference_logits.pt"))
    with torch.no_grad():
        logits = model(input_ids=_ids(ref.shape[-1])).logits
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    err = float((logits.float() - ref).abs().max())
    if err > 0.05 * float(ref.abs().max()):  # bf16 weights: reduction order only
        status, detail = "wrong", f"logits off by {err:.3g}"
    save = _save(rank, method, model, os.path.join(out, f"saved-{method}"))
    torch.save(dict(status=status, detail=detail, seconds=seconds, peak=grow, peak_rss=grow_all, part=part,
                    largest=largest, logits_err=err, **save),
               os.path.join(out, f"{method}_{rank}.pt"))
    dist.destroy_process_group()


def _save(rank, method, model, where) -> dict:
    """Writes the loaded model back as a Hugging Face directory: tpx, every rank writing its
    part (``model.save_pretrained`` of a tpx model); the whole-then-shard way as tpx offered
    before (the full state dict gathered on rank 0, then transformers' ``save_pretrained``);
    transformers' own ``save_pretrained`` of its TP model. Checked: the directory read back
    on one device gives the loaded model's logits."""
    import torch.distributed as dist
    import transformers

    import tpx

    dist.barrier()
    peak = _Peak()
    t0 = time.perf_counter()
    try:
        if method == "tpx":
            model.save_pretrained(where)
        elif method == "whole-then-shard":
            full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
            if rank == 0:
                model.save_pretrained(where, state_dict=full)
            del full
        else:
            model.save_pretrained(where)
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - reported in the table
        peak.stop()
        return dict(save_status="failed", save_detail=f"{type(e).__name__}: {str(e)[:200]}")
    seconds, grow = time.perf_counter() - t0, peak.stop()
    status = "ok"
    full = (tpx.checkpoint.full_state_dict(model, rank0_only=True)
            if method != "transformers-tp" else None)  # collective: every rank
    if rank == 0 and full is not None:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(where).state_dict()
        if sorted(theirs) != sorted(full) or any(not torch.equal(theirs[k], v)
                                                 for k, v in full.items()):
            status = "wrong"
    return dict(save_status=status, save_seconds=seconds, save_peak=grow)


def run(method: str, path: str, world: int) -> list:
    tmp = tempfile.mkdtemp(prefix="bench_load_")
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, method, path,
                                                 f"file://{tmp}/store", tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world):
            f = os.path.join(tmp, f"{method}_{r}.pt")
            out.append(torch.load(f) if os.path.exists(f)
                       else dict(status="failed", detail=f"rank exited with {procs[r].exitcode}"))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=["llama", "moe"], choices=["llama", "moe"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    env = environment(torch.device("cpu"), max(args.tp), "gloo")
    print_env(env)
    s = SIZES[args.size]
    rows, records = [], []
    for model in args.models:
        path = tempfile.mkdtemp(prefix=f"bench_load_{model}_")
        try:
            info = write_checkpoint(model, s, path)
            for world in args.tp:
                for method in args.methods:
                    res = run(method, path, world)
                    ok = [r for r in res if r["status"] == "ok"]
                    bad = [r for r in res if r["status"] != "ok"]
                    saves = [r for r in ok if "save_status" in r]
                    rec_save = {}
                    if saves:
                        bad_save = [r for r in saves if r["save_status"] != "ok"]
                        rec_save = dict(save_status=bad_save[0]["save_status"] if bad_save
                                        else "ok",
                                        save_detail=bad_save[0].get("save_detail", "")
                                        if bad_save else "")
                        if not bad_save:
                            rec_save.update(
                                save_seconds=max(r["save_seconds"] for r in saves),
                                save_peak_bytes=max(r["save_peak"] for r in saves))
                    rec = dict(model=model, size=args.size, params=info["params"],
                               checkpoint_bytes=info["bytes"], tp=world, method=method,
                               status=bad[0]["status"] if bad else "ok",
                               detail=bad[0]["detail"] if bad else "", **rec_save)
                    if ok:
                        worst = max(ok, key=lambda r: r["peak"])
                        rec.update(seconds=max(r["seconds"] for r in ok),
                                   peak_bytes=worst["peak"],
                                   peak_rss_bytes=max(r["peak_rss"] for r in ok), part_bytes=worst["part"],
                                   largest_bytes=worst["largest"],
                                   peak_over_target=worst["peak"] / (worst["part"]
                                                                     + worst["largest"]))
                    records.append(rec)
                    mib = 2 ** 20
                    rows.append([model, f"{info['params'] / 1e6:.0f}M", world, method,
                                 rec["status"],
                                 f"{rec['seconds']:.2f}" if "seconds" in rec else "-",
                                 f"{rec['peak_bytes'] / mib:.0f}" if "peak_bytes" in rec else "-",
                                 f"{rec['peak_rss_bytes'] / mib:.0f}" if "peak_bytes" in rec else "-",
                                 f"{(rec['part_bytes'] + rec['largest_bytes']) / mib:.0f}"
                                 if "part_bytes" in rec else "-",
                                 f"{rec['peak_over_target']:.2f}" if "peak_bytes" in rec else "-",
                                 rec.get("save_status", "-"),
                                 f"{rec['save_seconds']:.2f}" if "save_seconds" in rec else "-",
                                 f"{rec['save_peak_bytes'] / mib:.0f}"
                                 if "save_peak_bytes" in rec else "-"])
                    print(format_table(["model", "params", "TP", "method", "status", "s",
                                        "peak MiB", "RSS MiB", "part+largest MiB",
                                        "peak/target", "save", "save s", "save peak MiB"],
                                       rows[-1:], text_columns=5).splitlines()[-1], flush=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    print()
    print(format_table(["model", "params", "TP", "method", "status", "s", "peak MiB",
                        "RSS MiB", "part+largest MiB", "peak/target", "save", "save s",
                        "save peak MiB"], rows, text_columns=5))
    for r in records:
        if r["status"] != "ok":
            print(f"{r['model']} TP {r['tp']} {r['method']}: {r['status']}: {r['detail']}")
        elif r.get("save_status", "ok") != "ok":
            print(f"{r['model']} TP {r['tp']} {r['method']} save: {r['save_status']}: "
                  f"{r['save_detail']}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"bench_load_{args.size}.json")
    write_json(out, dict(environment=env, config=vars(args), results=records))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
