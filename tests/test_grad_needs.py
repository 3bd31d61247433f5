"""Backward work follows ``requires_grad``: every op and layer, with every combination of
requires_grad on its input, weight and bias, gives the unsharded gradients where they exist
and ``None`` where they do not; a skipped input gradient costs no collective (counted with
``tpx.comm_stats``)."""

import itertools

import pytest
import torch
from torch import nn

import tpx
from harness import run_ranks, local_vs

COMBOS = list(itertools.product((True, False), repeat=3))  # (input, weight, bias)


def close(actual, expected, what):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _check_grad(t, ref, wanted, what):
    if wanted:
        assert t.grad is not None, f"{what}: gradient missing"
        close(t.grad, ref, what)
    else:
        assert t.grad is None, f"{what}: a gradient was computed although none was asked for"


def _leaf(t, req):
    return t.detach().clone().requires_grad_(req)


def _ops_case(rank, world):
    gen = torch.Generator().manual_seed(31 + world)
    k, n = 6, 3 * world + 1
    c0, c1 = tpx.shard_range(n)
    k0, k1 = tpx.shard_range(k)
    rows = 2 * world
    for (ra, rb, rbias), chunks in itertools.product(COMBOS, (1, 2, None)):
        if not (ra or rb or rbias):
            continue
        case = f"requires_grad a={ra} b={rb} bias={rbias} chunks={chunks}"
        A = torch.randn(2, rows, k, generator=gen)
        B = torch.randn(k, n, generator=gen)
        bias = torch.randn(n, generator=gen)
        gy = torch.randn(2, rows, n, generator=gen)
        fA, fB, fbias = _leaf(A, True), _leaf(B, True), _leaf(bias, True)
        (((fA @ fB) + fbias) * gy).sum().backward()
        s = rows // world

        # all_gather_matmul: a S(1), b S(1) -> out S(-1)
        a = _leaf(A.narrow(1, rank * s, s), ra)
        w = _leaf(B[:, c0:c1].t(), rb)
        bb = _leaf(bias[c0:c1], rbias)
        _, out = tpx.ops.all_gather_matmul(a, w.t(), 1, chunks=chunks, bias=bb,
                                           return_gathered=False)
        (out * gy[..., c0:c1]).sum().backward()
        _check_grad(a, fA.grad.narrow(1, rank * s, s), ra, f"all_gather_matmul grad a {case}")
        if rb:
            close(w.grad.t(), fB.grad[:, c0:c1], f"all_gather_matmul grad b {case}")
        else:
            assert w.grad is None, case
        _check_grad(bb, fbias.grad[c0:c1], rbias, f"all_gather_matmul grad bias {case}")

        # matmul_reduce_scatter: a S(-1), b S(0) -> out S(1); bias replicated
        a = _leaf(A[..., k0:k1], ra)
        w = _leaf(B[k0:k1].t(), rb)
        bb = _leaf(bias, rbias)
        out = tpx.ops.matmul_reduce_scatter(a, w.t(), 1, chunks=chunks, bias=bb)
        (out * gy.narrow(1, rank * s, s)).sum().backward()
        _check_grad(a, fA.grad[..., k0:k1], ra, f"matmul_reduce_scatter grad a {case}")
        if rb:
            close(w.grad.t(), fB.grad[k0:k1], f"matmul_reduce_scatter grad b {case}")
        else:
            assert w.grad is None, case
        _check_grad(bb, fbias.grad, rbias, f"matmul_reduce_scatter grad bias {case}")

        # replicated_matmul: a R, b S(1) -> out S(-1)
        a = _leaf(A, ra)
        w = _leaf(B[:, c0:c1].t(), rb)
        bb = _leaf(bias[c0:c1], rbias)
        out = tpx.ops.replicated_matmul(a, w.t(), chunks=chunks, bias=bb)
        (out * gy[..., c0:c1]).sum().backward()
        _check_grad(a, fA.grad, ra, f"replicated_matmul grad a {case}")
        if rb:
            close(w.grad.t(), fB.grad[:, c0:c1], f"replicated_matmul grad b {case}")
        else:
            assert w.grad is None, case
        _check_grad(bb, fbias.grad[c0:c1], rbias, f"replicated_matmul grad bias {case}")

        # matmul_all_reduce: a S(-1), b S(0) -> out R
        a = _leaf(A[..., k0:k1], ra)
        w = _leaf(B[k0:k1].t(), rb)
        bb = _leaf(bias, rbias)
        out = tpx.ops.matmul_all_reduce(a, w.t(), chunks=chunks, bias=bb)
        (out * gy).sum().backward()
        _check_grad(a, fA.grad[..., k0:k1], ra, f"matmul_all_reduce grad a {case}")
        if rb:
            close(w.grad.t(), fB.grad[k0:k1], f"matmul_all_reduce grad b {case}")
        else:
            assert w.grad is None, case
        _check_grad(bb, fbias.grad, rbias, f"matmul_all_reduce grad bias {case}")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ops_follow_requires_grad(world):
    run_ranks(_ops_case, world)


