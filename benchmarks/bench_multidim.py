"""Communication accounting of 1-D, 2-D, 2.5-D and 3-D tensor parallelism on one transformer
block: every collective counted by ``tpx.comm_stats()`` against the count derived from the
layout, exactly, per process group and kind; parameter and activation bytes per rank; CPU time.

What runs
=========

Two pre-norm blocks, fp32, activation ``x [B, S, H]`` (``N = B*S`` tokens), residual kept:

* ``mlp``:  ``y = x + fc2(gelu(fc1(layernorm(x))))``, fc1 ``H -> F = 4H``, fc2 ``F -> H``;
* ``attn``: ``y = x + proj(core(qkv(layernorm(x))))``, qkv ``H -> 3H``, proj ``H -> H``, core =
  causal softmax attention over the sequence, per head (no communication in any layout: the
  sequence dimension is never split, and the fused qkv weight's rows are ordered so that
  output block ``j`` of the hidden split holds ``[q_j, k_j, v_j]`` of whole heads).

Layers per layout (``tpx.init_mesh(layout)``; ``q`` the mesh side, ``d`` the depth):

======  ==========================================  ==========================================
layout  norm / fc1 (qkv) / fc2 (proj)               activation on a rank
======  ==========================================  ==========================================
1d      nn.LayerNorm / ColumnParallelLinear /        ``[B, S, H]`` replicated (R)
        RowParallelLinear over the P ranks
2d      LayerNorm2D / Linear2D / Linear2D, q x q     ``[B/q, S, H/q]``
2.5d    LayerNorm2p5D / Linear2p5D x2, d x q x q     ``[B/(dq), S, H/q]``
3d      LayerNorm3D / Linear3D("output") /           ``[B/q^2, S, H/q]``
        Linear3D("weight"), q x q x q
======  ==========================================  ==========================================

Configurations: P=4: 1d, 2d, 2.5d with d=1 (the 2.5-D code path on a 1 x 2 x 2 mesh: its depth
group has one rank, so it must cost exactly what 2-D costs); P=8: 1d, 2.5d (d=2, q=2), 3d
(q=2); P=9: 1d, 2d (q=3); P=16: 1d, 2d (q=4), 2.5d (d=4, q=2). 1-D attention needs the 24
heads to divide by P: n/a at P=9 and 16. Default shape ``B=24, S=3, H=144, 24 heads``
(every split above divides it).

Correctness comes first: on fresh random inputs the block's output, input gradient and every
parameter gradient equal this rank's block of the unsharded block's (rtol = atol = 1e-4);
only then are collectives counted (that same step) and steps timed.

What "bytes" means
==================

``tpx.comm_stats()`` counts, per process group and kind, one entry per collective with the
size of THIS rank's message (its "payload"), not what travels over the wire:

* ``broadcast``: the whole buffer, on every rank of the group (root and receivers alike);
* ``all_gather``: this rank's input (its contribution; the output is group-size times larger);
* ``reduce_scatter``: this rank's output (its share; the input is group-size times larger);
* ``all_reduce``: the whole buffer;
* ``reduce`` (to one root rank): the whole buffer, on every rank.

So an all-gather of ``S`` counted bytes delivers ``(p-1) S`` bytes to each rank, while an
all-reduce of ``S`` needs ``2 (p-1)/p S``: counted payloads of different kinds do not compare
as traffic. The benchmark therefore also gives, derived only, the **ring-model bytes**: the
bytes each rank must receive (averaged over the group) under bandwidth-optimal ring / pipelined
algorithms, the traffic model of the seed's cost table:

========================  ==============================
kind (counted ``S``)      ring-model bytes per rank
========================  ==============================
all_reduce                ``2 (p-1)/p * S``
all_gather                ``(p-1) * S``
reduce_scatter            ``(p-1) * S``
broadcast, reduce         ``(p-1)/p * S``
========================  ==============================

Derivation (per rank, per forward + backward, ``f`` = 4 bytes, ``m`` = local token rows)
=======================================================================================

A collective over a group of one rank is never issued. ``c(rows, bytes)`` is the pipeline
depth the ops pick: ``chunks`` if given, else ``min(default_chunks, max(1, bytes // 1 MiB))``,
at most ``rows``; a chunked collective is ``c`` calls whose payloads add up to the same bytes.
The norm statistics and the norm parameter gradients are fp32 whatever the dtype.

1-D (group "tp", P ranks; ``m = N``, nothing of the activation split)
    ColumnParallelLinear ``H -> n``: forward none; backward all-reduce ``dX [N, H]``.
    RowParallelLinear ``k -> H``: forward all-reduce ``Y [N, H]``; backward none.
    LayerNorm (replicated), GELU, attention core: none.
    Block: ``all_reduce: 2 c calls, 2 N H f``.

2-D SUMMA (groups "row" = a mesh column, "col" = a mesh row, q ranks each; ``m = N/q``)
    Linear2D ``k -> n``, X block ``[m, k/q]``, A block ``[k/q, n/q]``:
      forward   q broadcasts of X blocks over "col" (``m k f`` in all) and q of A blocks over
                "row" (``n k f / q``);
      backward  dX: q broadcasts of A over "row" (``n k f / q``) and q reduces of
                ``[m, k/q]`` partials over "col" (``m k f``); dA: q broadcasts of X over "col"
                (``m k f``) and q reduces of ``[n/q, k/q]`` partials over "row" (``n k f / q``);
                bias: one all-reduce of ``[n/q]`` over "row".
    LayerNorm2D: forward one all-gather of the row statistics ``[m, 2]`` over "col"
      (``2 m f``); backward one all-reduce of ``[m, 2]`` over "col"; weight and bias gradients
      ``[2, H/q]`` all-reduced over each batch-splitting group ("row").
    MLP block: "col" ``4m + 3m (H + F)``, "row" ``(6 H F + 3H + F)/q`` elements;
      total ``(4N + 3N (H+F) + 6 H F + 3H + F) f / q``; calls ``12 q + 5``.
2.5-D (adds "depth", d ranks; ``m = N/(dq)``)
    As 2-D inside each depth layer, plus per Linear one all-reduce over "depth" of the weight
    gradient ``[n/q, k/q]`` and one of the bias gradient ``[n/q]``; the norm's parameter
    gradients are also all-reduced over "depth" (all only when d > 1).
3-D (groups "input", "weight", "output", q ranks each; ``m = N/q^2``)
    Linear3D ``k -> n`` whose input's H is split by ``h`` and batch by ("input", ``o``):
      forward   all-gather of the weight block ``[n/q^2, k/q]`` over "input"; all-gather of X
                ``[m, k/q]`` over ``o`` (c calls); reduce-scatter of Y ``[m, n/q]`` over ``h``
                (c calls);
      backward  all-gather of dY ``[m, n/q]`` over ``h``; reduce-scatter of dX ``[m, k/q]``
                over ``o``; reduce-scatter of dW ``[n/q^2, k/q]`` and all-reduce of the bias
                gradient ``[n/q]`` over "input".
    fc1 takes ``h = "output"`` and returns H split by "weight"; fc2 takes ``h = "weight"``.
    LayerNorm3D: as 2-D with "output" for "col" and ("input", "weight") as batch groups.
    MLP block: ``(4m + 4m (H+F)/q + (5H + F)/q + 4 H F / q^3) f``, i.e.
      ``(4N/q^2 + 4N (H+F)/q^3 + 4 H F/q^3 + (5H+F)/q) f``.

Ring-model leading terms (MLP, ``F = 4H``): 1-D ``4 (P-1)/P N H f``; 2-D
``(q-1)/q^2 (15 N H + 24 H^2) f``; 3-D ``(q-1)/q^3 (20 N H + 16 H^2) f``; 2.5-D
``(q-1)/q^2 (15 N H / d + 24 H^2) f + 2 (d-1)/d * 8 H^2/q^2 f``.
The seed's asymptotic table (fwd + bwd, ring algorithms, bandwidth in units of the message a
rank handles) beside them:

======  =================  =================  ===================  ======================
layout  params / rank      activations / rank  bandwidth (seed)     latency (seed)
======  =================  =================  ===================  ======================
1-D     O(1/P)             O(1)               O(2(P-1)/P)          O(2(P-1))
2-D     O(1/q^2)           O(1/q^2)           O(6(q-1)/q)          O(6(q-1))
2.5-D   O(1/q^2)           O(1/(d q^2))       O(3(q-1)(d+1)/(dq))  O(6(q-1))
3-D     O(1/q^3)           O(1/q^3)           O(6(q-1)/q^3)        O(6(q-1))
======  =================  =================  ===================  ======================

Parameter bytes per rank: the local parameters (LayerNorm weight and bias, fc1/qkv and
fc2/proj weights and biases; 1-D keeps the norm and fc2's bias whole). Activation bytes per
rank: this rank's block input, the outputs of the norm, fc1/qkv, the activation/attention core,
fc2/proj, and the block output (the tensors one layer hands to the next). Both are derived and
checked like the collectives. "saved" (measured only) is what autograd keeps for the backward
on this rank beyond the parameters (3-D keeps the gathered input and weight).

Time: a sample runs ``--block`` steps (zero_grad, forward, backward) back to back after a
barrier; its time per step is the maximum over ranks; the median over ``--repeats`` samples
after warm-up is reported. Ranks > cores: "oversubscribed" (on 2 cores every P here is).

Run:
    python benchmarks/bench_multidim.py            # P = 4, 8, 9, 16; writes results + plot
    python benchmarks/bench_multidim.py --quick    # P = 4 only, few repeats
    python benchmarks/bench_multidim.py --worlds 4,8 --out md.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from common import environment, format_table, print_env, spawn_ranks, step, write_json

SHAPE = dict(batch=24, seq=3, hidden=144, heads=24)
# Extrapolation only: a block of a large model (8 sequences of 2048 tokens, H = 8192).
LARGE_SHAPE = dict(batch=8, seq=2048, hidden=8192, heads=64)
BLOCKS = ("mlp", "attn")
CONFIGS = {4: [("1d", None), ("2d", None), ("2.5d", 1)],
           8: [("1d", None), ("2.5d", 2), ("3d", None)],
           9: [("1d", None), ("2d", None)],
           16: [("1d", None), ("2d", None), ("2.5d", 4)]}
TOL = dict(rtol=1e-4, atol=1e-4)
SEED = 4321
MIB = 1 << 20
STAT_BYTES = 4  # norm statistics and norm parameter gradients travel in fp32
KINDS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ------------------------------------------------------------------------------------------
# The derivation
# ------------------------------------------------------------------------------------------


class NotApplicable(ValueError):
    """The shape does not split over this layout (a size does not divide)."""


def _div(a, b, what: str, exact: bool):
    if not exact:
        return a / b
    if a % b:
        raise NotApplicable(f"{what} = {a} does not divide by {b}")
    return a // b


def mesh_sizes(layout: str, world, depth=None, exact: bool = True) -> dict:
    """The size of each mesh dimension (the group size along it)."""
    if layout == "1d":
        return {"tp": world}
    if layout == "2d":
        q = _root(world, 2, exact)
        return {"row": q, "col": q}
    if layout == "2.5d":
        if not depth:
            raise ValueError("the 2.5-D layout needs a depth")
        q = _root(_div(world, depth, "P / depth", exact), 2, exact)
        return {"depth": depth, "row": q, "col": q}
    if layout == "3d":
        q = _root(world, 3, exact)
        return {"input": q, "weight": q, "output": q}
    raise ValueError(f"unknown layout {layout!r}")


def _root(n, k: int, exact: bool):
    r = n ** (1.0 / k)
    if not exact:
        return r
    for c in (round(r) - 1, round(r), round(r) + 1):
        if c >= 1 and c ** k == n:
            return c
    raise NotApplicable(f"P = {n} is not a {'square' if k == 2 else 'cube'}")


def pick_chunks(chunks, rows, nbytes, default_chunks: int) -> int:
    """The pipeline depth the ops choose (the C++ ``pick_chunks``)."""
    c = chunks if chunks is not None else default_chunks
    if chunks is None:
        c = min(c, max(1, int(nbytes // MIB)))
    return max(1, min(c, int(rows) if rows >= 1 else 1))


class Tally:
    """Derived collectives: ``{(mesh dim, kind): [calls, bytes]}``; a group of one rank issues
    nothing."""

    def __init__(self, sizes: dict) -> None:
        self.sizes, self.comm = sizes, {}

    def add(self, dim: str, kind: str, nbytes, calls=1) -> None:
        if self.sizes[dim] == 1:
            return
        c, b = self.comm.get((dim, kind), (0, 0))
        self.comm[(dim, kind)] = (c + calls, b + nbytes)


def _layernorm(t: Tally, rows, h_local, hidden_dim: str, batch_dims, stat=STAT_BYTES) -> None:
    t.add(hidden_dim, "all_gather", rows * 2 * stat)       # fwd: [rows, 2] mean and M2
    t.add(hidden_dim, "all_reduce", rows * 2 * stat)       # bwd: [rows, 2] two row means
    for b in batch_dims:                                   # bwd: [2, H/q] weight, bias grads
        t.add(b, "all_reduce", 2 * h_local * stat)


def _linear_2d(t: Tally, rows, k, n, q, f, div) -> None:
    kl, nl = div(k, q, "in_features / q"), div(n, q, "out_features / q")
    x_blk, w_blk = rows * kl * f, nl * kl * f
    t.add("col", "broadcast", q * x_blk, q)                # fwd: X_il along the mesh row
    t.add("row", "broadcast", q * w_blk, q)                # fwd: A_lj along the mesh column
    t.add("row", "all_reduce", nl * f)                     # bwd: bias gradient
    t.add("row", "broadcast", q * w_blk, q)                # bwd dX: A_lj
    t.add("col", "reduce", q * x_blk, q)                   # bwd dX: partials to (i, l)
    t.add("col", "broadcast", q * x_blk, q)                # bwd dA: X_il
    t.add("row", "reduce", q * w_blk, q)                   # bwd dA: partials to (l, j)
    if "depth" in t.sizes:
        t.add("depth", "all_reduce", w_blk)                # 2.5-D: dA summed over depth
        t.add("depth", "all_reduce", nl * f)               # 2.5-D: bias gradient too


def _linear_3d(t: Tally, rows, k, n, q, hidden: str, f, div, chunks, default_chunks) -> None:
    o = "weight" if hidden == "output" else "output"
    kl, nq = div(k, q, "in_features / q"), div(n, q, "out_features / q")
    nl = div(n, q * q, "out_features / q^2")
    cf = pick_chunks(chunks, rows, rows * kl * f, default_chunks)
    cb = pick_chunks(chunks, rows, rows * nq * f, default_chunks)
    t.add("input", "all_gather", nl * kl * f)              # fwd: weight block
    t.add(o, "all_gather", rows * kl * f, cf)              # fwd: X
    t.add(hidden, "reduce_scatter", rows * nq * f, cf)     # fwd: Y
    t.add(hidden, "all_gather", rows * nq * f, cb)         # bwd: dY
    t.add(o, "reduce_scatter", rows * kl * f, cb)          # bwd: dX
    t.add("input", "reduce_scatter", nl * kl * f)          # bwd: dW
    t.add("input", "all_reduce", nq * f)                   # bwd: bias gradient


def derive(layout: str, block: str, world, depth=None, *, batch, seq, hidden, heads=None,
           ffn=None, chunks=None, default_chunks: int = 2, itemsize: int = 4,
           exact: bool = True, **_ignored) -> dict:
    """The collectives, parameter bytes and activation bytes of one forward + backward of
    ``block`` ("mlp" or "attn") on one rank, from the layout alone (see the module docstring).

    Returns ``dict(comm={(mesh dim, kind): (calls, bytes)}, sizes={mesh dim: group size},
    params=bytes, activations=bytes)``. ``exact=False`` evaluates the same formulas with real
    division (for extrapolation to sizes that do not divide). Raises :class:`NotApplicable`
    when a size does not divide."""
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}; got {block!r}")
    f, h = itemsize, hidden
    ffn = ffn or 4 * h
    n1 = ffn if block == "mlp" else 3 * h     # fc1 / qkv out features
    k2 = ffn if block == "mlp" else h         # fc2 / proj in features

    def div(a, b, what):
        return _div(a, b, what, exact)

    sizes = mesh_sizes(layout, world, depth, exact)
    t = Tally(sizes)
    if layout == "1d":
        p = world
        rows = batch * seq
        blocks = p
        if block == "attn":
            div(heads, p, "heads / P")
        c = pick_chunks(chunks, rows, rows * h * f, default_chunks)
        t.add("tp", "all_reduce", rows * h * f, c)       # fc1 (column) bwd: dX [N, H]
        t.add("tp", "all_reduce", rows * h * f, c)       # fc2 (row) fwd: Y [N, H]
        params = 2 * h + div(n1, p, "fc1 out / P") * h + div(n1, p, "fc1 out / P") \
            + h * div(k2, p, "fc2 in / P") + h
        acts = 4 * rows * h + rows * div(n1, p, "fc1 out / P") + rows * div(k2, p, "fc2 in / P")
    elif layout in ("2d", "2.5d"):
        q, d = sizes["col"], sizes.get("depth", 1)
        rows = div(batch, d * q, "batch / (depth q)") * seq
        blocks = q
        hl = div(h, q, "hidden / q")
        if block == "attn":
            div(heads, q, "heads / q")
        batch_dims = ["depth", "row"] if layout == "2.5d" else ["row"]
        _layernorm(t, rows, hl, "col", batch_dims)
        _linear_2d(t, rows, h, n1, q, f, div)
        _linear_2d(t, rows, k2, h, q, f, div)
        n1l, k2l = div(n1, q, "fc1 out / q"), div(k2, q, "fc2 in / q")
        params = 2 * hl + n1l * hl + n1l + hl * k2l + hl
        acts = 4 * rows * hl + rows * n1l + rows * k2l
    else:
        q = sizes["input"]
        rows = div(batch, q * q, "batch / q^2") * seq
        blocks = q
        hl = div(h, q, "hidden / q")
        if block == "attn":
            div(heads, q, "heads / q")
        _layernorm(t, rows, hl, "output", ["input", "weight"])
        _linear_3d(t, rows, h, n1, q, "output", f, div, chunks, default_chunks)
        _linear_3d(t, rows, k2, h, q, "weight", f, div, chunks, default_chunks)
        n1l, k2l = div(n1, q, "fc1 out / q"), div(k2, q, "fc2 in / q")
        params = 2 * hl + div(n1, q * q, "fc1 out / q^2") * hl + n1l \
            + div(h, q * q, "fc2 out / q^2") * k2l + hl
        acts = 4 * rows * hl + rows * n1l + rows * k2l
    return dict(comm=t.comm, sizes=sizes, params=params * f, activations=acts * f,
                blocks=blocks)


RING_FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: p - 1,
               "reduce_scatter": lambda p: p - 1, "broadcast": lambda p: (p - 1) / p,
               "reduce": lambda p: (p - 1) / p}


def ring_bytes(comm: dict, sizes: dict) -> float:
    """Bytes each rank receives, averaged over the group, under bandwidth-optimal ring /
    pipelined algorithms, for the counted payloads ``comm`` (module docstring)."""
    return sum(RING_FACTOR[kind](sizes[dim]) * b for (dim, kind), (_, b) in comm.items())


def totals(comm: dict) -> tuple:
    return (sum(c for c, _ in comm.values()), sum(b for _, b in comm.values()))


# ------------------------------------------------------------------------------------------
# The blocks
# ------------------------------------------------------------------------------------------


class AttentionCore(nn.Module):
    """Causal attention of ``heads`` heads over dim 1 of ``qkv [B, S, 3 * heads * hd]``,
    whose last dim is ordered (group, q/k/v, head in group, hd): group ``j`` holds whole heads
    of q, k and v, so a rank holding one group's columns attends locally."""

    def __init__(self, heads: int, groups: int) -> None:
        super().__init__()
        self.heads, self.groups = heads, groups

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, w = qkv.shape
        hd = w // (3 * self.heads)
        t = qkv.view(b, s, self.groups, 3, self.heads // self.groups, hd)
        q, k, v = (u.reshape(b, s, self.heads, hd).transpose(1, 2) for u in t.unbind(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, s, self.heads * hd)


class Block(nn.Module):
    """``y = x + fc2(act(fc1(norm(x))))``; for attention fc1 is qkv, act the core, fc2 proj."""

    def __init__(self, norm, fc1, act, fc2) -> None:
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = norm, fc1, act, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def reference_block(block: str, shape: dict, groups: int) -> Block:
    """The unsharded block (same draws on every rank after the same seed); ``groups`` = the
    number of hidden blocks of the layout, which orders the fused qkv rows."""
    torch.manual_seed(SEED)
    h = shape["hidden"]
    if block == "mlp":
        return Block(nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
    return Block(nn.LayerNorm(h), nn.Linear(h, 3 * h), AttentionCore(shape["heads"], groups),
                 nn.Linear(h, h))


def shard_block(ref: Block, block: str, layout: str, mesh, shape: dict, chunks) -> Block:
    import tpx

    q = mesh.shape[-1]
    blocks = mesh.shape[0] if layout == "1d" else q
    act = nn.GELU() if block == "mlp" else AttentionCore(shape["heads"] // blocks, 1)
    if layout == "1d":
        return Block(copy.deepcopy(ref.norm),
                     tpx.ColumnParallelLinear.from_linear(ref.fc1, mesh, src_rank=None,
                                                          chunks=chunks),
                     act,
                     tpx.RowParallelLinear.from_linear(ref.fc2, mesh, src_rank=None,
                                                       chunks=chunks))
    if layout in ("2d", "2.5d"):
        norm_cls, lin = ((tpx.LayerNorm2D, tpx.Linear2D) if layout == "2d"
                         else (tpx.LayerNorm2p5D, tpx.Linear2p5D))
        return Block(norm_cls.from_layernorm(ref.norm, mesh), lin.from_linear(ref.fc1, mesh),
                     act, lin.from_linear(ref.fc2, mesh))
    return Block(tpx.LayerNorm3D.from_layernorm(ref.norm, mesh, hidden_mesh_dim="output"),
                 tpx.Linear3D.from_linear(ref.fc1, mesh, hidden_mesh_dim="output", chunks=chunks),
                 act,
                 tpx.Linear3D.from_linear(ref.fc2, mesh, hidden_mesh_dim="weight", chunks=chunks))


def expected_param_grads(ref: Block, blk: Block, layout: str, mesh) -> list:
    """(name, this rank's gradient, the block of the unsharded gradient it must equal)."""
    out = []
    coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    if layout == "1d":
        for name in ("weight", "bias"):
            out.append((f"norm.{name}", getattr(blk.norm, name).grad, getattr(ref.norm, name).grad))
        s, e = blk.fc1.out_start, blk.fc1.out_end
        out += [("fc1.weight", blk.fc1.weight.grad, ref.fc1.weight.grad[s:e]),
                ("fc1.bias", blk.fc1.bias.grad, ref.fc1.bias.grad[s:e])]
        s, e = blk.fc2.in_start, blk.fc2.in_end
        out += [("fc2.weight", blk.fc2.weight.grad, ref.fc2.weight.grad[:, s:e]),
                ("fc2.bias", blk.fc2.bias.grad, ref.fc2.bias.grad)]
        return out
    j = coord["output"] if layout == "3d" else coord["col"]
    hl = ref.norm.weight.shape[0] // mesh.shape[-1]
    for name in ("weight", "bias"):
        out.append((f"norm.{name}", getattr(blk.norm, name).grad,
                    getattr(ref.norm, name).grad[j * hl:(j + 1) * hl]))
    for lname in ("fc1", "fc2"):
        layer, full = getattr(blk, lname), getattr(ref, lname)
        # The layer's own description of its blocks (the same one its checkpoints use).
        specs = {sp.name: sp for sp in layer._param_splits()}
        out += [(f"{lname}.{n}", getattr(layer, n).grad,
                 specs[n].slice_of(getattr(full, n).grad, layer.mesh_info))
                for n in ("weight", "bias")]
    return out


def _nbytes(t) -> int:
    """Bytes this rank stores (the local part of a DTensor)."""
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class ActivationBytes:
    """Forward hooks summing the outputs of the block's four layers, plus its input and
    output, on this rank."""

    def __init__(self, blk: Block) -> None:
        self.total = 0
        self.handles = [m.register_forward_hook(self._hook)
                        for m in (blk.norm, blk.fc1, blk.act, blk.fc2)]

    def _hook(self, module, inputs, output) -> None:
        self.total += _nbytes(output)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class SavedBytes:
    """Bytes autograd keeps for the backward, beyond the parameters (unique storages)."""

    def __init__(self, params) -> None:
        self.skip = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in params}
        self.seen = {}

    def pack(self, t):
        try:
            st = getattr(t, "_local_tensor", t).untyped_storage()
            if st.data_ptr() not in self.skip:
                self.seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


# ------------------------------------------------------------------------------------------
# One configuration on the ranks of the current group
# ------------------------------------------------------------------------------------------


def _fmt_comm(comm: dict) -> dict:
    return {f"{d}/{k}": [int(c), int(b)] for (d, k), (c, b) in sorted(comm.items())}


def measure_case(layout: str, depth, block: str, mesh, shape: dict, *, chunks=None,
                 repeats: int = 0, warmup: int = 0, steps_per_sample: int = 1) -> dict:
    """Checks one block against the unsharded one, counts its collectives in that same step,
    asserts measured == derived (collectives per group and kind, parameter and activation
    bytes) on every rank, then times it (``repeats`` samples). Every rank raises if any rank
    fails, naming what differs."""
    import tpx

    world = dist.get_world_size()
    default_chunks = tpx.build_info()["default_chunks"]
    der = derive(layout, block, world, depth, chunks=chunks, default_chunks=default_chunks,
                 **shape)
    ref = reference_block(block, shape, der["blocks"])
    blk = shard_block(ref, block, layout, mesh, shape, chunks)
    gen = torch.Generator().manual_seed(SEED + 1)
    x_full = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen)
    g_full = torch.randn(shape["batch"], shape["seq"], shape["hidden"], generator=gen)
    xr = x_full.clone().requires_grad_(True)
    y_ref = step(ref, xr, g_full)

    x = tpx.split_input(x_full, mesh).detach().clone().requires_grad_(True)
    g = tpx.split_input(g_full, mesh).detach().clone()
    acts = ActivationBytes(blk)
    saved = SavedBytes(list(blk.parameters()))
    with tpx.comm_stats() as stats, torch.autograd.graph.saved_tensors_hooks(saved.pack,
                                                                             lambda t: t):
        y = step(blk, x, g)
    acts.remove()
    act_bytes = acts.total + _nbytes(x) + _nbytes(y)
    names = {mesh.get_group(d).group_name: d for d in mesh.mesh_dim_names}

    errors = []
    measured = {}
    for (gname, kind), cb in stats.counts.items():
        if gname not in names:
            errors.append(f"a collective on group {gname!r}, which is no dimension of the mesh")
            continue
        measured[(names[gname], kind)] = cb
    checks = [("output", y, tpx.split_input(y_ref.detach(), mesh)),
              ("input gradient", x.grad, tpx.split_input(xr.grad, mesh))]
    checks += [(f"gradient of {n}", got, want)
               for n, got, want in expected_param_grads(ref, blk, layout, mesh)]
    for what, got, want in checks:
        try:
            if got is None:
                raise AssertionError("it is None")
            got = getattr(got, "_local_tensor", got)  # a DTensor parameter's gradient: its part
            torch.testing.assert_close(got.detach(), want.detach(), **TOL)
        except AssertionError as e:
            errors.append(f"the {what} differs from the unsharded block: {e}")
    der_comm = {k: tuple(v) for k, v in der["comm"].items()}
    if measured != der_comm:
        keys = sorted(set(measured) | set(der_comm))
        diff = "; ".join(f"{d}/{k}: measured {measured.get((d, k), (0, 0))} derived "
                         f"{der_comm.get((d, k), (0, 0))}" for d, k in keys
                         if measured.get((d, k)) != der_comm.get((d, k)))
        errors.append(f"collectives (calls, bytes) differ from the derivation: {diff}")
    param_bytes = sum(_nbytes(p) for p in blk.parameters())
    if param_bytes != der["params"]:
        errors.append(f"parameter bytes: measured {param_bytes}, derived {der['params']}")
    if act_bytes != der["activations"]:
        errors.append(f"activation bytes: measured {act_bytes}, derived {der['activations']}")
    case = f"{layout}{'' if depth is None else f' d={depth}'} P={world} {block}"
    error = f"{case} on rank {dist.get_rank()}: " + " | ".join(errors) if errors else ""
    flag = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise AssertionError(error or f"{case}: another rank disagrees with the derivation or "
                                      "the unsharded block; see its error")
    saved_max = torch.tensor([float(saved.total)])
    dist.all_reduce(saved_max, op=dist.ReduceOp.MAX)

    times = time_steps(blk, x, g, warmup, repeats, steps_per_sample) if repeats else []
    calls, nbytes = totals(der_comm)
    return dict(world=world, layout=layout, depth=depth, block=block,
                mesh=dict(zip(mesh.mesh_dim_names, mesh.shape)), shape=shape,
                chunks=chunks, default_chunks=default_chunks,
                measured_comm=_fmt_comm(measured), derived_comm=_fmt_comm(der_comm),
                calls=calls, bytes=nbytes, ring_bytes=ring_bytes(der_comm, der["sizes"]),
                params_bytes=param_bytes, params_bytes_derived=der["params"],
                activation_bytes=act_bytes, activation_bytes_derived=der["activations"],
                saved_bytes_max=int(saved_max.item()), times_ms=times,
                median_ms=statistics.median(times) if times else None)


def time_steps(model, x, g, warmup: int, repeats: int, steps_per_sample: int) -> list:
    """Per-step wall times in ms; a sample = ``steps_per_sample`` steps after one barrier;
    its time is the max over ranks."""
    for _ in range(warmup):
        step(model, x, g)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps_per_sample):
            step(model, x, g)
        times.append((time.perf_counter() - t0) * 1e3 / steps_per_sample)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def cases_for(world: int, shape: dict) -> list:
    """(layout, depth, block, reason it is not applicable or None) for one world size."""
    out = []
    for layout, depth in CONFIGS[world]:
        for block in BLOCKS:
            try:
                derive(layout, block, world, depth, **shape)
                out.append((layout, depth, block, None))
            except NotApplicable as e:
                out.append((layout, depth, block, str(e)))
    return out


def run_world(rank: int, world: int, args, init_method: str) -> None:
    """All configurations of one world size (one group of spawned ranks)."""
    import tpx

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) >= world:
        os.sched_setaffinity(0, {cpus[rank]})
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        env = environment(torch.device("cpu"), world, "gloo")
        oversubscribed = world > (len(cpus) or os.cpu_count() or 1)
        rows = []
        shape = args.shape
        unsharded = {}
        if args.repeats:
            for block in BLOCKS:  # the unsharded block in one process, the others waiting
                if rank == 0:
                    ref = reference_block(block, shape, 1)
                    xr = torch.randn(shape["batch"], shape["seq"], shape["hidden"],
                                     requires_grad=True)
                    gr = torch.randn_like(xr)
                    for _ in range(args.warmup):
                        step(ref, xr, gr)
                    ts = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        for _ in range(args.block):
                            step(ref, xr, gr)
                        ts.append((time.perf_counter() - t0) * 1e3 / args.block)
                    unsharded[block] = statistics.median(ts)
                dist.barrier()
        meshes = {}
        for layout, depth, block, reason in cases_for(world, shape):
            if reason is not None:
                rows.append(dict(world=world, layout=layout, depth=depth, block=block,
                                 not_applicable=reason))
                continue
            if (layout, depth) not in meshes:
                meshes[(layout, depth)] = tpx.init_mesh(
                    layout, **({"depth": depth} if layout == "2.5d" else {}))
            if rank == 0:
                print(f"  P={world} {layout}{'' if depth is None else f' d={depth}'} {block} ...",
                      flush=True)
            r = measure_case(layout, depth, block, meshes[(layout, depth)], shape,
                             chunks=args.chunks, repeats=args.repeats, warmup=args.warmup,
                             steps_per_sample=args.block)
            r["oversubscribed"] = oversubscribed
            r["unsharded_ms"] = unsharded.get(block)
            rows.append(r)
        if rank == 0:
            Path(args.partial).write_text(json.dumps(dict(environment=env, rows=rows)))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Extrapolation of the derived model, crossovers, plot
