"""VocabParallelEmbedding against nn.Embedding: forward, weight gradient, padding_idx,
sequence parallelism, an uneven vocabulary (1003), seeded initialisation, bad ids."""

import os

import pytest
import torch
from torch import nn

import tpx
from harness import run_ranks, local_part

V, D = 1003, 8


def _check_embedding(rank, world):
    gen = torch.Generator().manual_seed(60 + world)
    torch.manual_seed(4)
    for padding_idx, sp, shape, seq_dim in [(None, False, (3, 7), 1), (5, False, (11,), 0),
                                            (V - 1, True, (2, 2 * world), 1),
                                            (None, True, (3 * world, 2), 0)]:
        case = f"padding_idx={padding_idx} sp={sp} shape={shape}"
        ref = nn.Embedding(V, D, padding_idx=padding_idx)
        emb = tpx.VocabParallelEmbedding.from_embedding(ref, sequence_parallel=sp,
                                                        sequence_dim=seq_dim)
        ids = torch.randint(0, V, shape, generator=gen)
        ids.view(-1)[0] = V - 1  # held by the last rank
        if padding_idx is not None:
            ids.view(-1)[1::3] = padding_idx
        gy = torch.randn(*shape, D, generator=gen)
        y_ref = ref(ids)
        (y_ref * gy).sum().backward()
        y = emb(ids)
        if sp:
            s = shape[seq_dim] // world
            y_ref, gy = y_ref.narrow(seq_dim, rank * s, s), gy.narrow(seq_dim, rank * s, s)
        torch.testing.assert_close(y, y_ref.detach(), rtol=0, atol=0, msg=case)
        (y * gy).sum().backward()
        torch.testing.assert_close(local_part(emb.weight.grad), ref.weight.grad[emb.vocab_start:emb.vocab_end],
                                   rtol=1e-5, atol=1e-5, msg=case)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_embedding_matches_nn_embedding(world):
    run_ranks(_check_embedding, world)