def _layers_case(rank, world):
    """column -> ReLU -> row, with and without sequence parallelism, frozen parts."""
    torch.manual_seed(5)
    d, h = 8, 3 * world + 2
    ref1, ref2 = nn.Linear(d, h), nn.Linear(h, d)
    gen = torch.Generator().manual_seed(6)
    x_full = torch.randn(2, 2 * world, d, generator=gen)
    gy = torch.randn(2, 2 * world, d, generator=gen)
    for sp, (rx, rw, rbias) in itertools.product((False, True), COMBOS):
        case = f"sp={sp} requires_grad x={rx} weights={rw} biases={rbias}"
        for ref in (ref1, ref2):
            ref.zero_grad(set_to_none=True)
        xr = x_full.clone().requires_grad_(True)
        (ref2(torch.relu(ref1(xr))) * gy).sum().backward()
        col = tpx.ColumnParallelLinear.from_linear(ref1, sequence_parallel=sp)
        row = tpx.RowParallelLinear.from_linear(ref2, sequence_parallel=sp)
        for layer in (col, row):
            layer.weight.requires_grad_(rw)
            layer.bias.requires_grad_(rbias)
        s = x_full.shape[1] // world
        x = (x_full.narrow(1, rank * s, s) if sp else x_full).clone().requires_grad_(rx)
        y = row(torch.relu(col(x)))
        if not y.requires_grad:
            continue
        (y * (gy.narrow(1, rank * s, s) if sp else gy)).sum().backward()
        _check_grad(x, xr.grad.narrow(1, rank * s, s) if sp else xr.grad, rx, f"x {case}")
        c0, c1 = col.out_start, col.out_end
        _check_grad(col.weight, ref1.weight.grad[c0:c1], rw, f"column weight {case}")
        _check_grad(col.bias, ref1.bias.grad[c0:c1], rbias, f"column bias {case}")
        _check_grad(row.weight, ref2.weight.grad[:, c0:c1], rw, f"row weight {case}")
        _check_grad(row.bias, ref2.bias.grad, rbias, f"row bias {case}")


@pytest.mark.parametrize("world", [2, 3])
def test_layers_follow_requires_grad(world):
    run_ranks(_layers_case, world)