# ------------------------------------------------------------------------------------------

MODEL_LAYOUTS = [("1d", None), ("2d", None), ("2.5d", 2), ("3d", None)]


def model_worlds(layout: str, depth, max_world: int = 1024) -> list:
    """The world sizes up to ``max_world`` that fit a layout: 2-D q^2, 2.5-D d q^2, 3-D q^3
    (q >= 2); 1-D every power of two and every size of the others."""
    if layout == "1d":
        sizes = {2 ** k for k in range(1, 11)}
        for other, d in MODEL_LAYOUTS[1:]:
            sizes |= set(model_worlds(other, d, max_world))
        return sorted(p for p in sizes if p <= max_world)
    power, mult = {"2d": (2, 1), "2.5d": (2, depth or 1), "3d": (3, 1)}[layout]
    out, q = [], 2
    while mult * q ** power <= max_world:
        out.append(mult * q ** power)
        q += 1
    return out


TABLE_WORLDS = (4, 8, 9, 16, 27, 32, 64, 128, 256, 512, 1024)


def model_point(layout: str, depth, block: str, world, shape: dict) -> dict:
    d = derive(layout, block, world, depth, chunks=1, exact=False, **shape)
    calls, nbytes = totals(d["comm"])
    return dict(world=world, calls=calls, bytes=nbytes,
                ring_bytes=ring_bytes(d["comm"], d["sizes"]),
                params=d["params"], activations=d["activations"])