def _check_init_and_errors(rank, world):
    torch.manual_seed(8)
    ref = nn.Embedding(V, D, padding_idx=3)
    torch.manual_seed(8)
    emb = tpx.VocabParallelEmbedding(V, D, padding_idx=3)
    assert torch.equal(local_part(emb.weight), ref.weight[emb.vocab_start:emb.vocab_end].detach())
    for bad in (V, -1):
        with pytest.raises(ValueError, match=f"id {bad} is outside the table"):
            emb(torch.tensor([[0, bad]]))
    with pytest.raises(ValueError, match="ids must be an integer Tensor"):
        emb(torch.zeros(2, 3))
    if world > 1:
        sp = tpx.VocabParallelEmbedding(V, D, sequence_parallel=True)
        with pytest.raises(ValueError, match="must divide by the group size"):
            sp(torch.zeros(2, world + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="padding_idx"):
        tpx.VocabParallelEmbedding(V, D, padding_idx=V)
    # Still in step.
    torch.testing.assert_close(emb(torch.tensor([0, 500, V - 1])), ref(torch.tensor([0, 500, V - 1])))


@pytest.mark.parametrize("world", [1, 3])
def test_embedding_init_and_errors(world):
    run_ranks(_check_init_and_errors, world)


def _check_lean_lookups(rank, world):
    """Without gradients (no_grad, inference_mode, a frozen table) the embedding calls its
    operator alone, and a column layer's gathered output (an LM head of an uneven vocabulary)
    skips its autograd node: the results are the general path's bit for bit (TPX_DEBUG_CHECKS=1
    turns the short path off) and nn.Embedding's / nn.Linear's; bad ids raise as before."""
    import os

    gen = torch.Generator().manual_seed(70 + world)
    torch.manual_seed(12)
    ref, head_ref = nn.Embedding(V, D, padding_idx=7), nn.Linear(D, V, bias=False)
    emb = tpx.VocabParallelEmbedding.from_embedding(ref)
    head = tpx.ColumnParallelLinear.from_linear(head_ref, gather_output=True)
    ids = torch.randint(0, V, (3, 5), generator=gen)
    ids[0, :3] = torch.tensor([0, 7, V - 1])

    def run():
        return emb(ids), head(emb(ids))

    os.environ["TPX_DEBUG_CHECKS"] = "1"
    try:
        with torch.no_grad():
            general = run()
    finally:
        os.environ.pop("TPX_DEBUG_CHECKS")
    with torch.no_grad():
        lean = run()
    with torch.inference_mode():
        inference = run()
    for p in (emb.weight, head.weight):
        p.requires_grad_(False)
    frozen = run()
    assert frozen[0].grad_fn is None and frozen[1].grad_fn is None
    for p in (emb.weight, head.weight):
        p.requires_grad_(True)
    trained = run()
    assert trained[1].grad_fn is not None
    torch.testing.assert_close(lean[0], ref(ids).detach(), rtol=0, atol=0)
    torch.testing.assert_close(lean[1], head_ref(ref(ids)).detach(), rtol=1e-5, atol=1e-5)
    for got, what in [(general, "general path"), (inference, "inference_mode"),
                      (frozen, "frozen parameters"), (trained, "training call")]:
        assert torch.equal(got[0], lean[0]) and torch.equal(got[1].detach(), lean[1]), what
    with torch.no_grad():
        for bad in (V, -1, -V - 3):  # the common call checks them in its lookup
            with pytest.raises(ValueError, match=f"id {bad} is outside the table"):
                emb(torch.tensor([[0, bad], [V - 1, 2]]))
        with pytest.raises(ValueError, match="ids must be an integer Tensor"):
            emb(torch.zeros(2, 3))
        os.environ["TPX_INPUT_CHECKS"] = "off"  # no check: an id outside gives a zero row
        try:
            got = emb(torch.tensor([0, V, 5]))
        finally:
            del os.environ["TPX_INPUT_CHECKS"]
        assert torch.equal(got[1], torch.zeros(D)) and torch.equal(got[0::2], ref.weight[[0, 5]])
        assert torch.equal(emb(ids), lean[0])  # every rank still in step


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lean_lookups_equal_the_general_path(world):
    run_ranks(_check_lean_lookups, world)


def _check_lookup_layouts(rank, world):
    """The lookup operator on tables of every floating dtype and row layout it meets (rows
    contiguous, rows strided inside a wider buffer, a column-major table, a single column) and
    on ids contiguous or not, some outside this rank's rows: equal, bit for bit, to the rows
    of the full table (zero where no rank holds the id) summed over the ranks."""
    name = torch.distributed.group.WORLD.group_name
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for layout in ("contiguous", "strided rows", "column-major", "one column"):
            d = 1 if layout == "one column" else D
            full = torch.randn(V, d + 3, generator=gen).to(dtype)[:, 1:1 + d]
            if layout == "contiguous":
                full = full.contiguous()
            elif layout == "column-major":
                full = full.t().contiguous().t()
            v0, v1 = tpx.shard_range(V)
            weight = full[v0:v1]
            for ids in (torch.randint(0, V, (3, 5), generator=gen),
                        torch.randint(0, V, (5, 3), generator=gen).t(),  # not contiguous
                        torch.zeros(0, 2, dtype=torch.long)):
                case = f"{dtype}, {layout}, ids {tuple(ids.shape)} {ids.stride()}"
                got = torch.ops.tpx.vocab_parallel_embedding(weight, ids, v0, name, None, -1)
                torch.testing.assert_close(got, full[ids], rtol=0, atol=0, msg=case)
                assert got.is_contiguous(), case
    # ids outside the table (the layer checks those first) give zero rows
    full = torch.randn(V, D, generator=gen)
    v0, v1 = tpx.shard_range(V)
    ids = torch.tensor([-7, V + 5, 0, V - 1, 500, -1])
    got = torch.ops.tpx.vocab_parallel_embedding(full[v0:v1], ids, v0, name, None, -1)
    expected = torch.zeros(6, D)
    expected[2:5] = full[ids[2:5]]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("world", [1, 3])
def test_lookup_layouts_and_dtypes(world):
    run_ranks(_check_lookup_layouts, world)


def _opcheck_embedding(rank, world):
    name = torch.distributed.group.WORLD.group_name
    v0, v1 = tpx.shard_range(V)
    weight = torch.randn(v1 - v0, D, requires_grad=True)
    ids = torch.randint(0, V, (2, 2 * world), generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.tpx.vocab_parallel_embedding.default,
                          (weight, ids, v0, name, None, -1))
    torch.library.opcheck(torch.ops.tpx.vocab_parallel_embedding.default,
                          (weight, ids, v0, name, 1, 0))


@pytest.mark.parametrize("world", [1, 2])
def test_embedding_opcheck(world):
    run_ranks(_opcheck_embedding, world)


def _check_column_embedding(rank, world):
    import tpx.checkpoint

    V, D = 37, 13  # D does not divide by 2, 3 or 4
    for gather, padding_idx in [(True, None), (False, 5)]:
        torch.manual_seed(0)
        ref = nn.Embedding(V, D, padding_idx=padding_idx)
        model = nn.Sequential(nn.Embedding(V, D, padding_idx=padding_idx))
        model[0].load_state_dict(ref.state_dict())
        layout = tpx.Replicate() if gather else tpx.Shard(-1)
        tpx.parallelize_module(model, None, {"0": tpx.ColwiseParallel(output_layouts=layout)})
        emb = model[0]
        assert isinstance(emb, tpx.ColumnParallelEmbedding)
        start, end = tpx.shard_range(D)
        ids = torch.randint(0, V, (3, 9))
        ids[0, 0] = 5
        g = torch.randn(3, 9, D)
        y_ref = ref(ids)
        (y_ref * g).sum().backward()
        y = emb(ids)
        torch.testing.assert_close(y, y_ref if gather else y_ref[..., start:end].contiguous())
        (y * (g if gather else g[..., start:end])).sum().backward()
        torch.testing.assert_close(local_part(emb.weight.grad), ref.weight.grad[:, start:end])
        full = tpx.checkpoint.full_state_dict(model)
        torch.testing.assert_close(full["0.weight"], ref.weight.detach())
    # Seeded construction equals nn.Embedding's initialisation.
    torch.manual_seed(4)
    built = tpx.ColumnParallelEmbedding(V, D, padding_idx=2)
    torch.manual_seed(4)
    torch.testing.assert_close(local_part(built.weight), nn.Embedding(V, D, padding_idx=2).weight[:, start:end])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_column_parallel_embedding_matches_torch(world):
    run_ranks(_check_column_embedding, world)
