"""The communication layer under faults and misuse, on two (and four) gloo ranks: collectives
never left half done, tpx's traffic on groups of its own, settings agreed across ranks, and
the argument checks that keep a rank from starting a collective its peer will not join.

Each test states the defect it guards against; every rank has a short process-group timeout
(harness.run_ranks kills all ranks when one fails or the run exceeds its timeout)."""

import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpx
from harness import run_ranks, local_vs

TIMEOUT = 90


def close(actual, expected, what, tol=1e-5):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _short_timeout(seconds=20):
    # A group whose collectives give up after `seconds`, for the faults below.
    return dist.new_group(list(range(dist.get_world_size())),
                          timeout=datetime.timedelta(seconds=seconds))


def _loop_thread_ticks():
    """CPU ticks (user + system) of this process's gloo event-loop threads."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import faults

    return faults._ticks(only_loop=True)


def _check_fault_mid_op_leaves_group_usable(rank, world, op, algorithm):
    """An error between posting a collective and waiting for it (an allocation or a GEMM of a
    later chunk failing) must not leave a posted two-rank exchange behind: the next op on the
    group must work, and gloo's loop thread must not spin. Before, the exchange was dropped
    with its receive still posted; the next exchange's message landed in a freed buffer and
    every later collective on the group timed out. Checked with both ways of summing over two
    ranks (the exchange, and gloo's all-reduce)."""
    os.environ["TPX_GLOO_ALLREDUCE"] = algorithm
    pg = _short_timeout()
    gen = torch.Generator().manual_seed(3)
    a_full, b_full = torch.randn(16, 2 * world, generator=gen), torch.randn(2 * world, 6, generator=gen)
    lo, hi = tpx.shard_range(2 * world, pg)
    a, b = a_full[:, lo:hi].contiguous(), b_full[lo:hi]
    tpx.ops.matmul_all_reduce(a, b, pg, 1)  # tpx meets the group (and makes its own copy)
    tpx._C.testing.arm_fault(1)    # the first collective posted from now on raises
    try:
        if op == "matmul_all_reduce":
            tpx.ops.matmul_all_reduce(a, b, pg, 4)
        elif op == "replicated_matmul_backward":
            x = a_full.clone().requires_grad_(True)
            w = b_full[:, :3].clone().requires_grad_(True)
            tpx.ops.replicated_matmul(x, w, pg, 4).sum().backward()
        else:  # the linear cross-entropy's backward: an all-reduce per chunk of rows
            hidden = a_full.clone().requires_grad_(True)
            weight = torch.randn(5, 2 * world, generator=gen)
            target = torch.randint(0, 5 * world, (16,), generator=gen)
            loss, _ = tpx.ops.linear_cross_entropy_rows(hidden, weight, target, 5 * rank,
                                                        5 * world, pg, chunk_size=4)
            loss.sum().backward()
    except RuntimeError as e:
        assert "fault injected" in str(e), e
    else:
        raise AssertionError("the injected fault did not raise")
    finally:
        tpx._C.testing.arm_fault(0)
    before = _loop_thread_ticks()
    time.sleep(1.0)
    idle = _loop_thread_ticks() - before
    assert idle <= 10, f"gloo's loop threads used {idle} ticks in an idle second (spinning)"
    out = tpx.ops.matmul_all_reduce(a, b, pg, 2)
    close(out, a_full @ b_full, "the op after the fault")


@pytest.mark.parametrize("algorithm", ["exchange", "gloo"])
@pytest.mark.parametrize("op", ["matmul_all_reduce", "replicated_matmul_backward",
                                "linear_cross_entropy_backward"])
def test_fault_mid_op_leaves_group_usable(op, algorithm):
    run_ranks(_check_fault_mid_op_leaves_group_usable, 2, op, algorithm, timeout=TIMEOUT,
              fresh=True)  # a fault on purpose


def _check_exchange_wait_twice(rank, world):
    """A Work whose wait() raised must raise again on a second wait(), not report success with
    an unsummed buffer."""
    os.environ["TPX_GLOO_ALLREDUCE"] = "exchange"
    pg = _short_timeout()
    tpx.ops.matmul_all_reduce(torch.ones(2, 2), torch.ones(2, 2), pg, 1)  # tpx's own copy
    buf = torch.ones(4) if rank == 0 else torch.ones(2, dtype=torch.float64)  # same bytes
    outcomes = tpx._C.testing.wait_twice(buf, pg.group_name)
    assert len(outcomes) == 2 and all(o.startswith("raised: ") for o in outcomes), outcomes
    assert "different buffers" in outcomes[1], outcomes
    ok = tpx._C.testing.wait_twice(torch.full((3,), float(rank)), pg.group_name)
    assert ok == ["ok", "ok"], ok


def test_exchange_wait_twice():
    run_ranks(_check_exchange_wait_twice, 2, timeout=TIMEOUT, fresh=True)  # a fault on purpose


def _check_own_group(rank, world):
    """tpx's collectives run on a group of its own: a user's receive posted on the group with
    tpx's exchange tag gets the user's message, and the user's gloo event-loop thread keeps
    its scheduling policy while tpx's copy is switched to SCHED_BATCH. Both were shared
    before (tpx's exchange ran on the user's group with fixed tags, and every gloo loop thread
    of the process was switched)."""
    from tpx import comm_groups

    os.environ["TPX_GLOO_ALLREDUCE"] = "exchange"  # the send/recv exchange, with its tags
    pg = dist.group.WORLD
    peer = 1 - rank
    inbox = torch.zeros(64)
    pending = dist.irecv(inbox, src=peer, tag=0x7470) if rank == 0 else None
    a = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    b = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + rank))
    out = tpx.ops.matmul_all_reduce(a, b, pg, 2)
    want = sum(torch.randn(8, 4, generator=torch.Generator().manual_seed(r))
               @ torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + r))
               for r in range(2))
    close(out, want, "tpx's sum")
    if rank == 1:
        dist.send(torch.arange(64.0), dst=0, tag=0x7470)
    else:
        pending.wait()
        assert torch.equal(inbox, torch.arange(64.0)), "the user's receive got tpx's message"
    own = comm_groups.owned_group(pg)
    assert own is not None and own.group_name != pg.group_name
    policies = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    policies[int(tid)] = os.sched_getscheduler(int(tid))
        except OSError:
            pass
    if policies:  # torch < 2.13's gloo may leave its threads unnamed (torch 2.5 does)
        assert sorted(policies.values()) == [os.SCHED_OTHER, os.SCHED_BATCH], policies
    with tpx.comm_stats() as stats:  # counted under the user's group
        tpx.ops.matmul_all_reduce(a, b, pg, 2)
    assert stats.calls(pg, "all_reduce") == 2, stats