MIN_WORLD = {"1d": 2, "2d": 4, "3d": 8}


def _min_world(layout: str, depth) -> int:
    return 4 * depth if layout == "2.5d" else MIN_WORLD[layout]


def crossover(layout: str, depth, other: str, other_depth, block: str, shape: dict,
              metric: str, hi: float = 1e7):
    """The smallest real P (at least the smallest world of both layouts) from which
    ``layout``'s derived ``metric`` stays below ``other``'s, with q taken real; None if it
    does not within ``hi``."""
    lo = max(_min_world(layout, depth), _min_world(other, other_depth))
    grid = [lo * (hi / lo) ** (i / 1200) for i in range(1201)]

    def below(p):
        a = model_point(layout, depth, block, p, shape)[metric]
        b = model_point(other, other_depth, block, p, shape)[metric]
        return a < b

    flags = [(p, below(p)) for p in grid]
    if not flags[-1][1]:
        return None
    i = len(flags) - 1
    while i > 0 and flags[i - 1][1]:
        i -= 1
    return flags[i][0]


def extrapolate(shapes: dict) -> dict:
    out = {}
    for sname, shape in shapes.items():
        curves = {}
        for layout, depth in MODEL_LAYOUTS:
            key = layout if depth is None else f"{layout} d={depth}"
            curves[key] = {block: [model_point(layout, depth, block, p, shape)
                                   for p in model_worlds(layout, depth)] for block in BLOCKS}
        cross = []
        for block in BLOCKS:
            for metric in ("ring_bytes", "bytes"):
                for (a, ad), (b, bd) in [(("2d", None), ("1d", None)),
                                         (("2.5d", 2), ("1d", None)),
                                         (("3d", None), ("1d", None)),
                                         (("3d", None), ("2d", None)),
                                         (("2.5d", 2), ("2d", None))]:
                    p = crossover(a, ad, b, bd, block, shape, metric)
                    cross.append(dict(block=block, metric=metric,
                                      layout=a if ad is None else f"{a} d={ad}",
                                      beats=b if bd is None else f"{b} d={bd}",
                                      from_world=p))
        out[sname] = dict(shape=shape, curves=curves, crossovers=cross)
    return out


