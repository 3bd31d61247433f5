"""The collective matmuls against the unsharded torch computation, forward and every gradient,
at world sizes 1-4, chunks 1/2/4/default, 2-D and 3-D inputs, uneven shard widths."""

import itertools
import time

import pytest
import torch
import torch.distributed as dist

import tpx
from harness import run_ranks, local_vs

WORLD_SIZES = [1, 2, 3, 4]
CHUNKS = [1, 2, 4, None]


def close(actual, expected, what):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def randn(*shape, gen, dev):
    """Drawn on the CPU from `gen` (the same numbers on every rank), then moved to `dev`."""
    return torch.randn(*shape, generator=gen).to(dev)


# (global shape of the gathered / scattered operand, dim) cases; the dim's global size is
# world * 3 so that every rank holds 3 entries along it (chunks 4 > 3 exercises clamping).
def _layouts(world, k):
    return [((world * 3, k), 0),
            ((2, world * 3, k), 1),
            ((world * 3, 2, k), 0),
            ((2, world * 3, k), -2)]


def _check_all_gather_matmul(rank, world, dev="cpu"):
    gen = torch.Generator().manual_seed(100 + world)
    k, n = 6, 5 * world + 1  # n does not divide: uneven column shards
    c0, c1 = tpx.shard_range(n)
    for (shape, gd), chunks, with_bias, transposed in itertools.product(
            _layouts(world, k), CHUNKS, (False, True), (True, False)):
        case = f"shape={shape} gather_dim={gd} chunks={chunks} bias={with_bias} b.T={transposed}"
        full_a = randn(shape, gen=gen, dev=dev)
        B = randn(k, n, gen=gen, dev=dev)
        bias = randn(n, gen=gen, dev=dev)
        gy = randn(list(shape[:-1]) + [n], gen=gen, dev=dev)
        gag = [randn(shape, gen=gen, dev=dev) for _ in range(world)]  # grad of every copy

        fa, fB, fbias = leaf(full_a), leaf(B), leaf(bias)
        ref = fa @ fB + (fbias if with_bias else 0)
        ((ref * gy).sum() + sum((fa * g).sum() for g in gag)).backward()

        s = shape[gd] // world
        a = leaf(full_a.narrow(gd, rank * s, s))
        if transposed:
            w = leaf(B[:, c0:c1].t())
            b = w.t()
        else:
            w = leaf(B[:, c0:c1])
            b = w
        bias_r = leaf(bias[c0:c1]) if with_bias else None
        gathered, out = tpx.ops.all_gather_matmul(a, b, gd, chunks=chunks, bias=bias_r)
        assert torch.equal(gathered, full_a), case
        close(out, ref[..., c0:c1].detach(), f"out {case}")
        ((out * gy[..., c0:c1]).sum() + (gathered * gag[rank]).sum()).backward()
        close(a.grad, fa.grad.narrow(gd, rank * s, s), f"grad a {case}")
        grad_b = w.grad.t() if transposed else w.grad
        close(grad_b, fB.grad[:, c0:c1], f"grad b {case}")
        if with_bias:
            close(bias_r.grad, fbias.grad[c0:c1], f"grad bias {case}")


def _check_matmul_reduce_scatter(rank, world, dev="cpu"):
    gen = torch.Generator().manual_seed(200 + world)
    k, n = 4 * world + 1, 7  # k does not divide: uneven contraction shards
    k0, k1 = tpx.shard_range(k)
    for (shape, sd), chunks, with_bias, transposed in itertools.product(
            _layouts(world, k), CHUNKS, (False, True), (True, False)):
        case = f"shape={shape} scatter_dim={sd} chunks={chunks} bias={with_bias} b.T={transposed}"
        A = randn(shape, gen=gen, dev=dev)
        B = randn(k, n, gen=gen, dev=dev)
        bias = randn(n, gen=gen, dev=dev)
        gy = randn(list(shape[:-1]) + [n], gen=gen, dev=dev)

        fA, fB, fbias = leaf(A), leaf(B), leaf(bias)
        ref = fA @ fB + (fbias if with_bias else 0)
        (ref * gy).sum().backward()

        s = shape[sd] // world
        a = leaf(A[..., k0:k1])
        w = leaf(B[k0:k1].t() if transposed else B[k0:k1])
        b = w.t() if transposed else w
        bias_r = leaf(bias) if with_bias else None
        out = tpx.ops.matmul_reduce_scatter(a, b, sd, chunks=chunks, bias=bias_r)
        close(out, ref.narrow(sd, rank * s, s).detach(), f"out {case}")
        (out * gy.narrow(sd, rank * s, s)).sum().backward()
        close(a.grad, fA.grad[..., k0:k1], f"grad a {case}")
        close(w.grad.t() if transposed else w.grad, fB.grad[k0:k1], f"grad b {case}")
        if with_bias:  # replicated parameter: the full gradient on every rank
            close(bias_r.grad, fbias.grad, f"grad bias {case}")