def test_own_group():
    # fresh: it counts every gloo thread of the process
    run_ranks(_check_own_group, 2, timeout=TIMEOUT, fresh=True)


def _check_settings_agreed(rank, world, variable, values):
    """Settings that shape the collectives are compared when tpx meets a group: ranks that
    disagree get the same ValueError, instead of one waiting for the other's timeout (the
    exchange and gloo's all-reduce, or two pipeline depths, do not pair up)."""
    os.environ[variable] = values[rank]
    pg = _short_timeout()
    try:
        tpx.ops.matmul_all_reduce(torch.ones(8, 2), torch.ones(2, 3), pg)
    except ValueError as e:
        assert variable in str(e) and "every rank" in str(e), e
    else:
        raise AssertionError(f"ranks with different {variable} ran a collective")


@pytest.mark.parametrize("variable,values", [
    ("TPX_GLOO_ALLREDUCE", ("gloo", "exchange")),
    ("TPX_DEFAULT_CHUNKS", ("1", "3")),
    ("TPX_GLOO_LOOP_POLICY", ("keep", "batch")),
])
def test_settings_agreed(variable, values):
    # fresh: TPX_DEFAULT_CHUNKS is read once per process
    run_ranks(_check_settings_agreed, 2, variable, values, timeout=TIMEOUT, fresh=True)


