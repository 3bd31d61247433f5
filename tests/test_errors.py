"""Bad input gets a clear ValueError/RuntimeError/TypeError that names the argument, raised on
every rank before any collective: the group stays usable afterwards (no rank hangs)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpx
from harness import run_ranks


def test_uninitialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpx.ColumnParallelLinear(4, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpx.ops.all_gather_matmul(torch.randn(2, 3), torch.randn(3, 4), 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpx.shard_range(10)


def _end_run_without_pause(rank, world):
    """tpx.end_run(pause=0) (a process that goes on, as the test harness's ranks): the groups
    destroyed; a bad pause raises before anything ends."""
    with pytest.raises(ValueError, match="`pause`"):
        tpx.end_run(pause=-1)
    with pytest.raises(ValueError, match="`pause`"):
        tpx.end_run(pause="0.2")
    x = torch.full((3,), float(rank + 1))
    assert torch.equal(tpx.mappings.all_reduce_sum(x, dist.group.WORLD), torch.full((3,), 3.0))
    tpx.end_run(pause=0)
    assert not dist.is_initialized()


def test_end_run_pause():
    tpx.end_run(pause=0)  # not initialised: nothing to do
    run_ranks(_end_run_without_pause, 2)


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _still_in_step(world):
    """A collective op after the errors: all ranks must still agree on the sequence."""
    a = torch.full((2, 3), float(dist.get_rank()))
    gathered, _ = tpx.ops.all_gather_matmul(a, torch.eye(3), 0)
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(2)[:, None].expand(-1, 3)
    assert torch.equal(gathered, expected)


def _check_op_errors(rank, world):
    a, b = torch.randn(2, 4, 8), torch.randn(8, 6)
    ops = tpx.ops
    _raises(ValueError, "`b` must be 2-D", ops.all_gather_matmul, a, b[None], 1)
    _raises(ValueError, r"a.size\(-1\) = 8 must equal b.size\(0\) = 7", ops.matmul_all_reduce,
            a, torch.randn(7, 6))
    _raises(ValueError, "same dtype", ops.matmul_reduce_scatter, a.repeat(1, world, 1),
            b.double(), 1)
    _raises(ValueError, "gather_dim=-1", ops.all_gather_matmul, a, b, -1)
    _raises(ValueError, "gather_dim=3", ops.all_gather_matmul, a, b, 3)
    _raises(ValueError, "at least 2 dimensions", ops.all_gather_matmul, torch.randn(8), b, 0)
    _raises(ValueError, "chunks must be >= 1", ops.all_gather_matmul, a, b, 1, chunks=0)
    _raises(ValueError, "`bias` must be 1-D of size n", ops.matmul_all_reduce, a, b,
            bias=torch.randn(5))
    _raises(ValueError, "floating-point", ops.matmul_all_reduce, a.long(), b.long())
    if world > 1:
        _raises(ValueError, "must divide by the group size", ops.matmul_reduce_scatter,
                torch.randn(2, world + 1, 8), b, 1)
    _raises(TypeError, "`group` must be None", ops.matmul_all_reduce, a, b, group="tp")
    if world == 2:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        _raises(ValueError, "1-D mesh", tpx.ColumnParallelLinear, 8, 6, group=mesh)
        torch.manual_seed(0)
        col = tpx.ColumnParallelLinear(8, 6, group=mesh["tp"])  # a 1-D mesh is fine
        assert col.world_size == 2
    _still_in_step(world)


def _check_module_errors(rank, world):
    _raises(ValueError, "`out_features` must be a positive int", tpx.ColumnParallelLinear, 4, 0)
    _raises(ValueError, "`chunks` must be None or an int >= 1", tpx.RowParallelLinear, 4, 4,
            chunks=0)
    _raises(TypeError, "expects an nn.Linear", tpx.ColumnParallelLinear.from_linear,
            nn.Conv1d(2, 2, 1))
    _raises(ValueError, "`bias` is taken from the nn.Linear", tpx.RowParallelLinear.from_linear,
            nn.Linear(4, 4), bias=False)
    torch.manual_seed(0)
    col = tpx.ColumnParallelLinear(8, 6, sequence_parallel=True)
    _raises(ValueError, r"input.shape\[-1\] must be 8", col, torch.randn(2, 4, 7))
    _raises(ValueError, "input dtype torch.float64", col, torch.randn(2, 4, 8).double())
    _raises(ValueError, "sequence_dim=1 does not name a sequence dimension", col,
            torch.randn(4, 8))
    row = tpx.RowParallelLinear(4 * world, 6, sequence_parallel=True)
    if world > 1:
        _raises(ValueError, "must divide by the group size", row, torch.randn(2, world + 1, 4))
    _raises(ValueError, r"this rank.s columns", row, torch.randn(2, world, 4 * world + 1))
    # Ranks that disagree: the same error on every rank, before any weight is used.
    if world > 1:
        _raises(ValueError, "ranks of the group were given different arguments",
                tpx.ColumnParallelLinear, 8 + rank, 6)
        _raises(ValueError, "chunks", tpx.RowParallelLinear, 8, 6, chunks=1 + rank)
        torch.manual_seed(rank)  # different seeds draw different initial weights, which
        # src_rank=None (no weight communication) detects; the default takes rank 0's.
        _raises(ValueError, "initial_weights", tpx.RowParallelLinear, 8, 6, src_rank=None)
        # An existing module under src_rank=None (PyTorch's src_data_rank=None): each rank
        # keeps its slice of its own module, as asked, and is told that the ranks differ.
        with pytest.warns(UserWarning, match="ranks' modules differ"):
            tpx.ColumnParallelLinear.from_linear(nn.Linear(8, 6), src_rank=None)
    _still_in_step(world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_arguments_raise_on_every_rank(world):
    run_ranks(_check_op_errors, world)
    run_ranks(_check_module_errors, world)


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever without the harness


def test_harness_names_the_failing_rank_and_tears_down():
    with pytest.raises(AssertionError, match=r"failed on rank 1:[\s\S]*boom on purpose"):
        run_ranks(_fail_on_rank_one, 2, timeout=60)


def _leave_state_behind(rank, world, path):
    import os

    with open(f"{path}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    tpx.random.manual_seed(5)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    os.environ["TPX_DEBUG_CHECKS"] = "1"


def _expect_fresh_state(rank, world, path):
    import os

    with open(f"{path}.{rank}") as f:
        before = int(f.read())
    # Pooled ranks are reused; TPX_TEST_FRESH_RANKS=1 starts new ones.
    assert (os.getpid() == before) == (os.environ.get("TPX_TEST_FRESH_RANKS", "0") != "1")
    assert not tpx.random.is_seeded()
    assert torch.get_default_dtype() == torch.float32 and torch.get_num_threads() == 1
    assert "TPX_DEBUG_CHECKS" not in os.environ
    # A new process seeds torch from the OS: not the state the test before left.
    left = torch.Generator().manual_seed(5)
    assert not torch.equal(torch.rand(4), torch.rand(4, generator=left))
    dist.barrier()


def test_pooled_ranks_start_each_test_fresh(tmp_path):
    run_ranks(_leave_state_behind, 2, str(tmp_path / "pid"))
    run_ranks(_expect_fresh_state, 2, str(tmp_path / "pid"))


def _mismatched_shapes(rank, world):
    import os

    os.environ["TPX_DEBUG_CHECKS"] = "1"
    w = torch.randn(6, 4)
    # Rank 1 passes an empty batch: without the check, its all-reduce would return at once
    # and rank 0 would wait forever.
    a = torch.randn(3 if rank == 0 else 0, 6)
    _raises(ValueError, "ranks of the group were given different arguments",
            tpx.ops.matmul_all_reduce, a, w)
    a = torch.randn(2, 3 + rank, 4)
    _raises(ValueError, "different arguments", tpx.ops.all_gather_matmul, a, torch.randn(4, 5), 1)
    # Uneven widths that the ops allow pass the check.
    k = 3 + rank
    out = tpx.ops.matmul_all_reduce(torch.ones(2, k), torch.ones(k, 5))
    assert torch.equal(out, torch.full((2, 5), float(sum(3 + r for r in range(world)))))
    os.environ["TPX_DEBUG_CHECKS"] = "0"
    _still_in_step(world)


def test_debug_checks_catch_ranks_that_disagree():
    run_ranks(_mismatched_shapes, 2)


def _check_same_device_reported(rank, world):
    from tpx.checks import check_distinct_devices

    pg = dist.new_group(list(range(world)))
    # Every rank claims device 0, as when torch.cuda.set_device(local_rank) was forgotten.
    with pytest.raises(ValueError, match=r"ranks 0 and 1 of the group both use cuda:0") as err:
        check_distinct_devices(pg, current_device=lambda: 0)
    assert "torch.cuda.set_device(local_rank)" in str(err.value)
    pg2 = dist.new_group(list(range(world)))
    check_distinct_devices(pg2, current_device=lambda: rank)  # distinct devices: no error


def test_same_cuda_device_on_two_ranks_is_reported():
    run_ranks(_check_same_device_reported, 2)