def _check_matmul_all_reduce(rank, world, dev="cpu"):
    gen = torch.Generator().manual_seed(300 + world)
    k, n = 4 * world + 1, 7
    k0, k1 = tpx.shard_range(k)
    shapes = [(9, k), (2, 5, k), (3, 1, 4, k)]
    for shape, chunks, with_bias in itertools.product(shapes, CHUNKS, (False, True)):
        case = f"shape={shape} chunks={chunks} bias={with_bias}"
        A = randn(shape, gen=gen, dev=dev)
        B = randn(k, n, gen=gen, dev=dev)
        bias = randn(n, gen=gen, dev=dev)
        gy = randn(list(shape[:-1]) + [n], gen=gen, dev=dev)
        fA, fB, fbias = leaf(A), leaf(B), leaf(bias)
        ref = fA @ fB + (fbias if with_bias else 0)
        (ref * gy).sum().backward()

        a, w = leaf(A[..., k0:k1]), leaf(B[k0:k1].t())
        bias_r = leaf(bias) if with_bias else None
        out = tpx.ops.matmul_all_reduce(a, w.t(), chunks=chunks, bias=bias_r)
        close(out, ref.detach(), f"out {case}")
        (out * gy).sum().backward()
        close(a.grad, fA.grad[..., k0:k1], f"grad a {case}")
        close(w.grad.t(), fB.grad[k0:k1], f"grad b {case}")
        if with_bias:
            close(bias_r.grad, fbias.grad, f"grad bias {case}")


def _check_replicated_matmul(rank, world, dev="cpu"):
    gen = torch.Generator().manual_seed(400 + world)
    k, n = 6, 5 * world + 1
    c0, c1 = tpx.shard_range(n)
    shapes = [(9, k), (2, 5, k)]
    for shape, chunks, with_bias in itertools.product(shapes, CHUNKS, (False, True)):
        case = f"shape={shape} chunks={chunks} bias={with_bias}"
        A = randn(shape, gen=gen, dev=dev)
        B = randn(k, n, gen=gen, dev=dev)
        bias = randn(n, gen=gen, dev=dev)
        gy = randn(list(shape[:-1]) + [n], gen=gen, dev=dev)
        fA, fB, fbias = leaf(A), leaf(B), leaf(bias)
        ref = fA @ fB + (fbias if with_bias else 0)
        (ref * gy).sum().backward()

        a, w = leaf(A), leaf(B[:, c0:c1].t())
        bias_r = leaf(bias[c0:c1]) if with_bias else None
        out = tpx.ops.replicated_matmul(a, w.t(), chunks=chunks, bias=bias_r)
        close(out, ref[..., c0:c1].detach(), f"out {case}")
        (out * gy[..., c0:c1]).sum().backward()
        close(a.grad, fA.grad, f"grad a (all-reduced) {case}")
        close(w.grad.t(), fB.grad[:, c0:c1], f"grad b {case}")
        if with_bias:
            close(bias_r.grad, fbias.grad[c0:c1], f"grad bias {case}")


def _check_all_ops(rank, world, dev="cpu"):
    _check_all_gather_matmul(rank, world, dev)
    _check_matmul_reduce_scatter(rank, world, dev)
    _check_matmul_all_reduce(rank, world, dev)
    _check_replicated_matmul(rank, world, dev)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_match_unsharded(world):
    run_ranks(_check_all_ops, world)