def _check_return_gathered_under_autocast(rank, world):
    """all_gather_matmul(return_gathered=True) under autocast returns the gathered rows in rank
    order. The wrapper used to derive the pipeline depth from the float32 input while the op
    ran on its bfloat16 copy (half the bytes: another depth), and reordered the rows wrongly."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2 * 512, 1024, generator=gen)  # 2 MiB a rank in fp32: depth 2; bf16: 1
    b = torch.randn(1024, 8, generator=gen)
    mine = full[rank * 512:(rank + 1) * 512]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gathered, out = tpx.ops.all_gather_matmul(mine, b, 0, None)
    assert gathered.dtype == torch.bfloat16
    assert torch.equal(gathered, full.to(torch.bfloat16)), "gathered rows out of order"
    close(out.float(), (full.to(torch.bfloat16) @ b.to(torch.bfloat16)).float(), "out", 2e-2)


def test_return_gathered_under_autocast():
    run_ranks(_check_return_gathered_under_autocast, 2, timeout=TIMEOUT)


def _check_embedding_empty_shard(rank, world):
    """A vocabulary of fewer rows than ranks: the rank with an empty shard contributes zeros
    (it crashed in index_select before, and its peers waited for the timeout)."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(1, 6, generator=gen)  # one row: rank 1's shard is empty
    ids = torch.zeros(3, 4, dtype=torch.long)
    lo, hi = tpx.shard_range(1)
    weight = table[lo:hi].clone().requires_grad_(True)
    out = tpx.ops.vocab_parallel_embedding(weight, ids, lo, None)
    close(out, F.embedding(ids, table), "embedding")
    out.sum().backward()
    assert weight.grad.shape == weight.shape
    if hi > lo:
        close(weight.grad, torch.full_like(weight, 12.0), "grad")


def test_embedding_empty_shard():
    run_ranks(_check_embedding_empty_shard, 2, timeout=TIMEOUT)


def _check_targets_out_of_range(rank, world):
    """A target outside the vocabulary (and not ignore_index) raises a ValueError on every
    rank, before any collective, in every entry point (F.cross_entropy raises too); the
    low-level ops, and the functional form without input checks, used to return loss = lse."""
    from tpx import checks  # noqa: F401  (TPX_INPUT_CHECKS is read per call)

    vocab = 10
    gen = torch.Generator().manual_seed(4)
    logits_full = torch.randn(6, vocab, generator=gen)
    lo, hi = tpx.shard_range(vocab)
    logits = logits_full[:, lo:hi].contiguous()
    hidden = torch.randn(6, 5, generator=gen)
    weight = torch.randn(vocab, 5, generator=gen)[lo:hi]
    for bad in (vocab, -3):
        target = torch.tensor([1, 2, bad, 3, -100, 0])
        calls = {
            "vocab_parallel_cross_entropy_rows":
                lambda: tpx.ops.vocab_parallel_cross_entropy_rows(logits, target, lo, vocab),
            "torch.ops.tpx.vocab_parallel_cross_entropy":
                lambda: torch.ops.tpx.vocab_parallel_cross_entropy(
                    logits, target, lo, vocab, dist.group.WORLD.group_name, -100, 0.0, False),
            "linear_cross_entropy_rows":
                lambda: tpx.ops.linear_cross_entropy_rows(hidden, weight, target, lo, vocab,
                                                          chunk_size=2),
        }
        calls["vocab_parallel_cross_entropy (torch.compile)"] = \
            lambda: torch.compile(tpx.vocab_parallel_cross_entropy, backend="eager")(
                logits, target)
        calls["vocab_parallel_cross_entropy (checks off)"] = \
            lambda: tpx.vocab_parallel_cross_entropy(logits, target)
        for what, call in calls.items():
            if "checks off" in what:
                os.environ["TPX_INPUT_CHECKS"] = "off"
            try:
                call()
            except ValueError as e:
                assert "out of bounds" in str(e) and str(bad) in str(e), (what, e)
            else:
                raise AssertionError(f"{what}: target {bad} gave a loss")
            finally:
                os.environ.pop("TPX_INPUT_CHECKS", None)
    ok = torch.tensor([1, 2, 9, 3, -100, 0])
    loss, _ = tpx.ops.vocab_parallel_cross_entropy_rows(logits, ok, lo, vocab)
    close(loss, F.cross_entropy(logits_full, ok, reduction="none"), "valid targets")


def test_targets_out_of_range():
    run_ranks(_check_targets_out_of_range, 2, timeout=TIMEOUT)


