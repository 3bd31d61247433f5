"""Bytes on the wire per token for the experts of a mixture-of-experts layer under expert TP:
measured (``tpx.comm_stats()``, ring traffic) against the derivation, per MoE layer and rank.

Only the experts are sharded in the measured model (attention and everything else whole), so
every collective counted is an expert one. Rows:

* Hugging Face's fused 3-D experts with ``tpx.ExpertsTensorParallel``: one all-reduce of the
  combined output forward, one of the hidden states' and routing weights' gradients backward.
  Derived per token: forward ``2 (P-1)/P H b``, backward ``2 (P-1)/P (H + k) b``.
* A ``ModuleList`` of SwiGLU experts with the stock styles (``w1``/``w3`` colwise, ``w2``
  rowwise): each expert's output is all-reduced on its own, and in the backward each of its two
  column-parallel layers all-reduces its input gradient. Derived per token: forward
  ``2 (P-1)/P k H b``, backward ``2 (P-1)/P 2 k H b``.
* ``tpx.ExpertsParallel`` (each rank a subset of whole experts): the tokens are replicated over
  the TP group, so none moves; the partial outputs are summed as under expert TP, the same
  bytes. Derived per token: as the fused row.
* Expert parallelism over tokens that are NOT replicated (each rank holds ``T/P`` of the
  group's ``T`` tokens, split by sequence or data), with an all-to-all dispatch and combine,
  is not built; its derived volume is shown for comparison, per token of the group's batch:
  each rank sends the ``(P-1)/P`` of its ``k T/P`` token copies that go to other ranks, in 4
  all-to-alls (dispatch and combine, forward and backward): ``4 (P-1)/P^2 k H b``. Against the
  all-reduces of replicated tokens (``2 (P-1)/P (2H + k) b``) it sends less when ``k < P``
  (about); it also needs no replicated activations.

``b`` is bytes per element (4, float32), ``k`` experts per token, ``H`` the hidden size.
Correctness first: the sharded layer's output and input gradient equal the unsharded ones.

    python benchmarks/bench_moe.py [--tp 2 4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_bytes import ring_bytes  # noqa: E402
from common import format_table, spawn_ranks, write_json  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")


def _hf_block(family: str, hidden: int, experts: int, k: int, inter: int):
    """One Hugging Face MoE block (random weights) and its experts' attribute name."""
    import transformers

    kw = dict(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4,
              num_hidden_layers=1, vocab_size=64)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as B
        config = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                            num_experts_per_tok=k, **kw)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=inter, num_experts=experts,
                                             num_experts_per_tok=k, **kw)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as B
        config = transformers.Qwen2MoeConfig(moe_intermediate_size=inter, num_experts=experts,
                                             num_experts_per_tok=k,
                                             shared_expert_intermediate_size=inter, **kw)
    elif family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as B
        config = transformers.DeepseekV3Config(moe_intermediate_size=inter,
                                               n_routed_experts=experts, num_experts_per_tok=k,
                                               n_group=1, topk_group=1, **kw)
    else:
        raise ValueError(family)
    config._experts_implementation = "grouped_mm"  # what a model from the config uses here
    block = B(config)
    for p in block.parameters():  # HF leaves some of them uninitialised outside from_config
        torch.nn.init.normal_(p, std=0.05)
    return block