def _check_chunks_agree(rank, world, dev="cpu"):
    """Every pipeline depth gives the numbers of chunks=1 (the non-overlapped reference)."""
    gen = torch.Generator().manual_seed(7)
    a = randn(2, 8, 16, gen=gen, dev=dev)
    b = randn(16, 12, gen=gen, dev=dev)
    ref_g, ref = tpx.ops.all_gather_matmul(a, b, 1, chunks=1)
    ref_rs = tpx.ops.matmul_reduce_scatter(ref, b.t(), 1, chunks=1)
    ref_ar = tpx.ops.matmul_all_reduce(a, b, chunks=1)
    for c in (2, 3, 4, 8):
        g, out = tpx.ops.all_gather_matmul(a, b, 1, chunks=c)
        assert torch.equal(g, ref_g)
        close(out, ref, f"all_gather_matmul chunks={c}")
        close(tpx.ops.matmul_reduce_scatter(ref, b.t(), 1, chunks=c), ref_rs,
              f"matmul_reduce_scatter chunks={c}")
        close(tpx.ops.matmul_all_reduce(a, b, chunks=c), ref_ar, f"matmul_all_reduce chunks={c}")


@pytest.mark.parametrize("world", [2, 3])
def test_chunks_match_reference(world):
    run_ranks(_check_chunks_agree, world)


def _check_weight_argument(rank, world):
    """``weight=`` (a Linear weight, the transpose of ``b``) gives what ``b`` gives: output and
    the gradients of the input, the weight and the bias."""
    gen = torch.Generator().manual_seed(11 + rank)
    for op, k in ((tpx.ops.replicated_matmul, 16), (tpx.ops.matmul_all_reduce, 5 + rank)):
        x, w, bias = (randn(3, k, gen=gen, dev="cpu"), randn(12, k, gen=gen, dev="cpu"),
                      randn(12, gen=gen, dev="cpu"))
        grads = []
        for use_weight in (False, True):
            leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
            a, wl, bl = leaves
            out = (op(a, None, bias=bl, weight=wl) if use_weight else op(a, wl.t(), bias=bl))
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            grads.append([out.detach()] + [t.grad for t in leaves])
        for name, got, want in zip(("out", "grad x", "grad weight", "grad bias"), *grads[::-1]):
            assert torch.equal(got, want), f"{op.__name__} {name} with weight="


@pytest.mark.parametrize("world", [1, 2])
def test_weight_argument_matches_b(world):
    run_ranks(_check_weight_argument, world)