def _check_linear_ce_backward_checks_first(rank, world):
    """linear_cross_entropy_backward checks grad_loss and lse against the rows before its first
    chunk's collective; a short lse used to fail in the second chunk, after the first chunk's
    all-reduce was posted, and wedge the group."""
    pg = _short_timeout()
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(8, 4, generator=gen), torch.randn(3, 4, generator=gen)
    target = torch.randint(0, 3 * world, (8,), generator=gen)
    name = pg.group_name
    tpx.ops.matmul_all_reduce(torch.ones(2, 2), torch.ones(2, 2), pg, 1)  # tpx's own copy
    for grad_loss, lse, what in ((torch.ones(8), torch.ones(5), "lse"),
                                 (torch.ones(3), torch.ones(8), "grad_loss")):
        try:
            torch.ops.tpx.linear_cross_entropy_backward(
                grad_loss, hidden, weight, None, target, lse, 3 * rank, 3 * world, name, 2,
                -100, 0.0, True, True, False)
        except ValueError as e:
            assert what in str(e) and "[8]" in str(e), e
        else:
            raise AssertionError(f"a short {what} was accepted")
    out = tpx.ops.matmul_all_reduce(torch.ones(4, 2), torch.ones(2, 3), pg, 2)
    close(out, torch.full((4, 3), 4.0), "the group after the errors")


def test_linear_ce_backward_checks_first():
    run_ranks(_check_linear_ce_backward_checks_first, 2, timeout=TIMEOUT)


def _check_debug_checks(rank, world, case):
    """TPX_DEBUG_CHECKS=1 compares, across the ranks, every argument that shapes an op's
    collectives; each case below used to pass the check and then hang or misbehave."""
    os.environ["TPX_DEBUG_CHECKS"] = "1"
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(8, 4, generator=gen), torch.randn(4, 6, generator=gen)
    try:
        if case == "chunks":
            tpx.ops.matmul_all_reduce(a, b, None, 1 + rank)
        elif case == "reduce_scatter_dtype":
            t = torch.float32 if rank == 0 else torch.float64
            tpx.ops.matmul_reduce_scatter(a.to(t), b.to(t), 0, None)
        elif case == "all_reduce_dtype":
            t = torch.float32 if rank == 0 else torch.float64
            tpx.ops.matmul_all_reduce(a.to(t), b.to(t), None)
        elif case == "embedding_dtype":
            t = torch.float32 if rank == 0 else torch.float64
            tpx.ops.vocab_parallel_embedding(torch.randn(3, 4, dtype=t),
                                             torch.zeros(5, dtype=torch.long), 3 * rank)
        elif case == "linear_2d":
            mesh = tpx.init_mesh("2d")
            info = tpx.mesh.check_mesh(mesh, "2d", "test")
            x = torch.randn(2 + rank % 2, 3)  # the batch block differs between ranks
            tpx.ops.linear_2d(x, torch.randn(3, 3), None, info.group_name("row"),
                              info.group_name("col"))
        elif case == "linear_3d":
            mesh = tpx.init_mesh("3d")
            info = tpx.mesh.check_mesh(mesh, "3d", "test")
            x = torch.randn(2, 3 + rank % 2)
            tpx.ops.linear_3d(x, torch.randn(1, x.shape[1]), None, info.group_name("input"),
                              info.group_name("weight"), info.group_name("output"))
    except ValueError as e:
        assert "different arguments" in str(e), e
    else:
        raise AssertionError(f"{case}: ranks with different arguments were not stopped")
    finally:
        os.environ.pop("TPX_DEBUG_CHECKS")


@pytest.mark.parametrize("case,world", [("chunks", 2), ("reduce_scatter_dtype", 2),
                                        ("all_reduce_dtype", 2), ("embedding_dtype", 2),
                                        ("linear_2d", 4),
                                        pytest.param("linear_3d", 8, marks=pytest.mark.slow)])
def test_debug_checks(case, world):
    run_ranks(_check_debug_checks, world, case, timeout=TIMEOUT * 2)


