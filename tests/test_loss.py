"""Vocab-parallel cross-entropy against F.cross_entropy on the gathered logits: every
combination of label smoothing, ignore_index and reduction, gradients, in-place backward,
bf16, a vocabulary (1003) that does not divide by the world size, world sizes 1-4."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import tpx
from harness import run_ranks, local_part

V = 1003


def _case(rank, world, gen, *, smoothing, ignore_index, reduction, inplace, pass_vocab,
          dtype=torch.float32, shape=(3, 5)):
    case = (f"smoothing={smoothing} ignore_index={ignore_index} reduction={reduction} "
            f"inplace={inplace} vocab_size={pass_vocab} dtype={dtype}")
    full = (3 * torch.randn(*shape, V, generator=gen)).to(dtype)
    target = torch.randint(0, V, shape, generator=gen)
    target.view(-1)[::4] = ignore_index  # some rows ignored
    target.view(-1)[1] = V - 1          # the last id, held by the last rank
    kw = dict(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)

    ref_in = full.float().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, V), target.reshape(-1), **kw)
    if reduction == "none":
        ref = ref.view(shape)
    grad = torch.randn(ref.shape, generator=gen)
    ref.backward(grad)

    v0, v1 = tpx.shard_range(V)
    local = full[..., v0:v1].clone().requires_grad_(True)
    # In place, the backward overwrites the logits: give it a non-leaf copy to overwrite.
    x = local * 1 if inplace else local
    loss = tpx.vocab_parallel_cross_entropy(x, target, inplace_backward=inplace,
                                            vocab_size=V if pass_vocab else None, **kw)
    assert loss.dtype == dtype and loss.shape == ref.shape, case
    got_grad = torch.autograd.grad(loss, x, grad.to(dtype))[0]
    if inplace:
        assert got_grad.data_ptr() == x.data_ptr(), f"{case}: gradient not written in place"
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    else:  # bf16 inputs, fp32 arithmetic: within a bf16 rounding of the fp32 reference
        tol = dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(loss.float(), ref.detach(), msg=lambda m: f"loss {case}: {m}",
                               **tol)
    torch.testing.assert_close(got_grad.float(), ref_in.grad[..., v0:v1],
                               msg=lambda m: f"grad {case}: {m}", **tol)


def _check_cross_entropy(rank, world):
    gen = torch.Generator().manual_seed(50 + world)
    for smoothing, ignore_index, reduction in itertools.product(
            (0.0, 0.1), (-100, 7), ("none", "sum", "mean")):
        _case(rank, world, gen, smoothing=smoothing, ignore_index=ignore_index,
              reduction=reduction, inplace=False, pass_vocab=reduction != "sum")
    for inplace, reduction in itertools.product((True,), ("mean", "none")):
        _case(rank, world, gen, smoothing=0.1, ignore_index=-100, reduction=reduction,
              inplace=inplace, pass_vocab=True)
    for dtype in (torch.bfloat16, torch.float16):
        _case(rank, world, gen, smoothing=0.1, ignore_index=-100, reduction="mean",
              inplace=False, pass_vocab=True, dtype=dtype)
    _case(rank, world, gen, smoothing=0.0, ignore_index=-100, reduction="none", inplace=False,
          pass_vocab=False, shape=(17,))
    # The module form.
    loss_fn = tpx.VocabParallelCrossEntropyLoss(label_smoothing=0.2, vocab_size=V)
    full = torch.randn(6, V, generator=gen)
    target = torch.randint(0, V, (6,), generator=gen)
    v0, v1 = tpx.shard_range(V)
    torch.testing.assert_close(loss_fn(full[:, v0:v1], target),
                               F.cross_entropy(full, target, label_smoothing=0.2))
    # Without vocab_size the widths are exchanged: one more all-gather (8 bytes a rank), on
    # tpx's own group and counted like its other collectives.
    counts = {}
    for vocab_size in (V, None):
        with tpx.comm_stats() as stats:
            loss = tpx.vocab_parallel_cross_entropy(full[:, v0:v1], target, vocab_size=vocab_size)
        torch.testing.assert_close(loss, F.cross_entropy(full, target))
        counts[vocab_size] = (stats.calls(kind="all_gather"), stats.bytes(kind="all_gather"))
    if world > 1:
        assert counts[None] == (counts[V][0] + 1, counts[V][1] + 8), counts
    else:
        assert counts[None] == counts[V] == (0, 0), counts


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cross_entropy_matches_torch(world):
    run_ranks(_check_cross_entropy, world)


def _check_bad_inputs(rank, world):
    v0, v1 = tpx.shard_range(V)
    logits = torch.randn(4, v1 - v0)
    for bad in (V, -3):
        target = torch.tensor([1, 2, bad, 3])
        with pytest.raises(ValueError, match=f"target id {bad} is outside the vocabulary"):
            tpx.vocab_parallel_cross_entropy(logits, target, vocab_size=V)
    with pytest.raises(ValueError, match="reduction must be one of"):
        tpx.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long),
                                         reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing must lie in"):
        tpx.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long),
                                         label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"target shape \(3,\) must equal"):
        tpx.vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    if world > 1:
        with pytest.raises(ValueError, match="shard_range"):
            tpx.vocab_parallel_cross_entropy(logits, torch.zeros(4, dtype=torch.long),
                                             vocab_size=V + world)
    # The group is still in step.
    target = torch.tensor([0, 5, V - 1, -100])
    full = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tpx.vocab_parallel_cross_entropy(full[:, v0:v1], target),
                               F.cross_entropy(full, target))


@pytest.mark.parametrize("world", [1, 3])
def test_cross_entropy_bad_inputs(world):
    run_ranks(_check_bad_inputs, world)


def _opcheck_ce(rank, world):
    name = torch.distributed.group.WORLD.group_name
    v0, v1 = tpx.shard_range(V)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, v1 - v0, generator=gen, requires_grad=True)
    target = torch.randint(0, V, (6,), generator=gen)
    target[0] = -100
    torch.library.opcheck(torch.ops.tpx.vocab_parallel_cross_entropy.default,
                          (logits, target, v0, V, name, -100, 0.1, False))
    loss, lse = torch.ops.tpx.vocab_parallel_cross_entropy(logits.detach(), target, v0, V, name,
                                                           -100, 0.1, False)
    args = (torch.randn(6, generator=gen), logits.detach().clone(), target, lse, v0, V, -100, 0.1)
    torch.library.opcheck(torch.ops.tpx.vocab_parallel_cross_entropy_backward.default, args)
    torch.library.opcheck(torch.ops.tpx.vocab_parallel_cross_entropy_backward_.default, args)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(v1 - v0, 8, generator=gen, requires_grad=True)
    bias = torch.randn(v1 - v0, generator=gen, requires_grad=True)
    torch.library.opcheck(torch.ops.tpx.linear_cross_entropy.default,
                          (hidden, weight, bias, target, v0, V, name, 4, -100, 0.1))
    _, lse = torch.ops.tpx.linear_cross_entropy(hidden.detach(), weight.detach(), bias.detach(),
                                                target, v0, V, name, 4, -100, 0.1)
    for needs in ((True, True, True), (False, True, False), (True, False, True)):
        torch.library.opcheck(torch.ops.tpx.linear_cross_entropy_backward.default,
                              (torch.randn(6, generator=gen), hidden.detach(), weight.detach(),
                               bias.detach(), target, lse, v0, V, name, 4, -100, 0.1, *needs))


@pytest.mark.parametrize("world", [1, 2])
def test_cross_entropy_opcheck(world):
    run_ranks(_opcheck_ce, world)


def _check_linear_cross_entropy(rank, world):
    gen = torch.Generator().manual_seed(70 + world)
    d = 16
    v0, v1 = tpx.shard_range(V)
    for chunk_size, with_bias, smoothing, reduction in [(4, True, 0.1, "mean"),
                                                        (5, False, 0.0, "none"),
                                                        (None, True, 0.0, "sum"),
                                                        (1000, False, 0.2, "mean")]:
        case = f"chunk_size={chunk_size} bias={with_bias} smoothing={smoothing} {reduction}"
        hidden = torch.randn(2, 9, d, generator=gen)
        weight = torch.randn(V, d, generator=gen) / 4
        bias = torch.randn(V, generator=gen)
        target = torch.randint(0, V, (2, 9), generator=gen)
        target[0, ::3] = -100
        kw = dict(label_smoothing=smoothing, reduction=reduction)

        h_ref, w_ref, b_ref = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        logits = h_ref @ w_ref.t() + (b_ref if with_bias else 0)
        ref = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), **kw)
        if reduction == "none":
            ref = ref.view(2, 9)
        grad = torch.randn(ref.shape, generator=gen)
        ref.backward(grad)

        h = hidden.clone().requires_grad_(True)
        w = weight[v0:v1].clone().requires_grad_(True)
        b = bias[v0:v1].clone().requires_grad_(True) if with_bias else None
        loss = tpx.linear_cross_entropy(h, w, target, bias=b, chunk_size=chunk_size, **kw)
        loss.backward(grad)
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref.detach(), msg=lambda m: f"loss {case}: {m}", **tol)
        torch.testing.assert_close(h.grad, h_ref.grad, msg=lambda m: f"grad hidden {case}: {m}",
                                   **tol)
        torch.testing.assert_close(w.grad, w_ref.grad[v0:v1],
                                   msg=lambda m: f"grad weight {case}: {m}", **tol)
        if with_bias:
            torch.testing.assert_close(b.grad, b_ref.grad[v0:v1],
                                       msg=lambda m: f"grad bias {case}: {m}", **tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_linear_cross_entropy_matches_linear_plus_ce(world):
    run_ranks(_check_linear_cross_entropy, world)


def _check_masked_logits(rank, world):
    # -inf logits (masked vocabulary entries) on a shard that does not hold the target.
    V = 11
    torch.manual_seed(3)
    full = torch.randn(5, V)
    full[:, 0] = float("-inf")
    full[:, 6] = float("-inf")
    target = torch.tensor([3, 9, 10, 2, 7])
    full.requires_grad_(True)
    ref = F.cross_entropy(full, target, label_smoothing=0.0)
    ref.backward()
    start, end = tpx.shard_range(V)
    local = full.detach()[:, start:end].clone().requires_grad_(True)
    loss = tpx.vocab_parallel_cross_entropy(local, target, vocab_size=V)
    torch.testing.assert_close(loss, ref.detach())
    loss.backward()
    torch.testing.assert_close(local.grad, full.grad[:, start:end])


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_masked_logits(world):
    run_ranks(_check_masked_logits, world)


def _check_masked_shard_row(rank, world):
    # One rank's whole part of a row is -inf (a masked block of the vocabulary): the row's
    # loss and gradient stay finite and equal F.cross_entropy, in fp32 and fp64.
    V = 13
    start, end = tpx.shard_range(V)
    for dtype, smoothing in itertools.product((torch.float32, torch.float64), (0.0, 0.1)):
        gen = torch.Generator().manual_seed(17)
        full = torch.randn(4, V, generator=gen, dtype=dtype)
        s1, e1 = 0, (-(-V // world) if world > 1 else V // 2)  # rank 0's block
        full[1, s1:e1] = float("-inf")       # row 1: rank 0's part all -inf
        full[2, V - 2:] = float("-inf")      # row 2: the tail of the last rank
        target = torch.tensor([0, V - 1, 3, 5])
        ref_in = full.clone().requires_grad_(True)
        if smoothing:  # smoothing sums every log-probability: keep masked entries out of it
            full[1, s1:e1] = -1e4
            full[2, V - 2:] = -1e4
            ref_in = full.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_in, target, label_smoothing=smoothing)
        ref.backward()
        local = full[:, start:end].clone().requires_grad_(True)
        loss = tpx.vocab_parallel_cross_entropy(local, target, vocab_size=V,
                                                label_smoothing=smoothing)
        assert torch.isfinite(loss), (dtype, smoothing, loss)
        torch.testing.assert_close(loss, ref.detach())
        loss.backward()
        assert torch.isfinite(local.grad).all(), (dtype, smoothing)
        torch.testing.assert_close(local.grad, ref_in.grad[:, start:end])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_cross_entropy_shard_row_all_masked(world):
    run_ranks(_check_masked_shard_row, world)


def _check_default_chunks_uneven(rank, world, vocab, tokens):
    # The default chunk_size of the fused head + loss must be the same on every rank, even
    # when the vocabulary's shards differ in width (they shape the per-chunk collectives).
    import torch.distributed as dist

    from tpx.nn.functional import default_chunk_size

    d = 4
    v0, v1 = tpx.shard_range(vocab)
    widths = [min(vocab, (r + 1) * -(-vocab // world)) - min(vocab, r * -(-vocab // world))
              for r in range(world)]
    assert len(set(widths)) > 1, "the case must have uneven shards"
    chunk = default_chunk_size(vocab, world)
    assert chunk < tokens, "the case must need more than one chunk"
    gen = torch.Generator().manual_seed(vocab + world)
    hidden = torch.randn(tokens, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) / 2
    target = torch.randint(0, vocab, (tokens,), generator=gen)
    target[::7] = -100

    h = hidden.clone().requires_grad_(True)
    w = weight[v0:v1].clone().requires_grad_(True)
    loss = tpx.linear_cross_entropy(h, w, target, vocab_size=vocab, reduction="sum")
    loss.backward()

    # The reference: F.cross_entropy on the full logits, in token blocks so no rank holds all
    # tokens' full logits at once. The ranks share the tokens (each computes the full loss of
    # its range of tokens; the sums and gradients are then added over the ranks), so that
    # every token's reference is computed once, not once per rank.
    t0, t1 = rank * tokens // world, (rank + 1) * tokens // world
    h_ref = hidden[t0:t1].clone().requires_grad_(True)
    w_ref = weight.clone().requires_grad_(True)
    ref = torch.zeros((), dtype=torch.float64)
    for lo in range(0, t1 - t0, 512):
        part = F.cross_entropy(h_ref[lo:lo + 512] @ w_ref.t(),
                               target[t0:t1][lo:lo + 512], reduction="sum")
        part.backward()
        ref += part.item()
    grad_h = torch.zeros_like(hidden)
    grad_h[t0:t1] = h_ref.grad
    for t in (ref, grad_h, w_ref.grad):
        dist.all_reduce(t)
    torch.testing.assert_close(loss.item(), ref.item(), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(h.grad, grad_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad[v0:v1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("world,vocab,tokens", [(8, 50257, 2700),
                                               pytest.param(6, 32000, 3200, marks=pytest.mark.slow)])
def test_linear_cross_entropy_default_chunks_uneven_vocab(world, vocab, tokens):
    run_ranks(_check_default_chunks_uneven, world, vocab, tokens)


def _check_loss_parallel_context(rank, world):
    """``F.cross_entropy`` and ``nn.CrossEntropyLoss`` inside ``tpx.loss_parallel()`` on this
    rank's block of the classes equal the unsharded loss and logits gradient, with and without
    ``vocab_size``; with it, no host read (no all-gather of widths) happens per call."""
    from test_host_sync import count_host_reads

    gen = torch.Generator().manual_seed(11)
    v0, v1 = tpx.shard_range(V)
    for reduction, smoothing, pass_vocab, module in itertools.product(
            ("mean", "sum", "none"), (0.0, 0.2), (False, True), (False, True)):
        case = f"reduction={reduction} smoothing={smoothing} vocab_size={pass_vocab} nn={module}"
        full = 3 * torch.randn(4, 6, V, generator=gen)          # [N, d1, C]: classes last
        target = torch.randint(0, V, (4, 6), generator=gen)
        target[0, :2] = -100
        kw = dict(reduction=reduction, label_smoothing=smoothing)
        ref_in = full.movedim(-1, 1).clone().requires_grad_(True)   # [N, C, d1]
        ref = F.cross_entropy(ref_in, target, **kw)
        grad = torch.randn(ref.shape, generator=gen)
        ref.backward(grad)
        local = full[..., v0:v1].movedim(-1, 1).clone().requires_grad_(True)
        with tpx.loss_parallel(vocab_size=V if pass_vocab else None):
            fn = torch.nn.CrossEntropyLoss(**kw) if module else (
                lambda a, b: F.cross_entropy(a, b, **kw))
            fn(local, target)  # warm-up
            with count_host_reads() as reads:
                loss = fn(local, target)
        # Without vocab_size the widths are all-gathered and read per call (none at world 1).
        assert (sum(reads.values()) == 0) == (pass_vocab or world == 1), f"{case}: {reads}"
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"loss ({case}): {m}")
        loss.backward(grad)
        torch.testing.assert_close(local.grad, ref_in.grad[:, v0:v1], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"logits grad ({case}): {m}")
    with pytest.raises(ValueError, match="`vocab_size` must be a positive int"):
        with tpx.loss_parallel(vocab_size=0):
            pass


@pytest.mark.parametrize("world", [1, 3])
def test_loss_parallel_context_matches_torch(world):
    run_ranks(_check_loss_parallel_context, world)


def _check_dtensor_logits(rank, world):
    """torchtitan's loss path: the LM head is ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False), so the logits are a DTensor, and the loss is
    F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
    ignore_index=-100) inside loss_parallel(). It raised "got mixed torch.Tensor and
    DTensor" before; now it equals the unsharded loss and gradients, for every reduction, also
    through tpx.vocab_parallel_cross_entropy directly and for Replicate() logits."""
    import copy

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(V, 24), nn.Linear(24, V, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh, {
        "1": tpx.ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    ids = torch.randint(0, V, (2, 7), generator=gen)
    labels = torch.randint(0, V, (2, 7), generator=gen)
    labels[0, :3] = -100
    for reduction in ("sum", "mean", "none"):
        for path in ("loss_parallel", "functional", "replicated"):
            model.zero_grad()
            ref.zero_grad()
            pred = model(ids)
            assert isinstance(pred, DTensor) and pred.placements == (Shard(2),), pred
            if path == "replicated":
                pred = pred.redistribute(mesh, [Replicate()])
            logits, flat = pred.flatten(0, 1).float(), labels.flatten(0, 1)
            if path == "loss_parallel":
                with tpx.loss_parallel():
                    loss = F.cross_entropy(logits, flat, reduction=reduction, ignore_index=-100)
            else:
                loss = tpx.vocab_parallel_cross_entropy(logits, flat, reduction=reduction)
            want = F.cross_entropy(ref(ids).flatten(0, 1), flat, reduction=reduction)
            case = f"{path} reduction={reduction}"
            assert isinstance(loss, DTensor) and loss.placements == (Replicate(),), case
            torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-5, atol=1e-5, msg=case)
            (loss.sum() if reduction == "none" else loss).backward()
            (want.sum() if reduction == "none" else want).backward()
            lo, hi = tpx.shard_range(V)
            torch.testing.assert_close(local_part(model[1].weight.grad), ref[1].weight.grad[lo:hi],
                                       rtol=1e-5, atol=1e-5, msg=case)
            torch.testing.assert_close(local_part(model[0].weight.grad), ref[0].weight.grad, rtol=1e-5,
                                       atol=1e-5, msg=case)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dtensor_logits(world):
    run_ranks(_check_dtensor_logits, world)
