"""ColumnParallelLinear / RowParallelLinear against nn.Linear: outputs, input gradients and
every parameter gradient, with and without sequence parallelism, gather_output,
input_is_parallel=False, 2-D and 3-D inputs, uneven feature splits, world sizes 1-4."""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpx
from harness import run_ranks, local_vs, local_part


def close(actual, expected, what):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


def _mlp_case(rank, world, d, h, shape, seq_dim, sp, chunks, gen, dev="cpu"):
    """column -> ReLU -> row against the same two nn.Linear layers."""
    case = f"d={d} h={h} shape={shape} seq_dim={seq_dim} sp={sp} chunks={chunks}"
    ref1, ref2 = nn.Linear(d, h).to(dev), nn.Linear(h, d).to(dev)
    col = tpx.ColumnParallelLinear.from_linear(ref1, sequence_parallel=sp, sequence_dim=seq_dim,
                                               chunks=chunks)
    row = tpx.RowParallelLinear.from_linear(ref2, sequence_parallel=sp, sequence_dim=seq_dim,
                                            chunks=chunks)
    x_full = torch.randn(shape, generator=gen).to(dev)
    gy = torch.randn(shape, generator=gen).to(dev)

    xr = x_full.clone().requires_grad_(True)
    y_ref = ref2(torch.relu(ref1(xr)))
    (y_ref * gy).sum().backward()

    if sp:
        s = shape[seq_dim] // world
        x = x_full.narrow(seq_dim, rank * s, s).clone().requires_grad_(True)
        y = row(torch.relu(col(x)))
        close(y, y_ref.narrow(seq_dim, rank * s, s).detach(), f"output {case}")
        (y * gy.narrow(seq_dim, rank * s, s)).sum().backward()
        close(x.grad, xr.grad.narrow(seq_dim, rank * s, s), f"grad input {case}")
    else:
        x = x_full.clone().requires_grad_(True)
        y = row(torch.relu(col(x)))
        close(y, y_ref.detach(), f"output {case}")
        (y * gy).sum().backward()
        close(x.grad, xr.grad, f"grad input {case}")
    c0, c1 = col.out_start, col.out_end
    close(col.weight.grad, ref1.weight.grad[c0:c1], f"grad column weight {case}")
    close(col.bias.grad, ref1.bias.grad[c0:c1], f"grad column bias {case}")
    close(row.weight.grad, ref2.weight.grad[:, c0:c1], f"grad row weight {case}")
    # The row bias is replicated: its full gradient, on every rank, with no extra call.
    close(row.bias.grad, ref2.bias.grad, f"grad row bias {case}")


def _check_mlp(rank, world, dev="cpu"):
    gen = torch.Generator().manual_seed(21 + world)
    torch.manual_seed(3)  # the reference layers are drawn identically on every rank
    for (h, (shape, seq_dim)), sp, chunks in itertools.product(
            [(4 * world, ((2, 2 * world, 8), 1)),        # 3-D [batch, seq, hidden]
             (5 * world + 1, ((2 * world, 8), 0)),        # 2-D [tokens, hidden], uneven h
             (3 * world - 1, ((2 * world, 3, 8), 0))],    # 3-D [seq, batch, hidden], uneven h
            (False, True), (1, 2, None)):
        _mlp_case(rank, world, 8, h, shape, seq_dim, sp, chunks, gen, dev)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mlp_matches_nn_linear(world):
    run_ranks(_check_mlp, world)