def _check_float64_cross_entropy(rank, world):
    """Float64 logits keep float64 through the vocab-parallel loss (the loss and its gradient
    were computed in float32 before: float32's error on a float64 loss)."""
    vocab = 37
    gen = torch.Generator().manual_seed(9)
    logits_full = torch.randn(64, vocab, dtype=torch.float64, generator=gen) * 4
    target = torch.randint(0, vocab, (64,), generator=gen)
    target[::7] = -100
    lo, hi = tpx.shard_range(vocab)
    for smoothing in (0.0, 0.1):
        mine = logits_full[:, lo:hi].clone().requires_grad_(True)
        loss = tpx.vocab_parallel_cross_entropy(mine, target, label_smoothing=smoothing,
                                                reduction="sum")
        ref_in = logits_full.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_in, target, label_smoothing=smoothing, reduction="sum")
        assert loss.dtype == torch.float64
        close(loss, ref, f"loss (smoothing {smoothing})", 1e-12)
        loss.backward()
        ref.backward()
        close(mine.grad, ref_in.grad[:, lo:hi], f"grad (smoothing {smoothing})", 1e-12)
    hidden = torch.randn(16, 8, dtype=torch.float64, generator=gen)
    weight = torch.randn(vocab, 8, dtype=torch.float64, generator=gen)
    t16 = target[:16]
    loss, _ = tpx.ops.linear_cross_entropy_rows(hidden, weight[lo:hi], t16, lo, vocab,
                                                chunk_size=5)
    close(loss, F.cross_entropy(hidden @ weight.t(), t16, reduction="none"), "linear ce", 1e-12)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_float64_cross_entropy(world):
    run_ranks(_check_float64_cross_entropy, world, timeout=TIMEOUT)


def _check_killed_during_save(rank, world, path):
    """A rank killed while tpx.checkpoint.save writes never leaves a checkpoint that loads as if
    complete: the ranks write into `<path>.partial` and rank 0 renames it when all is on disk,
    so the previous checkpoint at `path` stays whole and the partial one is refused."""
    import signal

    import torch.distributed.checkpoint as dcp

    import tpx.checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(tpx.ColumnParallelLinear(8, 6))
    tpx.checkpoint.save(model, path)
    assert tpx.checkpoint.is_complete(path)
    with open(os.path.join(path, "first"), "w"):
        pass  # marks the first save's directory
    real_save = dcp.save

    def dying_save(*args, **kwargs):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(*args, **kwargs)

    dcp.save = dying_save
    with torch.no_grad():
        model[0].weight.add_(1.0)
    try:
        tpx.checkpoint.save(model, path)
    except RuntimeError:
        pass  # the peer is gone: gloo's connection error
    else:
        raise AssertionError("the save finished without rank 1")
    assert tpx.checkpoint.is_complete(path) and os.path.exists(os.path.join(path, "first"))
    assert not tpx.checkpoint.is_complete(path + ".partial")
    try:
        tpx.checkpoint.load(model, path + ".partial")
    except FileNotFoundError as e:
        assert "not a complete checkpoint" in str(e), e
    else:
        raise AssertionError("an interrupted checkpoint loaded")


def test_killed_during_save(tmp_path):
    run_ranks(_check_killed_during_save, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT,
              crashes=(1,))