def _opcheck_all(rank, world, dev="cpu"):
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    w = torch.randn(6, 8, generator=gen, requires_grad=True)
    bias = torch.randn(6, generator=gen, requires_grad=True)
    r = torch.randn(2, 4 * world, 8, generator=gen, requires_grad=True)
    cases = [
        (torch.ops.tpx.all_gather_matmul.default, (a, w.t(), 1, name, 2, bias)),
        (torch.ops.tpx.all_gather_matmul.default, (a, w.t(), 0, name, 1, None)),
        (torch.ops.tpx.matmul_reduce_scatter.default, (r, w.t(), 1, name, 2, bias)),
        (torch.ops.tpx.matmul_all_reduce.default, (a, w.t(), name, 2, bias)),
        (torch.ops.tpx.replicated_matmul.default, (a, w.t(), name, 2, bias)),
    ]
    # The backward operators, on inputs shaped as their forwards produce them.
    g_ag = randn(2, 4 * world, 6, gen=gen, dev="cpu")
    gathered = randn(2, 4 * world, 8, gen=gen, dev="cpu")
    cases += [
        (torch.ops.tpx.all_gather_matmul_backward.default,
         (g_ag, None, gathered, w.detach().t(), 1, name, 2, True, True, True)),
        (torch.ops.tpx.all_gather_matmul_backward.default,
         (g_ag, gathered.clone(), gathered, w.detach().t(), 1, name, 1, True, True, False)),
        (torch.ops.tpx.all_gather_matmul_backward.default,
         (g_ag, None, gathered, w.detach().t(), 1, name, 2, False, True, False)),
        (torch.ops.tpx.all_gather_matmul_backward.default,
         (g_ag, None, gathered, w.detach().t(), 1, name, 2, True, False, True)),
        (torch.ops.tpx.matmul_reduce_scatter_backward.default,
         (randn(2, 4, 6, gen=gen, dev="cpu"), r.detach(), w.detach().t(), 1, name, 2,
          True, True, True)),
        (torch.ops.tpx.matmul_reduce_scatter_backward.default,
         (randn(2, 4, 6, gen=gen, dev="cpu"), r.detach(), w.detach().t(), 1, name, 2,
          False, False, True)),
        (torch.ops.tpx.replicated_matmul_backward.default,
         (randn(2, 4, 6, gen=gen, dev="cpu"), a.detach(), w.detach().t(), name, 2,
          True, True, False)),
        (torch.ops.tpx.replicated_matmul_backward.default,
         (randn(2, 4, 6, gen=gen, dev="cpu"), a.detach(), w.detach().t(), name, 2,
          False, True, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(world):
    run_ranks(_opcheck_all, world)


def _check_gather_memory(rank, world):
    """all_gather_matmul at chunks=4 needs no more memory than the non-overlapped reference
    (chunks=1): one gathered input (the chunk-major staging buffer the GEMMs read) and the
    output. Counted over every CPU allocation of the process, the process group's included:
    gloo implements even a flat all-gather by flattening through one temporary of the
    gathered size on its worker thread, so the bound is the staging buffer, gloo's temporary
    and the output. A rank-ordered copy of the gathered input, or a temporary per chunk kept
    alive, would exceed it."""
    torch.manual_seed(0)
    rows, k, n = 64, 256, 8
    a = torch.randn(rows, k)
    b = torch.randn(k, n)
    gathered_bytes = world * a.numel() * a.element_size()
    out_bytes = world * rows * n * a.element_size()
    slack = 64 * 1024  # small bookkeeping allocations
    peaks = {}
    with tpx.memory.track_cpu():  # installs the counting allocator
        pass
    for chunks in (1, 4):
        base = tpx.memory.cpu_memory_allocated()
        tpx.ops.all_gather_matmul(a, b, 0, chunks=chunks, return_gathered=False)  # warm-up
        # Gloo's worker thread frees the warm-up's temporary just after wait() returns; the
        # block below must start after that, or the free would hide part of its own peak.
        deadline = time.monotonic() + 10
        while tpx.memory.cpu_memory_allocated() > base and time.monotonic() < deadline:
            time.sleep(0.001)
        with tpx.memory.track_cpu() as mem:
            _, out = tpx.ops.all_gather_matmul(a, b, 0, chunks=chunks, return_gathered=False)
        ref_g, _ = tpx.ops.all_gather_matmul(a, b, 0, chunks=1)
        close(out, ref_g @ b, f"chunks={chunks}")
        peaks[chunks] = mem.peak_extra
        assert mem.peak_extra >= gathered_bytes, "the accounting missed the staging buffer"
        assert mem.peak_extra <= 2 * gathered_bytes + out_bytes + slack, (
            f"chunks={chunks}: peak extra {mem.peak_extra} bytes > the staging buffer and gloo's "
            f"temporary (2 x {gathered_bytes}) + the output ({out_bytes})")
    assert peaks[4] <= peaks[1] + slack, f"the pipeline costs extra memory: {peaks}"


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_matmul_peak_memory(world):
    # fresh: the counting allocator must be installed before the process allocates
    run_ranks(_check_gather_memory, world, fresh=True)


_ONEDNN_UNDER_ACCOUNTING = """
import torch, tpx
x = torch.randn(64, 4096, dtype=torch.bfloat16)
w = torch.randn(8, 3, 3, 3)
img = torch.randn(2, 3, 32, 32)
before = (torch.nn.functional.gelu(x), torch.nn.functional.conv2d(img, w))  # default allocator
with tpx.memory.track_cpu() as mem:
    after = (torch.nn.functional.gelu(x), torch.nn.functional.conv2d(img, w))
for b, a in zip(before, after):
    assert torch.equal(b, a)
assert mem.peak_extra >= x.numel() * x.element_size(), mem.peak_extra
del before  # memory oneDNN took before the wrapper, freed through it
print("ok")
"""


def test_memory_accounting_under_onednn():
    """oneDNN (bf16 GELU, convolutions) allocates through the CPU allocator's raw_allocate(),
    which requires a DataPtr whose context is its data: the counting wrapper must keep that,
    and free through the wrapped allocator what was taken before it was installed."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _ONEDNN_UNDER_ACCOUNTING], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_engine_issues_only_flat_gathers_and_scatters():
    """Every all-gather and reduce-scatter in the C++ engine is the flat form
    (``_allgather_base`` / ``_reduce_scatter_base``) into one contiguous block, chunked or not.
    The list-of-views forms make NCCL allocate a temporary of the whole message per call and
    copy it into the views on its stream; on gloo both forms flatten through a temporary, so
    the memory test above cannot tell them apart and this check of the sources does."""
    import pathlib
    import re

    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    pattern = re.compile(r"(\.|->)(allgather|reduce_scatter|allgather_coalesced)\s*\(")
    found = []
    for path in sorted(csrc.rglob("*.cpp")) + sorted(csrc.rglob("*.h")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("//", 1)[0]
            if pattern.search(code):
                found.append(f"{path.relative_to(csrc.parent)}:{n}: {line.strip()}")
    assert not found, "list-of-views collectives in the engine:\n" + "\n".join(found)


def _check_two_rank_exchange(rank, world):
    """On a two-rank gloo group tpx's all-reduce is a send/recv exchange: the same bits as
    gloo's all-reduce and on both ranks, several exchanges in flight (chunks), groups of two
    inside a larger world, and a clear error for a bad TPX_GLOO_ALLREDUCE. The choice is made
    once per group, when tpx first meets it, so each algorithm gets groups of its own."""
    import os

    gen = torch.Generator().manual_seed(7)
    a_full = torch.randn(11, 2 * world + 1, generator=gen)   # 11 rows: uneven chunks
    b_full = torch.randn(2 * world + 1, 9, generator=gen)

    def pair():
        pairs = [dist.new_group([0, 1])] if world == 2 else [dist.new_group([0, 2]),
                                                             dist.new_group([1, 3])]
        return pairs[0] if rank in (0, 2) else pairs[-1]

    groups = {}
    for algo in ("exchange", "gloo"):
        os.environ["TPX_GLOO_ALLREDUCE"] = algo
        groups[algo] = pair()
        tpx.ops.mesh_all_reduce(torch.ones(1), groups[algo].group_name)  # tpx meets it here
    os.environ.pop("TPX_GLOO_ALLREDUCE")
    pg = groups["exchange"]
    lo, hi = tpx.shard_range(b_full.shape[0], pg)
    a, b = a_full[:, lo:hi].contiguous(), b_full[lo:hi]
    want = a_full @ b_full
    for chunks in (1, 2, 4):
        got = {}
        for algo, group in groups.items():
            with tpx.comm_stats() as stats:
                got[algo] = tpx.ops.matmul_all_reduce(a, b, group, chunks)
            assert stats.calls(group, "all_reduce") == min(chunks, 11), stats
        close(got["exchange"], want, f"chunks={chunks}")
        assert torch.equal(got["exchange"], got["gloo"]), f"chunks={chunks}: not gloo's bits"
        theirs = [torch.empty_like(got["exchange"]) for _ in range(2)]
        dist.all_gather(theirs, got["exchange"], group=pg)
        assert torch.equal(theirs[0], theirs[1]), f"chunks={chunks}: ranks differ"
    x = torch.full((3,), float(rank))
    for algo, op in (("exchange", "c10d::send"), ("gloo", "c10d::allreduce_")):
        with torch.profiler.profile() as prof:
            tpx.ops.mesh_all_reduce(x, groups[algo].group_name)
        names = {e.name for e in prof.events()}
        assert op in names, f"{algo}: {op} was not issued ({sorted(names)})"
    total = tpx.ops.mesh_all_reduce(x, pg.group_name)
    assert torch.equal(total, torch.full((3,), float(sum(dist.get_process_group_ranks(pg))))), total
    bad = pair()
    dist.barrier()  # every rank has its connections of the new group before either one leaves
    os.environ["TPX_GLOO_ALLREDUCE"] = "ring"
    try:
        tpx.ops.mesh_all_reduce(x, bad.group_name)
    except ValueError as e:
        assert "TPX_GLOO_ALLREDUCE" in str(e) and "'gloo'" in str(e), e
    else:
        raise AssertionError("a bad TPX_GLOO_ALLREDUCE was accepted")
    finally:
        os.environ.pop("TPX_GLOO_ALLREDUCE")


@pytest.mark.parametrize("world", [2, 4])
def test_two_rank_all_reduce_is_an_exact_exchange(world):
    run_ranks(_check_two_rank_exchange, world)


def _check_exchange_dtype_mismatch(rank, world):
    """Ranks whose all-reduce buffers have the same byte count but different dtypes both raise
    a ValueError naming both, for the one-message (small) and the two-message (large) exchange,
    on the whole group of two or on pairs inside four ranks, and the group still works
    afterwards."""
    import os

    os.environ["TPX_GLOO_ALLREDUCE"] = "exchange"
    pairs = [dist.group.WORLD] if world == 2 else [dist.new_group([0, 2]),
                                                    dist.new_group([1, 3])]
    pg = pairs[0] if rank in (0, 2) else pairs[-1]
    first = dist.get_rank(pg) == 0
    for elements in (6, 400_000):  # 24 B / 48 B and 1.6 MB / 3.2 MB: both exchange forms
        x = torch.ones(2 * elements) if first else torch.ones(elements, dtype=torch.float64)
        try:
            tpx.ops.mesh_all_reduce(x, pg.group_name)
        except ValueError as e:
            msg = str(e)
            assert "different buffers" in msg and "Float" in msg and "Double" in msg, msg
            assert f"{x.numel() * x.element_size()} bytes" in msg, msg
        else:
            raise AssertionError(f"{elements} elements: mismatched dtypes were summed")
        y = torch.randn(5, generator=torch.Generator().manual_seed(rank))
        want = sum(torch.randn(5, generator=torch.Generator().manual_seed(r))
                   for r in dist.get_process_group_ranks(pg))
        close(tpx.ops.mesh_all_reduce(y, pg.group_name), want, "after the mismatch")


@pytest.mark.parametrize("world", [2, 4])
def test_two_rank_exchange_rejects_dtype_mismatch(world):
    run_ranks(_check_exchange_dtype_mismatch, world)


def _check_exchange_size_mismatch(rank, world, rows):
    """Rank 1 all-reduces one row more than rank 0. Rank 0 stops on gloo's own check of the
    longer message it received (the harness expects that rank to die). Rank 1 received a
    shorter message, and adding it would be a wrong answer: it raises the ValueError that
    names both sizes, or gloo's connection error when rank 0 died before its message was
    through. It must never return a sum."""
    import os
    import resource

    os.environ["TPX_GLOO_ALLREDUCE"] = "exchange"
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the expected abort leaves no core file
    a = torch.ones(rows + rank, 4)
    b = torch.ones(4, 3)
    try:
        out = tpx.ops.matmul_all_reduce(a, b, dist.group.WORLD, 1)
    except ValueError as e:
        assert rank == 1, f"rank {rank}: {e}"
        msg = str(e)
        assert "different buffers" in msg and f"{(rows + 1) * 3 * 4} bytes of Float" in msg, msg
        assert "rank 0's" in msg and "same shape" in msg, msg
        return
    except RuntimeError as e:
        assert rank == 1 and "Connection" in str(e), f"rank {rank}: {e}"
        return
    raise AssertionError(f"rank {rank} returned a sum of mismatched buffers: {out[:, 0]}")


@pytest.mark.parametrize("rows", [5, 100_000])  # 60 B, one message; 1.2 MB, two messages
def test_two_rank_exchange_rejects_size_mismatch(rows):
    run_ranks(_check_exchange_size_mismatch, 2, rows, crashes=(0,))