def _check_edges(rank, world):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(9)
    # gather_output: y R, every gradient as nn.Linear's.
    for out_features, shape in [(7, (3, 5)), (world * 2 + 1, (2, 3, 5))]:
        ref = nn.Linear(5, out_features)
        col = tpx.ColumnParallelLinear.from_linear(ref, gather_output=True)
        x_full = torch.randn(shape, generator=gen)
        gy = torch.randn(list(shape[:-1]) + [out_features], generator=gen)
        xr, x = x_full.clone().requires_grad_(True), x_full.clone().requires_grad_(True)
        (ref(xr) * gy).sum().backward()
        y = col(x)
        close(y, ref(x_full).detach(), "gather_output forward")
        (y * gy).sum().backward()
        close(x.grad, xr.grad, "gather_output grad input")
        close(col.weight.grad, ref.weight.grad[col.out_start:col.out_end], "gather_output grad W")
        close(col.bias.grad, ref.bias.grad[col.out_start:col.out_end], "gather_output grad b")

    # input_is_parallel=False (x R is split inside), with and without sequence parallelism.
    for sp in (False, True):
        ref = nn.Linear(3 * world + 1, 4)
        row = tpx.RowParallelLinear.from_linear(ref, input_is_parallel=False,
                                                sequence_parallel=sp, sequence_dim=0)
        x_full = torch.randn(2 * world, 3 * world + 1, generator=gen)
        gy = torch.randn(2 * world, 4, generator=gen)
        xr, x = x_full.clone().requires_grad_(True), x_full.clone().requires_grad_(True)
        (ref(xr) * gy).sum().backward()
        y = row(x)
        if sp:
            close(y, ref(x_full).detach()[2 * rank:2 * rank + 2], "split input, SP forward")
            (y * gy[2 * rank:2 * rank + 2]).sum().backward()
            # The gathered output gradient reaches every column of x on every rank.
            close(x.grad, xr.grad, "split input, SP grad input")
        else:
            close(y, ref(x_full).detach(), "split input forward")
            (y * gy).sum().backward()
            close(x.grad, xr.grad, "split input grad input")
        close(row.weight.grad, ref.weight.grad[:, row.in_start:row.in_end], "split input grad W")
        close(row.bias.grad, ref.bias.grad, "split input grad bias")

    # More ranks than output features: trailing ranks hold no rows and still take part.
    ref = nn.Linear(4, 2)
    col = tpx.ColumnParallelLinear.from_linear(ref, gather_output=True)
    x = torch.randn(3, 4, generator=gen)
    close(col(x), ref(x), "out_features < world size")


@pytest.mark.parametrize("world", [1, 3, 4])
def test_gather_output_split_input_uneven(world):
    run_ranks(_check_edges, world)