def _linear_ce_case(rank, world):
    gen = torch.Generator().manual_seed(8)
    V, d, N = 7 * world + 3, 5, 11
    v0, v1 = tpx.shard_range(V)
    H = torch.randn(N, d, generator=gen)
    W = torch.randn(V, d, generator=gen)
    Bv = torch.randn(V, generator=gen)
    target = torch.randint(0, V, (N,), generator=gen)
    fH, fW, fB = _leaf(H, True), _leaf(W, True), _leaf(Bv, True)
    torch.nn.functional.cross_entropy(fH @ fW.t() + fB, target).backward()
    for rh, rw, rb in COMBOS:
        if not (rh or rw or rb):
            continue
        case = f"requires_grad hidden={rh} weight={rw} bias={rb}"
        h, w, b = _leaf(H, rh), _leaf(W[v0:v1], rw), _leaf(Bv[v0:v1], rb)
        loss = tpx.linear_cross_entropy(h, w, target, bias=b, chunk_size=4, vocab_size=V)
        with tpx.comm_stats() as stats:
            loss.backward()
        _check_grad(h, fH.grad, rh, f"hidden {case}")
        _check_grad(w, fW.grad[v0:v1], rw, f"weight {case}")
        _check_grad(b, fB.grad[v0:v1], rb, f"bias {case}")
        if world > 1 and not rh:  # no hidden gradient: its per-chunk all-reduces are skipped
            assert stats.calls() == 0, (case, stats)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_linear_cross_entropy_follows_requires_grad(world):
    run_ranks(_linear_ce_case, world)


def _comm_case(rank, world):
    """What a skipped gradient saves, counted: no collective for an input that needs none."""
    torch.manual_seed(3)
    d, h = 8, 4 * world
    ref1, ref2 = nn.Linear(d, h), nn.Linear(h, d)
    x = torch.randn(3, 2 * world, d)
    for sp in (False, True):
        col = tpx.ColumnParallelLinear.from_linear(ref1, sequence_parallel=sp, chunks=2)
        row = tpx.RowParallelLinear.from_linear(ref2, sequence_parallel=sp, chunks=2)
        s = x.shape[1] // world
        xin = x.narrow(1, rank * s, s) if sp else x
        itemsize = x.element_size()

        # Training everything: the input gradient's collective runs.
        y = row(torch.relu(col(xin.clone().requires_grad_(True))))
        with tpx.comm_stats() as stats:
            y.sum().backward()
        full_act = x.numel() * itemsize  # [3, 2W, d] activations, replicated size
        if sp:
            # row: all-gather of the gradient (2 chunks); column: reduce-scatter of grad x
            assert stats.calls(kind="all_gather") == 2, stats
            assert stats.bytes(kind="all_gather") == full_act // world, stats
            assert stats.calls(kind="reduce_scatter") == 2, stats
            assert stats.bytes(kind="reduce_scatter") == full_act // world, stats
        else:
            assert stats.calls(kind="all_reduce") >= 1, stats
            assert stats.bytes(kind="all_reduce") == full_act, stats

        # The input needs no gradient: the column layer's input-gradient collective is gone.
        y = row(torch.relu(col(xin.clone())))
        with tpx.comm_stats() as stats:
            y.sum().backward()
        assert stats.calls(kind="reduce_scatter") == 0, stats
        assert stats.calls(kind="all_reduce") == 0, stats
        if not sp:
            assert stats.calls() == 0, stats

        # Frozen weights and biases, input without gradient: no backward at all.
        for p in list(col.parameters()) + list(row.parameters()):
            p.requires_grad_(False)
        y = row(torch.relu(col(xin.clone())))
        assert not y.requires_grad


@pytest.mark.parametrize("world", [2, 3])
def test_skipped_input_gradient_communicates_nothing(world):
    run_ranks(_comm_case, world)


def _comm_stats_api(rank, world):
    a = torch.randn(4, 3)
    with tpx.comm_stats() as stats:
        tpx.ops.matmul_all_reduce(a, torch.randn(3, 5), chunks=1)
    assert stats.calls() == 1 and stats.calls(kind="all_reduce") == 1, stats
    assert stats.bytes() == 4 * 5 * 4, stats
    assert stats.calls(group=torch.distributed.group.WORLD) == 1
    assert stats.calls(kind="broadcast") == 0
    assert "all_reduce" in repr(stats)
    with pytest.raises(ValueError, match="kind must be one of"):
        stats.calls(kind="allreduce")


def test_comm_stats_api():
    run_ranks(_comm_stats_api, 2)