class _SwiGLU(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = torch.nn.Linear(d, h, bias=False)
        self.w3 = torch.nn.Linear(d, h, bias=False)
        self.w2 = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class ListMoE(torch.nn.Module):
    """Top-k routing over a ModuleList of SwiGLU experts (the transformers 4 / user layout)."""

    def __init__(self, hidden, experts, k, inter):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(_SwiGLU(hidden, inter) for _ in range(experts))
        self.k = k

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, index = self.router(flat).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


def derived(layout: str, world: int, hidden: int, k: int, elem: int = 4) -> dict:
    """Bytes per token one rank sends for one MoE layer (see the module docstring)."""
    ar = 2 * (world - 1) / world
    if layout == "fused":
        return dict(forward=ar * hidden * elem, backward=ar * (hidden + k) * elem)
    if layout == "module-list":
        return dict(forward=ar * k * hidden * elem, backward=ar * 2 * k * hidden * elem)
    if layout == "expert-parallel":  # tokens replicated over the group: as expert TP
        return derived("fused", world, hidden, k, elem)
    if layout == "expert-parallel-all-to-all":  # tokens split P ways (not built; see above)
        a2a = (world - 1) / world ** 2 * k * hidden * elem
        return dict(forward=2 * a2a, backward=2 * a2a)
    raise ValueError(layout)


def measure(rank: int, world: int, layout: str, family: str = "mixtral", *, tokens: int = 64,
            hidden: int = 32, experts: int = 4, k: int = 2, inter: int = 48) -> dict:
    """One forward and backward of one MoE layer over ``tokens`` tokens on this rank (inside an
    initialised default group): the wire bytes per token, forward and backward, after checking
    the output and the input gradient against the unsharded layer."""
    import tpx

    torch.manual_seed(0)
    if layout in ("fused", "expert-parallel"):
        ref = _hf_block(family, hidden, experts, k, inter)
        style = tpx.ExpertsTensorParallel() if layout == "fused" else tpx.ExpertsParallel()
        plan = {"experts": style}
    else:
        ref = ListMoE(hidden, experts, k, inter)
        plan = {"experts.*.w1": tpx.ColwiseParallel(), "experts.*.w3": tpx.ColwiseParallel(),
                "experts.*.w2": tpx.RowwiseParallel()}
    layer = tpx.parallelize_module(copy.deepcopy(ref), None, plan)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=g)
    grad = torch.randn(1, tokens, hidden, generator=g)
    xs = [x.clone().requires_grad_() for _ in range(2)]

    def first(y):
        return y[0] if isinstance(y, tuple) else y

    y_ref = first(ref(xs[0]))
    with tpx.comm_stats() as fwd:
        y = first(layer(xs[1]))
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    (y_ref * grad).sum().backward()
    with tpx.comm_stats() as bwd:
        (y * grad).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-4, atol=1e-5)

    def per_token(stats):
        return sum(ring_bytes(kind, nbytes, world)
                   for (_, kind), (_, nbytes) in stats.counts.items()) / tokens

    label = {"fused": family, "expert-parallel": f"{family} (EP)"}.get(layout, "user ModuleList")
    return dict(layout=layout, family=label,
                tp=world, hidden=hidden, k=k, experts=experts, tokens=tokens,
                forward=per_token(fwd), backward=per_token(bwd),
                calls=dict(forward=fwd.calls(), backward=bwd.calls()),
                derived=derived(layout, world, hidden, k))


def _ranks(rank, world, args, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    rows = [measure(rank, world, "fused", f, tokens=args.tokens, hidden=args.hidden)
            for f in FAMILIES]
    rows += [measure(rank, world, "expert-parallel", f, tokens=args.tokens, hidden=args.hidden)
             for f in ("mixtral", "deepseek_v3")]
    rows.append(measure(rank, world, "module-list", tokens=args.tokens, hidden=args.hidden))
    if rank == 0:
        write_json(os.path.join(args.out, f"bench_moe_tp{world}.json"),
                   dict(benchmark="bench_moe: wire bytes per token and MoE layer, one rank",
                        config={k: v for k, v in vars(args).items() if k != "out"},
                        results=rows))
    import tpx

    tpx.end_run()


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    import json

    rows = []
    for world in args.tp:
        spawn_ranks(_ranks, world, args, "bench_moe")
        with open(os.path.join(args.out, f"bench_moe_tp{world}.json")) as f:
            rows += json.load(f)["results"]
    table = []
    for r in rows:
        ep = derived("expert-parallel-all-to-all", r["tp"], r["hidden"], r["k"])
        table.append([r["family"], r["tp"], f"{r['forward']:.1f}", f"{r['derived']['forward']:.1f}",
                      f"{r['backward']:.1f}", f"{r['derived']['backward']:.1f}",
                      f"{r['calls']['forward']}/{r['calls']['backward']}",
                      f"{ep['forward'] + ep['backward']:.1f}"])
    print(format_table(["experts", "TP", "fwd B/token", "derived", "bwd B/token", "derived",
                        "calls f/b", "all-to-all EP derived f+b"], table, text_columns=1))
    return rows


if __name__ == "__main__":
    main()
