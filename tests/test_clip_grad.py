"""tpx.clip_grad_norm_ / tpx.get_total_norm on sharded models: the norm of the FULL model's
gradients, equal on every rank to torch.nn.utils.clip_grad_norm_ of the unsharded model on
one device (2-norm, inf, p = 1.5), then clipping + an SGD step equal to one device's, with
replicated parameters identical on every rank. Layouts: 1-D TP 2 and 3 (vocab-parallel
embedding with an uneven vocabulary, SequenceParallel LayerNorms, column/row linears with
biases), GQA with KV heads replicated over ranks, a 2-D mesh, tpx + FSDP2 on a (dp, tp)
mesh. One all-reduce per process group, counted with tpx.comm_stats(). Non-finite norms
(error_if_nonfinite, NaN under the inf-norm), argument checks. Gradient accumulation: N
micro-batches with loss / N each, then clip and step, equal one big batch on one device."""

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks, local_part
from torch_compat import fully_shard, needs_fsdp2_on_cpu, get_total_norm

V = 13  # uneven over 2 and 3 ranks
SEQ = 6


class Net(nn.Module):
    """Embedding, a pre-norm MLP block with biases, a final norm and an LM head."""

    def __init__(self, vocab=V, dim=12, hidden=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.w2(F.gelu(self.w1(self.norm1(h))))
        return self.head(self.norm2(h))


def _plan():
    from tpx import (ColwiseParallel, Replicate, RowwiseParallel, SequenceParallel, Shard)

    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm1": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _models(seed=0):
    torch.manual_seed(seed)
    ref = Net()
    with torch.no_grad():  # norms away from their (1, 0) initialisation
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = tpx.parallelize_module(copy.deepcopy(ref), None, _plan())
    return ref, model


def _loss(model, ids, labels, vocab=V):
    return F.cross_entropy(model(ids).reshape(-1, vocab), labels.reshape(-1))


def _close(actual, expected, what, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def _check_grads(model, ref, what):
    """Every gradient of the sharded model equals its slice of the unsharded one's."""
    assert_like_unsharded(model, ref, what, grad=True, rtol=1e-4, atol=1e-6)


def _check_state(model, ref, what):
    """The gathered state equals the unsharded model's; replicated parameters are identical
    on every rank (bit for bit)."""
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(full[key], value, f"{key} after clip + step ({what})", rtol=1e-4, atol=1e-6)
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if tpx.sharding.sharding_of(p) is None:
            p = local_part(p)  # a replicated DTensor (a row layer's bias): the whole tensor
            copies = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(copies, p.detach().contiguous())
            for r, c in enumerate(copies):
                assert torch.equal(c, copies[0]), f"replicated {name} differs on rank {r}"


def _check_tp(rank, world):
    pg = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    for norm_type in (2.0, math.inf, 1.5):
        what = f"TP {world} norm_type={norm_type}"
        ref, model = _models()
        # The parameters tpx shards know how; the others (row-parallel biases, norms) do not.
        desc = {n: tpx.sharding.sharding_of(p) for n, p in model.named_parameters()}
        assert isinstance(desc["emb.weight"], tpx.sharding.GroupSharding), what
        assert desc["emb.weight"].full_shape == (V, 12)
        assert desc["w2.bias"] is None and desc["norm1.weight"] is None
        ids = torch.randint(0, V, (4, SEQ), generator=gen)
        labels = torch.randint(0, V, (4, SEQ), generator=gen)
        _loss(ref, ids, labels).backward()
        _loss(model, ids, labels).backward()
        _check_grads(model, ref, what)

        expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
        params = list(model.parameters())
        with tpx.comm_stats() as stats:
            total = tpx.get_total_norm([p.grad for p in params], norm_type, parameters=params)
        assert stats.calls() == 1 and stats.calls(pg, "all_reduce") == 1, (what, stats)
        _close(total, expected, f"get_total_norm ({what})")
        # Every parameter is a DTensor (the norms' Replicate(), as under PyTorch's
        # SequenceParallel): torch's own function gives the full norm as well. On the local
        # tensors alone it sees this rank's shards only: less than the full norm (under the
        # inf-norm, the rank holding the largest entry happens to get it right).
        assert all(isinstance(p, DTensor) for p in params), what
        assert all(isinstance(p.grad, DTensor) for p in params), what
        torch_total = get_total_norm([p.grad for p in params], norm_type)
        if isinstance(torch_total, DTensor):
            torch_total = torch_total.full_tensor()
        _close(torch_total, expected, f"torch's get_total_norm ({what})")
        local = get_total_norm([local_part(p.grad) for p in params], norm_type)
        if norm_type != math.inf:
            assert local < expected * (1 - 1e-3), (what, float(local), float(expected))

        max_norm = 0.5 * float(expected)  # clipping scales by about one half
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
        with tpx.comm_stats() as stats:
            total = tpx.clip_grad_norm_(model.parameters(), max_norm, norm_type)  # a generator
        assert stats.calls() == 1, (what, stats)
        _close(total, ref_total, f"clip_grad_norm_ total ({what})")
        _check_grads(model, ref, f"clipped, {what}")
        for m in (ref, model):
            torch.optim.SGD(m.parameters(), lr=0.5).step()
        _check_state(model, ref, what)


@pytest.mark.parametrize("world", [2, 3])
def test_clip_matches_one_device(world):
    run_ranks(_check_tp, world)


def _check_gqa(rank, world):
    """KV projections whose rows (one KV head) are held by every rank count once."""
    from tiny_llama import Decoder

    torch.manual_seed(0)
    ref = Decoder(vocab=V, dim=24, n_layers=1, n_heads=6, n_kv_heads=1, hidden=20)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = tpx.parallelize_module(copy.deepcopy(ref), None,
                                   tpx.plans.auto(ref, sequence_parallel=True))
    wk = model.layers[0].attention.wk
    assert wk.replicated_rows, "the KV heads should be replicated at this TP size"
    d = tpx.sharding.sharding_of(wk.weight)
    assert d.replicated_rows and d.owned() == ([(0, 4)] if rank == 0 else []), d.owned()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, V, (2, SEQ), generator=gen)
    labels = torch.randint(0, V, (2, SEQ), generator=gen)
    _loss(ref, ids, labels).backward()
    _loss(model, ids, labels).backward()
    _check_grads(model, ref, f"GQA TP {world}")
    for norm_type in (2.0, math.inf):
        expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
        params = list(model.parameters())
        total = tpx.get_total_norm([p.grad for p in params], norm_type, parameters=params)
        _close(total, expected, f"GQA norm_type={norm_type} TP {world}")
    max_norm = 0.3 * float(expected)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, math.inf)
    total = tpx.clip_grad_norm_(list(model.parameters()), max_norm, math.inf)
    _close(total, ref_total, f"GQA clip TP {world}")
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    _check_state(model, ref, f"GQA TP {world}")