def _check_seeded_init(rank, world):
    for bias in (True, False):
        torch.manual_seed(1234)
        ref_col = nn.Linear(6, 5 * world + 1, bias=bias)
        torch.manual_seed(1234)
        col = tpx.ColumnParallelLinear(6, 5 * world + 1, bias=bias)
        assert torch.equal(local_part(col.weight), ref_col.weight[col.out_start:col.out_end])
        torch.manual_seed(77)
        ref_row = nn.Linear(3 * world + 2, 4, bias=bias)
        torch.manual_seed(77)
        row = tpx.RowParallelLinear(3 * world + 2, 4, bias=bias)
        assert torch.equal(local_part(row.weight), ref_row.weight[:, row.in_start:row.in_end])
        if bias:
            assert torch.equal(local_part(col.bias), ref_col.bias[col.out_start:col.out_end])
            assert torch.equal(local_part(row.bias), ref_row.bias)
    # dtype and device arguments are honoured.
    m = tpx.ColumnParallelLinear(4, 8, dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and m.bias.dtype == torch.float64
    m = tpx.RowParallelLinear(8, 4, device="meta")
    assert m.weight.is_meta
    # A deep copy shares the process group and computes the same thing.
    import copy

    col = tpx.ColumnParallelLinear(6, 5, gather_output=True)
    twin = copy.deepcopy(col)
    assert (twin.group is col.group
            and local_part(twin.weight).data_ptr() != local_part(col.weight).data_ptr())
    x = torch.randn(3, 6)
    torch.testing.assert_close(twin(x), col(x))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_seeded_init_equals_nn_linear(world):
    run_ranks(_check_seeded_init, world)


def _check_lean_calls(rank, world):
    """A layer's common call takes a short path (no gradient wanted: the operator alone, no
    autograd node; training: one node on the DTensor parameters). Its outputs and gradients
    are those of the general path bit for bit (TPX_DEBUG_CHECKS=1 turns the short path off)
    and those of nn.Linear, under no_grad, inference_mode and with frozen parameters; bad
    inputs still get the layer's errors."""
    import os

    gen = torch.Generator().manual_seed(40 + world)
    torch.manual_seed(11)
    d, h = 6, 3 * world + 1  # uneven split of the hidden features
    ref1, ref2 = nn.Linear(d, h), nn.Linear(h, d)
    col, row = tpx.ColumnParallelLinear.from_linear(ref1), tpx.RowParallelLinear.from_linear(ref2)
    params = list(col.parameters()) + list(row.parameters())
    x = torch.randn(2, 5, d, generator=gen)
    gy = torch.randn(2, 5, d, generator=gen)
    xr = x.clone().requires_grad_(True)
    (ref2(torch.relu(ref1(xr))) * gy).sum().backward()

    def step():
        for p in params:
            p.grad = None
        y = row(torch.relu(col(x)))
        (y * gy).sum().backward()
        return y.detach(), [local_vs(p.grad, p.grad).clone() for p in params]

    os.environ["TPX_DEBUG_CHECKS"] = "1"  # the general path everywhere
    try:
        with torch.no_grad():
            general = row(torch.relu(col(x)))
        general_step = step()
    finally:
        os.environ.pop("TPX_DEBUG_CHECKS")
    with torch.no_grad():
        lean = row(torch.relu(col(x)))
    assert not lean.requires_grad and lean.grad_fn is None
    with torch.inference_mode():
        inference = row(torch.relu(col(x)))
    for p in params:
        p.requires_grad_(False)
    frozen = row(torch.relu(col(x)))  # grad mode on, nothing needs a gradient
    assert frozen.grad_fn is None
    for p in params:
        p.requires_grad_(True)
    lean_step = step()

    close(lean, ref2(torch.relu(ref1(x))).detach(), "lean forward")
    for got, what in [(general, "no_grad, general path"), (inference, "inference_mode"),
                      (frozen, "frozen parameters"), (lean_step[0], "training call"),
                      (general_step[0], "training call, general path")]:
        assert torch.equal(got, lean), what
    for got, want in zip(lean_step[1], general_step[1]):
        assert torch.equal(got, want), "training gradients, short against general path"
    c0, c1 = col.out_start, col.out_end
    for p, want in zip(params, [ref1.weight.grad[c0:c1], ref1.bias.grad[c0:c1],
                                ref2.weight.grad[:, c0:c1], ref2.bias.grad]):
        close(p.grad, want, "gradient after a training call")

    # Under a dispatch mode the call goes through torch.ops.tpx, which the mode sees; the
    # profiler sees the short path's kernels under the operators' names.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    seen = []
    with torch.no_grad(), Seen():
        moded = row(torch.relu(col(x)))
    assert {"tpx.replicated_matmul.default", "tpx.matmul_all_reduce.default"} <= set(seen), seen
    assert torch.equal(moded, lean), "under a dispatch mode"
    with torch.profiler.profile() as prof:
        step()
    names = {e.name for e in prof.events()}
    assert {"tpx::replicated_matmul", "tpx::matmul_all_reduce", "tpx::replicated_matmul_backward",
            "tpx::matmul_all_reduce_backward"} <= names, names

    # Plain nn.Parameter weights (fused segments split separately) take the short path too.
    fused = tpx.ColumnParallelLinear(d, 4 * world, out_rows=[
        [(2 * r, 2 * r + 2), (2 * world + 2 * r, 2 * world + 2 * r + 2)] for r in range(world)])
    assert type(fused.weight) is nn.Parameter
    with torch.no_grad():
        assert tpx.ops.lean_mode(x, fused.weight, fused.bias) == tpx.ops.PLAIN
        short = fused(x)
        os.environ["TPX_DEBUG_CHECKS"] = "1"
        try:
            assert torch.equal(fused(x), short), "fused segments, short against general path"
        finally:
            os.environ.pop("TPX_DEBUG_CHECKS")

    # torch.jit.trace records the operator (shape-generic), not the kernel's insides.
    with torch.no_grad():
        traced = torch.jit.trace(col, x, check_trace=False)
        x2 = torch.randn(3, d, generator=gen)
        assert torch.equal(traced(x2), col(x2)), "a traced column layer on another shape"
    # A weight changed in place between forward and backward is refused where the backward
    # reads it (for the input's gradient), as nn.Linear's saved weight is; DTensor's in-place
    # ops leave its local tensor's version as it was. Where it is not read, as for nn.Linear,
    # the backward runs (the weight's gradient does not depend on it).
    for debug in ("0", "1"):
        os.environ["TPX_DEBUG_CHECKS"] = debug
        try:
            for needs_grad in (True, False):
                xi = x.clone().requires_grad_(needs_grad)
                outs = [row(torch.relu(col(xi))), ref2(torch.relu(ref1(xi)))]
                with torch.no_grad():
                    col.weight.mul_(1)
                    ref1.weight.mul_(1)
                for out in outs:
                    if needs_grad:
                        with pytest.raises(RuntimeError, match="modified by an inplace oper"):
                            out.sum().backward()
                    else:
                        out.sum().backward()
        finally:
            os.environ.pop("TPX_DEBUG_CHECKS")
    for p in params:
        p.grad = None
    close(step()[0], lean, "after a refused backward")  # every rank still in step

    with torch.no_grad():
        with pytest.raises(ValueError, match="input.shape\\[-1\\] must be 6"):
            col(torch.randn(3, d + 1))
        with pytest.raises(ValueError, match="dtype"):
            col(torch.randn(3, d, dtype=torch.float64))
        with pytest.raises(ValueError, match="this rank's columns"):
            row(torch.randn(3, h + 1))
        close(row(torch.relu(col(x))), lean, "after the errors")  # every rank still in step

    # A gather over the group (gather_output's): uneven widths, real and complex values.
    sizes = tpx.group.shard_sizes(7, world)
    lo, hi = tpx.group.shard_bounds(7, rank, world)
    for dtype in (torch.float32, torch.complex64):
        full = torch.randn(3, 7, dtype=dtype, generator=gen)
        part = full[:, lo:hi].clone()
        assert torch.equal(tpx.mappings.gather_dim(part, 1, sizes, lo, col.group), full), dtype
        part.requires_grad_(True)
        got = tpx.mappings.gather_dim(part, 1, sizes, lo, col.group)
        assert torch.equal(got.detach(), full), dtype
        (got.abs() ** 2).sum().backward()
        assert torch.allclose(part.grad, 2 * full[:, lo:hi]), dtype


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lean_calls_equal_the_general_path(world):
    run_ranks(_check_lean_calls, world)


def _check_inference_mode_gathers(rank, world):
    """Under torch.inference_mode the ops that all-gather (sequence parallelism's gather of the
    input, a gathered output) give what they give under no_grad (torch 2.5's gloo refuses to
    copy into an inference tensor on its own thread: the buffers it writes are normal)."""
    torch.manual_seed(5)
    d, h = 6, 2 * world + 1
    ref1, ref2 = nn.Linear(d, h), nn.Linear(h, d)
    col = tpx.ColumnParallelLinear.from_linear(ref1, sequence_parallel=True)
    row = tpx.RowParallelLinear.from_linear(ref2, sequence_parallel=True)
    head = tpx.ColumnParallelLinear.from_linear(ref1, gather_output=True)
    x = torch.randn(2, 2 * world, d, generator=torch.Generator().manual_seed(7))
    mine = x[:, 2 * rank:2 * rank + 2]
    with torch.no_grad():
        want = row(torch.relu(col(mine))), head(x)
    with torch.inference_mode():
        got = row(torch.relu(col(mine))), head(x)
    for g, w, what in zip(got, want, ("sequence parallel", "gathered output")):
        assert torch.equal(g, w), what
    close(got[0], ref2(torch.relu(ref1(x)))[:, 2 * rank:2 * rank + 2].detach(),
          "sequence parallel against nn.Linear")
    close(got[1], ref1(x).detach(), "gathered output against nn.Linear")


@pytest.mark.parametrize("world", [2, 3])
def test_inference_mode_gathers(world):
    run_ranks(_check_inference_mode_gathers, world)


def test_shard_range_matches_torch_chunk():
    for size, world in itertools.product([1, 2, 5, 7, 10, 50257], [1, 2, 3, 4, 8]):
        pieces = torch.arange(size).chunk(world)
        for rank in range(world):
            start, end = tpx.group.shard_bounds(size, rank, world)
            expected = pieces[rank] if rank < len(pieces) else torch.arange(0)
            assert torch.equal(torch.arange(size)[start:end], expected), (size, world, rank)


def _check_subgroups(rank, world):
    """Two TP groups side by side (data parallel x tensor parallel): each group's layers
    equal nn.Linear, and the groups do not interfere."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(31 + rank // 2)  # the two groups hold different models
    ref1, ref2 = nn.Linear(6, 10), nn.Linear(10, 6)
    col = tpx.ColumnParallelLinear.from_linear(ref1, group=mine)
    row = tpx.RowParallelLinear.from_linear(ref2, group=mine, chunks=2)
    assert (col.rank, col.world_size) == (rank % 2, 2)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank // 2))
    xr = x.clone().requires_grad_(True)
    x.requires_grad_(True)
    y, y_ref = row(torch.relu(col(x))), ref2(torch.relu(ref1(xr)))
    close(y, y_ref.detach(), "subgroup forward")
    y.sum().backward()
    y_ref.sum().backward()
    close(x.grad, xr.grad, "subgroup grad input")
    close(col.weight.grad, ref1.weight.grad[col.out_start:col.out_end], "subgroup grad W")


def test_two_tp_groups_side_by_side():
    run_ranks(_check_subgroups, 4)