def plot(model: dict, rows: list, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"1d": "tab:blue", "2d": "tab:orange", "2.5d d=2": "tab:green", "3d": "tab:red"}
    names = list(model)
    fig, axes = plt.subplots(1, len(names), figsize=(6.2 * len(names), 4.6))
    axes = axes if len(names) > 1 else [axes]
    for ax, sname in zip(axes, names):
        shape = model[sname]["shape"]
        for key, curves in model[sname]["curves"].items():
            pts = curves["mlp"]
            ps = [p["world"] for p in pts]
            ax.plot(ps, [p["ring_bytes"] for p in pts], "-o", color=colors[key], ms=2.5,
                    label=f"{key}: ring-model bytes")
            ax.plot(ps, [p["bytes"] for p in pts], "--", color=colors[key], lw=1, alpha=0.7,
                    label=f"{key}: counted payload")
        if sname == "benchmark":  # measured points on the model's curves (2.5-D: d = 2 only)
            for r in rows:
                key = r.get("layout", "") + ("" if r.get("depth") is None
                                             else f" d={r['depth']}")
                if r.get("block") != "mlp" or "bytes" not in r or key not in colors:
                    continue
                ax.plot([r["world"]], [r["bytes"]], "x", color=colors[key], ms=9, mew=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
        ax.set_xticklabels(["2", "4", "8", "16", "32", "64", "128", "256", "512", "1024"])
        ax.set_yscale("log")
        ax.set_xlabel("P (ranks)")
        ax.set_ylabel("bytes per rank per fwd+bwd (MLP block)")
        n = shape["batch"] * shape["seq"]
        ax.set_title(f"{sname}: N={n} tokens, H={shape['hidden']}, F=4H, fp32"
                     + ("\nx = measured by tpx.comm_stats()" if sname == "benchmark" else ""),
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def _kib(b) -> str:
    return f"{b / 1024:.1f}"


def _label(r) -> str:
    return r["layout"] + ("" if r["depth"] is None else f" d={r['depth']}")


def print_tables(rows: list, model: dict, cpus: int) -> None:
    ok = [r for r in rows if "bytes" in r]
    table, notes = [], []
    for r in rows:
        if "not_applicable" in r:
            table.append([r["world"], _label(r), r["block"], "n/a"] + [""] * 10)
            notes.append(f"n/a: {_label(r)} {r['block']} at P={r['world']}: "
                         f"{r['not_applicable']}")
            continue
        med = "" if r["median_ms"] is None else f"{r['median_ms']:.2f}"
        note = "oversubscribed" if r.get("oversubscribed") else ""
        mc, mb = totals({k: tuple(v) for k, v in r["measured_comm"].items()})
        table.append([r["world"], _label(r), r["block"], mc, r["calls"], mb, r["bytes"],
                      _kib(r["ring_bytes"]),
                      _kib(r["params_bytes"]), _kib(r["activation_bytes"]),
                      _kib(r["saved_bytes_max"]), med,
                      "" if r.get("unsharded_ms") is None else f"{r['unsharded_ms']:.2f}", note])
    print("\nper rank, one forward + backward, fp32. calls, bytes: measured by tpx.comm_stats() "
          "(payload as it counts it) and derived, asserted equal per group and kind; ring: "
          "derived bytes received under ring algorithms; params, act: measured (= derived, "
          "asserted); saved: measured, max over ranks; KiB = 1024 B; ms/step: median, max over "
          f"ranks ({cpus} cores)")
    print(format_table(["P", "layout", "block", "calls", "derived", "bytes", "derived",
                        "ring KiB",
                        "params KiB", "act KiB", "saved KiB", "ms/step", "unsharded ms",
                        "note"], table, text_columns=3))
    for n in notes:
        print(n)
    detail = []
    for r in ok:
        for key, (c, b) in r["measured_comm"].items():
            dc, db = r["derived_comm"][key]
            detail.append([r["world"], _label(r), r["block"], key, c, dc, b, db])
    print("\nper group and kind (measured vs derived calls and bytes)")
    print(format_table(["P", "layout", "block", "group/kind", "calls", "derived", "bytes",
                        "derived"], detail, text_columns=4))
    for sname, m in model.items():
        s = m["shape"]
        print(f"\nderived model, {sname} shape (N={s['batch'] * s['seq']}, H={s['hidden']}): "
              "MLP block bytes per rank (ring model | counted payload)")
        worlds = TABLE_WORLDS
        head = ["layout"] + [str(p) for p in worlds]
        trows = []
        for key, c in m["curves"].items():
            by = {p["world"]: p for p in c["mlp"]}
            trows.append([key] + [(f"{_human(by[p]['ring_bytes'])}|{_human(by[p]['bytes'])}"
                                   if p in by else "") for p in worlds])
        print(format_table(head, trows))
        cr = [[c["block"], c["metric"], c["layout"], c["beats"], _from(c)]
              for c in m["crossovers"]]
        print("crossovers (q real): the first P from which `layout` needs fewer bytes than "
              "`beats`")
        print(format_table(["block", "metric", "layout", "beats", "from P ="], cr,
                           text_columns=4))


def _from(c: dict) -> str:
    p = c["from_world"]
    if p is None:
        return "never (P < 1e7)"
    lo = max(_min_world(*_split_label(c["layout"])), _min_world(*_split_label(c["beats"])))
    if p <= lo * 1.0001:
        return f"always (P >= {lo})"
    return f"{p:.0f}" if p < 1e5 else f"{p:.1e}"


def _split_label(label: str) -> tuple:
    layout, _, d = label.partition(" d=")
    return layout, int(d) if d else None


def _human(b: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if b >= div:
            return f"{b / div:.3g}{unit}"
    return f"{b:.3g}"



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default=",".join(str(w) for w in CONFIGS),
                   help=f"comma-separated world sizes, from {list(CONFIGS)} (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="P = 4 only, 3 samples of 2 steps, 1 warm-up; results to *_quick.*")
    p.add_argument("--repeats", type=int, default=None, help="timed samples (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    p.add_argument("--block", type=int, default=None,
                   help="steps per timed sample (default 5)")
    p.add_argument("--chunks", type=int, default=None,
                   help="pipeline depth of the 1-D and 3-D ops (default: the ops' default)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/bench_multidim_cpu.json)")
    p.add_argument("--plot", default=None,
                   help="plot path (default benchmarks/results/multidim_bytes.png)")
    args = p.parse_args(argv)
    try:
        args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    except ValueError:
        p.error(f"--worlds: comma-separated integers from {list(CONFIGS)}")
    if args.quick:
        args.worlds = [4]
        args.repeats = 3 if args.repeats is None else args.repeats
        args.warmup = 1 if args.warmup is None else args.warmup
        args.block = 2 if args.block is None else args.block
    bad = [w for w in args.worlds if w not in CONFIGS]
    if bad or not args.worlds:
        p.error(f"--worlds: choose from {list(CONFIGS)}; got {bad or 'nothing'}")
    args.repeats = 10 if args.repeats is None else args.repeats
    args.warmup = 3 if args.warmup is None else args.warmup
    args.block = 5 if args.block is None else args.block
    if args.repeats < 0 or args.warmup < 0 or args.block < 1:
        p.error("--repeats and --warmup must be >= 0, --block >= 1")
    if args.chunks is not None and args.chunks < 1:
        p.error("--chunks must be >= 1")
    suffix = "_quick" if args.quick else ""
    args.out = Path(args.out or RESULTS_DIR / f"bench_multidim_cpu{suffix}.json")
    args.plot = Path(args.plot or RESULTS_DIR / f"multidim_bytes{suffix}.png")
    args.shape = dict(SHAPE)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rows, env = [], None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for world in args.worlds:
        layouts = ", ".join(_label(dict(layout=lay, depth=d)) for lay, d in CONFIGS[world])
        print(f"running P={world} ({layouts}; "
              f"{'oversubscribed: ' if world > cpus else ''}{world} ranks on {cpus} cores) ...",
              flush=True)
        fd, partial = tempfile.mkstemp(prefix=f"bench_multidim_p{world}_", suffix=".json")
        os.close(fd)
        args.partial = partial
        try:
            spawn_ranks(run_world, world, args, f"bench_multidim_p{world}")
            data = json.loads(Path(partial).read_text())
        finally:
            os.unlink(partial)
        env = env or dict(data["environment"], world_size=args.worlds)
        rows += data["rows"]
    print_env(env)
    model = extrapolate({"benchmark": args.shape, "large": LARGE_SHAPE})
    print_tables(rows, model, cpus)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k != "partial"}
    payload = dict(benchmark="bench_multidim: 1-D / 2-D / 2.5-D / 3-D TP, MLP and attention "
                             "blocks, measured vs derived communication",
                   bytes_definition=dict(
                       counted="payload per collective as tpx.comm_stats() counts it: broadcast, "
                               "all_reduce, reduce = the whole buffer; all_gather = this rank's "
                               "input; reduce_scatter = this rank's output",
                       ring="bytes received per rank (group average) under ring / pipelined "
                            "algorithms: all_reduce 2(p-1)/p S, all_gather and reduce_scatter "
                            "(p-1) S, broadcast and reduce (p-1)/p S"),
                   config=dict(config, seed=SEED, tolerance=TOL, dtype="float32"),
                   environment=env, results=rows, model=model)
    print(f"\nwrote {write_json(args.out, payload)}")
    print(f"wrote {plot(model, rows, args.plot)}")


if __name__ == "__main__":
    main()