@pytest.mark.parametrize("world", [2, 3])
def test_gqa_replicated_kv_rows_count_once(world):
    run_ranks(_check_gqa, world)


def _check_accumulation(rank, world, micro):
    """``micro`` micro-batches, each loss / micro backward, then clip and step, equal one
    batch of all of them on one device (the same clip and step)."""
    ref, model = _models(seed=3)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, V, (2 * micro, SEQ), generator=gen)
    labels = torch.randint(0, V, (2 * micro, SEQ), generator=gen)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(2):
        what = f"accumulation of {micro} micro-batches, TP {world}, step {step}"
        _loss(ref, ids, labels).backward()
        for i in range(micro):
            part = slice(2 * i, 2 * i + 2)
            (_loss(model, ids[part], labels[part]) / micro).backward()
        _check_grads(model, ref, what)
        max_norm = 0.5 * float(get_total_norm(
            [p.grad for p in ref.parameters()]))
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        total = tpx.clip_grad_norm_(model.parameters(), max_norm)
        _close(total, ref_total, what)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        _check_state(model, ref, what)
        ids = torch.randint(0, V, (2 * micro, SEQ), generator=gen)
        labels = torch.randint(0, V, (2 * micro, SEQ), generator=gen)


@pytest.mark.parametrize("world", [2, 3])
def test_gradient_accumulation_matches_one_big_batch(world):
    run_ranks(_check_accumulation, world, 3)


