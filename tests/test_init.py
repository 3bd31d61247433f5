"""Initial weights from one rank (``src_rank``, default 0): with a different seed on every
rank, each tpx layer, ``from_linear`` / ``from_embedding`` and ``parallelize_module`` equal
rank 0's unsharded module (weights, forward, gradients) at world sizes 2 and 3; ``src_rank=None``
keeps the checksum check; arguments are still compared across ranks; the same seed on every
rank keeps the generators in step; peak memory of a non-source rank stays one shard plus one
step; ``tensor_checksum`` needs no full-size temporary."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, from_rank, run_ranks, local_vs, local_part
from memtrack import PeakMemory


def close(a, b, what):
    a = local_vs(a, b)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _differs_across_ranks(t):
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return any(not torch.equal(gathered[0], g) for g in gathered[1:])


def _grads_match(model, ref, what):
    assert_like_unsharded(model, ref, what, grad=True)


def _check_layers(rank, world):
    gen = torch.Generator().manual_seed(7)  # inputs: the same on every rank
    h, d_in, d_out = 3 * world + 1, 5, 2 * world + 1

    # Column -> ReLU -> row, built directly: rank 0's draw.
    torch.manual_seed(100 + rank)
    local = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, d_out))
    assert _differs_across_ranks(local[0].weight)  # the ranks really hold different models
    ref = from_rank(local)
    torch.manual_seed(100 + rank)
    col = tpx.ColumnParallelLinear(d_in, h)
    row = tpx.RowParallelLinear(h, d_out)
    assert torch.equal(local_part(col.weight), ref[0].weight[col.out_start:col.out_end])
    assert torch.equal(local_part(col.bias), ref[0].bias[col.out_start:col.out_end])
    assert torch.equal(local_part(row.weight), ref[2].weight[:, row.in_start:row.in_end])
    assert torch.equal(local_part(row.bias), ref[2].bias)  # replicated: identical on every rank

    x_full = torch.randn(4, d_in, generator=gen)
    x, xr = x_full.clone().requires_grad_(True), x_full.clone().requires_grad_(True)
    y, y_ref = row(torch.relu(col(x))), ref(xr)
    close(y, y_ref.detach(), "mlp forward")
    gy = torch.randn(4, d_out, generator=gen)
    (y * gy).sum().backward()
    (y_ref * gy).sum().backward()
    close(x.grad, xr.grad, "mlp grad input")
    close(col.weight.grad, ref[0].weight.grad[col.out_start:col.out_end], "grad column W")
    close(col.bias.grad, ref[0].bias.grad[col.out_start:col.out_end], "grad column b")
    close(row.weight.grad, ref[2].weight.grad[:, row.in_start:row.in_end], "grad row W")
    close(row.bias.grad, ref[2].bias.grad, "grad row b")

    # from_linear: every rank's own layer; the result is rank 0's.
    torch.manual_seed(200 + rank)
    lin1, lin2 = nn.Linear(d_in, h), nn.Linear(h, d_out, bias=False)
    ref1, ref2 = from_rank(lin1), from_rank(lin2)
    col = tpx.ColumnParallelLinear.from_linear(lin1, gather_output=True)
    row = tpx.RowParallelLinear.from_linear(lin2, input_is_parallel=False)
    close(col(x_full), ref1(x_full), "from_linear column forward (gathered)")
    z = torch.randn(3, h, generator=gen)
    close(row(z), ref2(z), "from_linear row forward")
    # src_rank=1: rank 1's layer.
    if world > 1:
        ref1b = from_rank(lin1, 1)
        colb = tpx.ColumnParallelLinear.from_linear(lin1, gather_output=True, src_rank=1)
        close(colb(x_full), ref1b(x_full), "from_linear src_rank=1")

    # Fused rows (out_rows), replicated KV-style rows: each rank still gets rank 0's rows.
    out_rows = [[(0, 2), (4, 5)] for _ in range(world)]
    out_rows[0] = [(0, 2), (2, 4)]
    torch.manual_seed(300 + rank)
    lin = nn.Linear(d_in, 5)
    ref_l = from_rank(lin)
    fused = tpx.ColumnParallelLinear.from_linear(lin, out_rows=out_rows)
    expect = torch.cat([ref_l.weight[s:e] for s, e in out_rows[rank]])
    assert torch.equal(local_part(fused.weight), expect)

    # Embeddings, built directly and from nn.Embedding, with a padding row.
    V, D = 4 * world + 1, 2 * world + 1
    torch.manual_seed(400 + rank)
    emb_local = nn.Embedding(V, D, padding_idx=2)
    emb_ref = from_rank(emb_local)
    torch.manual_seed(400 + rank)
    vocab = tpx.VocabParallelEmbedding(V, D, padding_idx=2)
    assert torch.equal(local_part(vocab.weight), emb_ref.weight[vocab.vocab_start:vocab.vocab_end])
    torch.manual_seed(400 + rank)
    colemb = tpx.ColumnParallelEmbedding(V, D, padding_idx=2)
    assert torch.equal(local_part(colemb.weight), emb_ref.weight[:, colemb.dim_start:colemb.dim_end])
    ids = torch.randint(0, V, (3, 4), generator=gen)
    for m, what in ((vocab, "vocab"), (colemb, "column")):
        emb_ref.zero_grad()
        out, out_ref = m(ids), emb_ref(ids)
        close(out, out_ref.detach(), f"{what} embedding forward")
        g = torch.randn(out.shape, generator=gen)
        (out * g).sum().backward()
        (out_ref * g).sum().backward()
        sh = next(iter(m._shards()))
        s, e = sh[2][rank][0]
        expected = emb_ref.weight.grad[s:e] if sh[1] == 0 else emb_ref.weight.grad[:, s:e]
        close(m.weight.grad, expected, f"{what} embedding grad")
    torch.manual_seed(500 + rank)
    e2 = nn.Embedding(V, D)
    e2_ref = from_rank(e2)
    fv = tpx.VocabParallelEmbedding.from_embedding(e2)
    fc = tpx.ColumnParallelEmbedding.from_embedding(e2)
    close(fv(ids), e2_ref(ids), "from_embedding vocab")
    close(fc(ids), e2_ref(ids), "from_embedding column")

    # reset_parameters redraws on rank 0 and hands out the shards again.
    torch.manual_seed(600 + rank)
    full = from_rank(nn.Linear(d_in, h))
    torch.manual_seed(600 + rank)
    col.reset_parameters()
    assert torch.equal(local_part(col.weight), full.weight[col.out_start:col.out_end])


@pytest.mark.parametrize("world", [2, 3])
def test_layers_take_rank0_weights(world):
    run_ranks(_check_layers, world)


class _Small(nn.Module):
    def __init__(self, V=11, d=6, h=9):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, V, bias=False)
        self.register_buffer("scale", torch.rand(d))

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.fc2(torch.relu(self.fc1(x)))
        return self.head(self.norm(x) * self.scale)


def _check_parallelize(rank, world):
    torch.manual_seed(700 + rank)
    model = _Small()
    with torch.no_grad():  # make the replicated parameters differ across ranks too
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    ref = from_rank(model)
    plan = {"emb": tpx.RowwiseParallel(), "fc1": tpx.ColwiseParallel(),
            "fc2": tpx.RowwiseParallel(), "head": tpx.ColwiseParallel(output_layouts=tpx.Replicate())}
    model = tpx.parallelize_module(model, None, plan)
    # Replicated parameters and buffers are rank 0's on every rank.
    assert torch.equal(model.norm.weight.to_local(), ref.norm.weight)  # a Replicate() DTensor
    assert torch.equal(model.scale, ref.scale)
    # PyTorch's name of the argument: src_data_rank=1 takes rank 1's module.
    torch.manual_seed(700 + rank)
    other = _Small()
    ref1 = from_rank(other, 1)
    tpx.parallelize_module(other, None, dict(plan), src_data_rank=1)
    full1 = tpx.checkpoint.full_state_dict(other)
    for key, value in ref1.state_dict().items():
        assert torch.equal(full1[key], value), key
    with pytest.raises(TypeError, match="disagree"):
        tpx.parallelize_module(_Small(), None, dict(plan), src_rank=1, src_data_rank=0)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), key
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(3))
    out, out_ref = model(ids), ref(ids)
    close(out, out_ref.detach(), "parallelize forward")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * g).sum().backward()
    (out_ref * g).sum().backward()
    _grads_match(model, ref, "parallelize")

    # An optimizer built before parallelize_module steps the sharded parameters (the DTensors
    # that took the place of the plain ones), and requires_grad is kept (a frozen weight stays
    # frozen).
    torch.manual_seed(800 + rank)
    small = _Small()
    small.fc1.weight.requires_grad_(False)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)

    class UsersAdam(torch.optim.Adam):  # a user's own optimizer class
        pass

    users = UsersAdam(small.parameters(), lr=0.1)
    # block by block, as torchtitan parallelizes: each call finds the optimizers again
    tpx.parallelize_module(small, None, {"fc1": tpx.ColwiseParallel()})
    tpx.parallelize_module(small, None, {"fc2": tpx.RowwiseParallel()})
    assert isinstance(small.fc1, tpx.ColumnParallelLinear)
    for o in (opt, users):
        held = [p for g in o.param_groups for p in g["params"]]
        assert [id(p) for p in held] == [id(p) for p in small.parameters()]
    assert not small.fc1.weight.requires_grad and small.fc1.bias.requires_grad
    assert local_part(small.fc1.weight).shape == (small.fc1.out_end - small.fc1.out_start, 6)
    assert small.fc1.weight.shape == (small.fc1.out_features, 6)  # the global shape


@pytest.mark.parametrize("world", [2, 3])
def test_parallelize_module_takes_rank0_model(world):
    run_ranks(_check_parallelize, world)


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


def _check_opt_out_and_errors(rank, world):
    torch.manual_seed(rank)  # different seeds
    for build in (lambda: tpx.ColumnParallelLinear(8, 6, src_rank=None),
                  lambda: tpx.RowParallelLinear(8, 6, src_rank=None),
                  lambda: tpx.VocabParallelEmbedding(9, 4, src_rank=None),
                  lambda: tpx.ColumnParallelEmbedding(9, 4, src_rank=None)):
        _raises(ValueError, "initial_weights", build)
    # An existing module under src_rank=None (PyTorch's src_data_rank=None): each rank keeps
    # its slice of its own module, as asked, with a warning that the ranks' modules differ.
    for build in (lambda: tpx.ColumnParallelLinear.from_linear(nn.Linear(8, 6), src_rank=None),
                  lambda: tpx.VocabParallelEmbedding.from_embedding(nn.Embedding(9, 4),
                                                                    src_rank=None),
                  lambda: tpx.parallelize_module(nn.Sequential(nn.Linear(4, 6)), None,
                                                 {"0": tpx.ColwiseParallel()}, src_rank=None)):
        with pytest.warns(UserWarning, match="ranks' modules differ"):
            build()
    # The same seed with src_rank=None: no error, and the slices of nn.Linear.
    torch.manual_seed(5)
    ref = nn.Linear(8, 7)
    torch.manual_seed(5)
    col = tpx.ColumnParallelLinear(8, 7, src_rank=None)
    assert torch.equal(local_part(col.weight), ref.weight[col.out_start:col.out_end])
    # Arguments are still compared with the default src_rank, before any weight moves.
    _raises(ValueError, "different arguments", tpx.ColumnParallelLinear, 8 + rank, 6)
    _raises(ValueError, "different arguments", tpx.RowParallelLinear, 8, 6, src_rank=rank)
    _raises(ValueError, "different arguments", tpx.parallelize_module,
            nn.Sequential(nn.Linear(4, 6 + rank)), None, {"0": tpx.ColwiseParallel()})
    _raises(ValueError, "`src_rank` must be None or a rank", tpx.ColumnParallelLinear, 8, 6,
            src_rank=world)
    _raises(ValueError, "`src_rank` must be None or a rank", tpx.parallelize_module,
            nn.Sequential(nn.Linear(4, 6)), None, {"0": tpx.ColwiseParallel()}, src_rank=-1)
    # Still in step: a last collective everyone reaches.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


@pytest.mark.parametrize("world", [2, 3])
def test_src_rank_none_and_argument_checks(world):
    run_ranks(_check_opt_out_and_errors, world)


def _check_same_seed(rank, world):
    """Same seed everywhere: the model equals one device's, and every rank's generator
    goes on as if it had drawn the full weights itself."""
    torch.manual_seed(11)
    ref = nn.Linear(6, 4 * world + 1)
    emb = nn.Embedding(5 * world, 3)
    after_ref = torch.randn(5)
    torch.manual_seed(11)
    col = tpx.ColumnParallelLinear(6, 4 * world + 1)
    vocab = tpx.VocabParallelEmbedding(5 * world, 3)
    after = torch.randn(5)
    assert torch.equal(local_part(col.weight), ref.weight[col.out_start:col.out_end])
    assert torch.equal(local_part(vocab.weight), emb.weight[vocab.vocab_start:vocab.vocab_end])
    assert torch.equal(after, after_ref), "generator not in step with one device"


@pytest.mark.parametrize("world", [2, 3])
def test_same_seed_equals_one_device(world):
    run_ranks(_check_same_seed, world)


def _check_peak_memory(rank, world):
    """Rows of 256 floats (1 KiB); full weight 96 x 256 (96 KiB) over ``world`` ranks; steps
    of 8 KiB from the source. A non-source rank must peak at its shard plus one step's
    piece (plus small bookkeeping), far below the full tensor; the source at least the full
    tensor (the measure sees the draw); with src_rank=None every rank draws it."""
    os.environ["TPX_INIT_CHUNK_BYTES"] = str(8 << 10)
    out_f, in_f = 96, 256
    full_bytes = out_f * in_f * 4
    shard_bytes = -(-out_f // world) * in_f * 4
    piece = (8 << 10) // world
    for cls, kwargs in ((tpx.ColumnParallelLinear, dict(bias=False)),
                        (tpx.RowParallelLinear, dict(bias=False))):
        torch.manual_seed(rank)
        with PeakMemory() as m:
            layer = cls(in_f, out_f, **kwargs)
        if rank == 0:
            assert m.peak >= full_bytes, (cls.__name__, m.peak)
        else:
            # one shard (+ uneven rounding) and one step's piece, with 4 KiB of slack
            bound = shard_bytes + in_f * 4 + piece + (4 << 10)
            assert m.peak <= bound, (cls.__name__, rank, m.peak, bound)
            assert m.peak < full_bytes // 2 + (8 << 10), (cls.__name__, m.peak)
            # every step's receive buffer stays within the piece (at least one row)
            steps = [s for s in m.sizes if s not in (local_part(layer.weight).numel() * 4,)]
            assert max(steps, default=0) <= max(piece, in_f * 4), (cls.__name__, m.sizes)
        del layer
    torch.manual_seed(0)
    with PeakMemory() as m:
        tpx.ColumnParallelLinear(in_f, out_f, bias=False, src_rank=None)
    assert m.peak >= full_bytes, m.peak  # every rank draws the full weight


@pytest.mark.parametrize("world", [2, 3])
def test_peak_memory_of_non_source_ranks(world):
    run_ranks(_check_peak_memory, world)


def test_tensor_checksum_needs_no_full_size_temporary():
    from tpx.agree import tensor_checksum

    gen = torch.Generator().manual_seed(0)
    t = torch.randn(2048, 2048, generator=gen)  # 16 MiB of float32
    expected = float(t.double().sum()) + float(t.double().abs().sum())
    with PeakMemory() as m:
        got = tensor_checksum(t)
    assert abs(got - expected) <= 1e-9 * abs(expected)
    # A float64 copy alone would be 32 MiB; the blocks are 1M elements (8 MiB) of float64.
    assert m.peak <= (8 << 20) + (1 << 16), m.peak
    # A transposed view (a Conv1D weight) and float64 input (left untouched).
    tt = t[:1024, :512].t()
    exp_t = float(tt.double().sum()) + float(tt.double().abs().sum())
    assert abs(tensor_checksum(tt) - exp_t) <= 1e-9 * abs(exp_t)
    d = torch.randn(100, 3, dtype=torch.float64, generator=gen)
    before = d.clone()
    exp_d = float(d.sum()) + float(d.abs().sum())
    assert abs(tensor_checksum(d) - exp_d) <= 1e-9 * abs(exp_d)
    assert torch.equal(d, before)