def _check_peer_killed_in_gather(rank, world):
    """A peer that dies while this rank waits in a gather over the group (an LM head's
    gather_output, without gradients): this rank raises a collective's failure
    (DistBackendError) promptly, not another error after the failure grace."""
    import signal

    os.environ["TPX_FAULT_GRACE"] = "20"
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 2 * world + 1)
    head = tpx.ColumnParallelLinear.from_linear(ref, gather_output=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        close(head(x), ref(x), "the gathered output")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            head(x)
        except RuntimeError as e:
            assert isinstance(e, dist.DistBackendError), (type(e), e)
        else:
            raise AssertionError("the gather finished without rank 1")
    waited = time.monotonic() - start
    assert waited < 15, f"the failure was raised after {waited:.1f} s"


def test_peer_killed_in_gather():
    run_ranks(_check_peer_killed_in_gather, 2, timeout=TIMEOUT, crashes=(1,))


def _check_one_rank_fails(rank, world, where, failing):
    """A tpx layer or op that raises on one rank while its peers wait in its collective: the
    peers raise promptly (well within the group's 60 s timeout), naming the failed rank and its
    error; the failed rank, if it catches the error and goes on with the next batch, raises at
    its next tpx op instead of pairing its messages with its peers' current step (before, the
    ranks ran on out of step with wrong sums). tpx closes only its own groups: the user's group
    and the default group still work afterwards. When every rank fails alike (the same bad
    input everywhere), nothing is cut off and the next step equals one device."""
    import tpx.comm_groups

    os.environ["TPX_FAULT_GRACE"] = "1"
    pg = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 5))
    model = torch.nn.Sequential(tpx.ColumnParallelLinear.from_linear(ref[0], group=pg),
                                torch.nn.GELU(),
                                tpx.RowParallelLinear.from_linear(ref[2], group=pg))
    if where == "gather":  # the peers wait in a gather over the group (gather_output)
        ref = torch.nn.Linear(8, 2 * world + 1)
        model = tpx.ColumnParallelLinear.from_linear(ref, group=pg, gather_output=True)
    gen = torch.Generator().manual_seed(1)

    def step(x, bad=False):
        if bad and where == "gather":  # a bad input: the layer's check raises
            return model(x[..., :-1]).sum()
        if bad and where == "layer":  # a bad input: RowParallelLinear's check raises
            h = model[1](model[0](x))[..., :-1]
            return model[2](h).sum()
        if bad:  # an allocation failing inside the op, after its first collective was posted
            tpx._C.testing.arm_fault(1)
            try:
                return model(x).sum()
            finally:
                tpx._C.testing.arm_fault(0)
        return model(x).sum()

    x = torch.randn(6, 8, generator=gen)
    close(step(x), ref(x).sum(), "step 1")
    # Every rank fails alike: the group stays usable.
    try:
        step(x, bad=True)
    except (ValueError, RuntimeError):
        pass
    else:
        raise AssertionError("the bad step did not raise")
    x = torch.randn(6, 8, generator=gen)
    close(step(x), ref(x).sum(), "the step after every rank failed alike")
    # One rank fails.
    x = torch.randn(6, 8, generator=gen)
    start = time.monotonic()
    if rank == failing:
        try:
            step(x, bad=True)
        except (ValueError, RuntimeError) as e:
            first = e
        else:
            raise AssertionError("the bad step did not raise")
        x = torch.randn(6, 8, generator=gen)  # "skip the batch" on this rank only
        try:
            step(x)
        except RuntimeError as e:
            assert "can no longer be used by tpx" in str(e) and type(first).__name__ in str(e), e
            assert type(e) is dist.DistError, type(e)  # the refusal, by its type
        else:
            raise AssertionError("the failed rank's next step ran (out of step with its peers)")
    else:
        # The layer fails before its collective, so the peers' step is cut off; the op fails
        # after its collective completed, so the peers' step is right and their next one is.
        for attempt in range(2):
            try:
                got = step(x)
            except RuntimeError as e:
                waited = time.monotonic() - start
                assert f"rank {failing} raised" in str(e), e
                assert isinstance(e, dist.DistBackendError), type(e)  # a collective's failure
                assert waited < 30, f"the peer learnt of the failure after {waited:.1f} s"
                break
            if where != "mid_op" or attempt == 1:
                raise AssertionError("the step finished without the failed rank")
            close(got, ref(x).sum(), "the peers' step whose collective the failed rank completed")
            start = time.monotonic()
        try:
            step(x)
        except RuntimeError as e:
            assert "can no longer be used by tpx" in str(e), e
            assert type(e) is dist.DistError, type(e)
        else:
            raise AssertionError("a later step ran on the broken group")
    with torch.no_grad():  # a call without gradients (the layers' short path) refuses it too
        try:
            model(x)
        except RuntimeError as e:
            assert type(e) is dist.DistError and "can no longer be used by tpx" in str(e), e
        else:
            raise AssertionError("a call without gradients ran on the broken group")
    assert tpx.comm_groups.group_broken_reason(pg) is not None
    for group in (pg, None):  # the user's groups are untouched
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=group)
        close(t, torch.full((3,), world * (world + 1) / 2), "the user's group after the fault")
    before = _loop_thread_ticks()
    time.sleep(1.0)
    idle = _loop_thread_ticks() - before
    assert idle <= 10, f"gloo's loop threads used {idle} ticks in an idle second (spinning)"


@pytest.mark.parametrize("where,world,failing", [
    ("layer", 2, 1), ("mid_op", 2, 1), ("gather", 2, 0),
    pytest.param("layer", 3, 2, marks=pytest.mark.slow),
    pytest.param("mid_op", 4, 0, marks=pytest.mark.slow)])
def test_one_rank_fails(where, world, failing):
    run_ranks(_check_one_rank_fails, world, where, failing, timeout=TIMEOUT,
              fresh=True)  # a rank fails on purpose