def _check_nonfinite(rank, world):
    bad_rank = world - 1
    gen = torch.Generator().manual_seed(2)
    for value, norm_type in ((math.inf, 2.0), (math.nan, 2.0), (math.nan, math.inf),
                             (math.inf, 1.5)):
        what = f"{value} in a shard of rank {bad_rank}, norm_type={norm_type}"
        ref, model = _models()
        ids = torch.randint(0, V, (2, SEQ), generator=gen)
        labels = torch.randint(0, V, (2, SEQ), generator=gen)
        _loss(ref, ids, labels).backward()
        _loss(model, ids, labels).backward()
        row = torch.tensor([model.w1.out_start])  # the first row rank `bad_rank` holds
        dist.broadcast(row, src=bad_rank)
        if rank == bad_rank:
            local_part(model.w1.weight.grad)[0, 1] = value  # this rank's first row
        ref.w1.weight.grad[int(row), 1] = value
        saved = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match="non-finite"):
            tpx.clip_grad_norm_(model.parameters(), 1.0, norm_type, error_if_nonfinite=True)
        for p, g in zip(model.parameters(), saved):  # raised on every rank, nothing scaled
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True, msg=what)
        # Without the error: the same non-finite norm on every rank, as torch's on one device.
        expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
        total = tpx.clip_grad_norm_(model.parameters(), 1.0, norm_type)
        assert not math.isfinite(float(expected)), what
        assert (total.isnan() and expected.isnan()) or total == expected, (
            what, float(total), float(expected))


def _check_arguments(rank, world):
    ref, model = _models()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, SEQ), generator=gen)
    _loss(ref, ids, ids).backward()
    _loss(model, ids, ids).backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    for bad in (0, -1.0, math.nan, -math.inf, "two"):
        with pytest.raises(ValueError, match="norm_type"):
            tpx.clip_grad_norm_(params, 1.0, norm_type=bad)
    with pytest.raises(ValueError, match="parameters"):
        tpx.get_total_norm([p.grad for p in params], parameters=params[:-1])
    # Gradients passed with the wrong parameters: a shape that contradicts the description.
    w1, w2 = model.w1.weight, model.w2.weight
    with pytest.raises(ValueError, match="described"):
        tpx.get_total_norm([w1.grad], parameters=[w2])
    with pytest.raises(TypeError, match="Tensors"):
        tpx.clip_grad_norm_([w1, "w2"], 1.0)
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g), "a failed call modified a gradient"
    # A single tensor is accepted, as torch accepts it: the norm of the full w1 gradient.
    one = tpx.get_total_norm(w1.grad, parameters=w1)
    _close(one, torch.linalg.vector_norm(ref.w1.weight.grad), "norm of one sharded tensor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(tpx.clip_grad_norm_((p for p in []), 1.0)) == 0.0
    assert any("empty generator" in str(w.message) for w in caught)


def _check_column_embedding(rank, world):
    """ColumnParallelEmbedding (embedding dim split unevenly) and a gathered column linear."""
    from tpx import ColwiseParallel, Replicate

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(V, 7), nn.Linear(7, 5))
    model = tpx.parallelize_module(copy.deepcopy(ref), None, {
        "0": ColwiseParallel(output_layouts=Replicate()),
        "1": ColwiseParallel(output_layouts=Replicate())})
    assert isinstance(model[0], tpx.ColumnParallelEmbedding)
    assert tpx.sharding.sharding_of(model[0].weight).dim == 1
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, V, (3, 4), generator=gen)
    g = torch.randn(3, 4, 5, generator=gen)
    (ref(ids) * g).sum().backward()
    (model(ids) * g).sum().backward()
    for norm_type, foreach in ((2.0, None), (3.0, False), (math.inf, True)):
        expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
        total = tpx.get_total_norm([p.grad for p in model.parameters()], norm_type,
                                   foreach=foreach, parameters=list(model.parameters()))
        _close(total, expected, f"column embedding norm_type={norm_type} foreach={foreach}")
    max_norm = 0.5 * float(expected)
    _close(tpx.clip_grad_norm_(model.parameters(), max_norm, foreach=False),
           torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm), "column embedding clip")
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    _check_state(model, ref, "column embedding")


def test_nonfinite_and_arguments():
    run_ranks(_check_nonfinite, 2)
    run_ranks(_check_arguments, 2)


def test_column_parallel_embedding():
    run_ranks(_check_column_embedding, 3)


def test_plain_tensors_match_torch():
    """Without any tpx parameter (no process group needed): torch's numbers, torch's clip."""
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    for t in a:
        t.grad = torch.randn_like(t)
    b = [t.detach().clone().requires_grad_() for t in a]
    for x, y in zip(a, b):
        y.grad = x.grad.clone()
    for norm_type in (2.0, 1.0, 3.5, math.inf):
        _close(tpx.get_total_norm([t.grad for t in a], norm_type),
               get_total_norm([t.grad for t in a], norm_type), str(norm_type))
    total = tpx.clip_grad_norm_(iter(a), 0.7)
    expected = torch.nn.utils.clip_grad_norm_(b, 0.7)
    _close(total, expected, "total")
    for x, y in zip(a, b):
        _close(x.grad, y.grad, "clipped")
    _close(tpx.clip_grad_norm_(a[0], 0.1), torch.nn.utils.clip_grad_norm_(b[0], 0.1), "single")


def _check_2d(rank, world):
    """A 2-D (row x col) mesh: blocks split over both dims, norms and embeddings replicated
    over "row"; one all-reduce per mesh dimension."""
    from tiny_llama import Decoder

    mesh = tpx.init_mesh("2d")
    torch.manual_seed(0)
    ref = Decoder(vocab=24, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, hidden=16)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout="2d"))
    kinds = {type(tpx.sharding.sharding_of(p)).__name__ for p in model.parameters()}
    assert kinds == {"MeshSharding"}, kinds
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 24, (4, 5), generator=gen)
    g = torch.randn(4, 5, 24, generator=gen)
    (ref(ids) * g).sum().backward()
    (model(ids) * g).sum().backward()
    for norm_type in (2.0, math.inf, 1.5):
        expected = get_total_norm([p.grad for p in ref.parameters()], norm_type)
        params = list(model.parameters())
        with tpx.comm_stats() as stats:
            total = tpx.get_total_norm([p.grad for p in params], norm_type, parameters=params)
        assert stats.calls(kind="all_reduce") == 2 and stats.calls() == 2, stats
        _close(total, expected, f"2-D norm_type={norm_type}", rtol=2e-5)
    max_norm = 0.5 * float(expected)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, 1.5)
    total = tpx.clip_grad_norm_(model.parameters(), max_norm, 1.5)
    _close(total, ref_total, "2-D clip", rtol=2e-5)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        _close(full[key], value, f"2-D {key} after clip + step", rtol=1e-4, atol=1e-5)


def test_2d_mesh():
    run_ranks(_check_2d, 4)


def _check_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from tiny_llama import Decoder

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    # One KV head, replicated over the two TP ranks: rows counted once, then split by FSDP.
    ref = Decoder(vocab=V, dim=16, n_layers=1, n_heads=4, n_kv_heads=1, hidden=24)
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, mesh["tp"], tpx.plans.auto(model))
    assert model.layers[0].attention.wk.replicated_rows
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # fully_shard's DTensor parameters inherit the tpx description of what they shard.
    wq = model.layers[0].attention.wq.weight
    assert isinstance(tpx.sharding.sharding_of(wq), tpx.sharding.GroupSharding), type(wq)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, 8), generator=gen)
    labels = torch.randint(0, V, (4, 8), generator=gen)
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    _loss(ref, ids, labels).backward()
    _loss(model, ids[mine], labels[mine]).backward()
    expected = get_total_norm([p.grad for p in ref.parameters()])
    max_norm = 0.5 * float(expected)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    with tpx.comm_stats() as stats:
        total = tpx.clip_grad_norm_(model.parameters(), max_norm)
    assert stats.calls(kind="all_reduce") == 2, stats  # the tp group, then the dp group
    _close(total, ref_total, "tpx + FSDP2 clip", rtol=1e-4)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    assert_like_unsharded(model, ref, "after clip + step (FSDP2)", rtol=1e-4, atol=1e-5,
                          local=lambda p: p.full_tensor())


@needs_fsdp2_on_cpu
def test_fsdp2_dp_by_tpx_tp():
    pytest.importorskip("torch.distributed.fsdp")
    run_ranks(_check_fsdp, 4)
