"""parallelize_module on a plain-PyTorch Llama-style decoder (GQA, SwiGLU, tied-free LM
head) at TP 1, 2 and 4: logits, loss and every gradient equal the unsharded model, with and
without sequence parallelism and loss parallelism; one SGD step then full_state_dict equals
the unsharded model's state; load_full_state_dict round trip; bad plans."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

import tpx
import tpx.checkpoint
from harness import assert_like_unsharded, run_ranks
from tiny_llama import Decoder, tp_plan
from torch_compat import needs_prepare_module_input_output, torch_replicated_io_style

V = 1003


def _check_decoder(rank, world):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    for sp, lp in [(False, False), (True, False), (False, True), (True, True)]:
        case = f"sequence_parallel={sp} loss_parallel={lp}"
        ref = Decoder(vocab=V)
        model = tpx.parallelize_module(copy.deepcopy(ref), None, tp_plan(sp, lp))
        ids = torch.randint(0, V, (2, 8), generator=gen)
        labels = torch.randint(0, V, (2, 8), generator=gen)

        ref_loss = F.cross_entropy(ref(ids).view(-1, V), labels.view(-1))
        ref_loss.backward()
        logits = model(ids)
        if lp:
            loss = tpx.vocab_parallel_cross_entropy(logits, labels, vocab_size=V)
        else:
            loss = F.cross_entropy(logits.view(-1, V), labels.view(-1))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=case)
        loss.backward()

        assert_like_unsharded(model, ref, case, grad=True, rtol=1e-4, atol=1e-5)

        # One SGD step on both, then the gathered state equals the unsharded state.
        for m in (ref, model):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        full = tpx.checkpoint.full_state_dict(model)
        assert set(full) == set(ref.state_dict())
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"state {key} {case}: {m}")

        # Loading the full state into a differently initialised TP model reproduces it.
        torch.manual_seed(123)
        other = tpx.parallelize_module(Decoder(vocab=V), None, tp_plan(sp, lp))
        tpx.checkpoint.load_full_state_dict(other, ref.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(other(ids), model(ids), msg=case)
        ref.zero_grad()


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_decoder_matches_unsharded(world):
    run_ranks(_check_decoder, world)


def _check_bad_plans(rank, world):
    torch.manual_seed(0)
    model = Decoder(vocab=V)
    with pytest.raises(ValueError, match="matches no module"):
        tpx.parallelize_module(model, None, {"layers.*.attn.wq": tpx.ColwiseParallel()},
                               strict=True)
    with pytest.raises(TypeError, match="must be a ParallelStyle"):
        tpx.parallelize_module(model, None, {"output": "colwise"})
    with pytest.raises(ValueError, match="applies to nn.Linear"):
        tpx.parallelize_module(model, None, {"norm": tpx.ColwiseParallel()})
    # No plan: a warning and nothing changed, as PyTorch's.
    for empty in (None, {}):
        with pytest.warns(UserWarning, match="no parallelize_plan"):
            assert tpx.parallelize_module(model, None, empty) is model
    assert type(model.output) is torch.nn.Linear
    # By default (PyTorch's behaviour) a pattern that matches nothing is skipped with a
    # warning and the others are applied.
    with pytest.warns(UserWarning, match="'nothing.here' matches no module"):
        tpx.parallelize_module(model, None, {"nothing.here": tpx.ColwiseParallel(),
                                             "output": tpx.ColwiseParallel()})
    assert isinstance(model.output, tpx.ColumnParallelLinear)


@pytest.mark.parametrize("world", [2])
def test_bad_plans(world):
    run_ranks(_check_bad_plans, world)


def _check_sharded_attention_head_counts(rank, world):
    """ShardedAttention without `update` sets the head-count attributes it knows to the local
    counts, and raises, naming the module, when the module has none of them (it used to leave
    such a module silently computing with its global head count)."""
    from torch import nn

    from tpx.parallel import ShardedAttention

    class Known(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.num_key_value_heads, self.num_key_value_groups = 8, 2, 4

    class Unknown(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads_here = 8

    known = tpx.parallelize_module(Known(), None, ShardedAttention(8, 2))
    local_kv = 2 // world if 2 % world == 0 else 1
    assert (known.num_heads, known.num_key_value_heads, known.num_key_value_groups) == \
        (8 // world, local_kv, 8 // world // local_kv), vars(known)
    with pytest.raises(ValueError, match="Unknown has none of the head-count attributes.*"
                                         "update="):
        tpx.parallelize_module(Unknown(), None, ShardedAttention(8))
    shaped = tpx.parallelize_module(Unknown(), None,
                                    ShardedAttention(8, update=ShardedAttention.shapes_only))
    assert shaped.heads_here == 8


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_attention_head_counts(world):
    run_ranks(_check_sharded_attention_head_counts, world)


class _HeadNormAttention(torch.nn.Module):
    """q projection -> a per-head RMSNorm (one weight of head_dim, as Qwen3's q_norm) -> output
    projection: under TP each rank's norm sees only its own heads."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = torch.nn.Linear(dim, dim, bias=False)
        self.q_norm = torch.nn.RMSNorm(dim // heads)
        self.o_proj = torch.nn.Linear(dim, dim, bias=False)
        self.bias = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        q = self.q_proj(x)
        q = self.q_norm(q.view(*q.shape[:-1], -1, self.head_dim)).flatten(-2)
        return self.o_proj(q) + self.bias


def _check_replicas_and_grad_sum(rank, world):
    """A replicated per-head norm after a column-parallel projection gets partial gradients:
    plain (the mistake) its replicas drift and tpx.check_replicas names it, and
    TPX_CHECK_REPLICAS=1 raises at the end of the backward; with ReplicatedWithGradAllReduce
    its gradient is summed and the model trains equal to one device, check_replicas clean."""
    import os

    from tpx.parallel import ColwiseParallel, ReplicatedWithGradAllReduce, RowwiseParallel

    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    ref = _HeadNormAttention()
    with torch.no_grad():
        ref.q_norm.weight.copy_(1 + 0.1 * torch.randn(ref.head_dim, generator=gen))
    x = torch.randn(2, 5, 32, generator=gen)
    base = {"q_proj": ColwiseParallel(head_size=8), "o_proj": RowwiseParallel()}
    for fixed in (False, True):
        plan = dict(base, **({"q_norm": ReplicatedWithGradAllReduce()} if fixed else {}))
        model = tpx.parallelize_module(copy.deepcopy(ref), None, plan)
        model(x).square().sum().backward()
        found = tpx.check_replicas(model)
        if fixed:
            assert found == [], [str(f) for f in found]
            ref.zero_grad()
            ref(x).square().sum().backward()
            # a Replicate() DTensor, as PyTorch's styles make a parameter every rank holds
            # whole; its gradient too
            w = model.q_norm.weight
            assert isinstance(w, DTensor) and tuple(w.placements) == (Replicate(),), w
            assert isinstance(w.grad, DTensor) and tuple(w.grad.placements) == (Replicate(),)
            torch.testing.assert_close(w.grad.to_local(), ref.q_norm.weight.grad,
                                       rtol=1e-5, atol=1e-5)
        else:
            names = {(f.name, f.what) for f in found}
            assert names == {("q_norm.weight", "grad")}, [str(f) for f in found]
            with torch.no_grad():  # one SGD step: the values drift too
                for p in model.parameters():
                    p -= 0.1 * p.grad
            assert ("q_norm.weight", "value") in {(f.name, f.what)
                                                  for f in tpx.check_replicas(model)}
    os.environ["TPX_CHECK_REPLICAS"] = "1"
    try:
        model = tpx.parallelize_module(copy.deepcopy(ref), None, base)
        with pytest.raises(RuntimeError, match="(?s)q_norm.weight.*ReplicatedWithGradAllReduce"):
            model(x).square().sum().backward()
    finally:
        os.environ.pop("TPX_CHECK_REPLICAS")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_replicas_and_grad_sum(world):
    run_ranks(_check_replicas_and_grad_sum, world)


class _SetOrderedBuffers(torch.nn.Module):
    """Registers its buffers in a set's iteration order (as some transformers models register
    their rotary buffers): the order follows the process's hash seed."""

    KINDS = ("full", "sliding", "chunked", "local", "global", "linear", "window", "mixed")

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 24)
        self.out = torch.nn.Linear(24, 16)
        for kind in set(self.KINDS):
            self.register_buffer(f"table_{kind}", torch.randn(4))

    def forward(self, x):
        scale = sum(getattr(self, f"table_{k}").sum() for k in self.KINDS)
        return self.out(torch.relu(self.proj(x))) * scale


def _check_hash_seed_independent(rank, world):
    """Ranks whose interpreters started with different PYTHONHASHSEED (as separate torchrun
    launches do) register the buffers in different orders; parallelize_module still agrees
    across ranks, and every buffer is rank 0's, by name (no buffer takes another's values)."""
    import torch.distributed as dist

    from tpx.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    ref = _SetOrderedBuffers()
    gen = torch.Generator().manual_seed(1)
    for kind in ref.KINDS:  # by name: the same on every rank
        getattr(ref, f"table_{kind}").copy_(torch.randn(4, generator=gen))
    model = copy.deepcopy(ref)
    if rank:  # other values elsewhere: parallelize_module takes rank 0's
        for buf in model.buffers():
            buf.normal_()
    orders = [None] * world
    dist.all_gather_object(orders, [n for n, _ in model.named_buffers()])
    assert len({tuple(o) for o in orders}) > 1, f"the hash seeds gave one order: {orders}"
    tpx.parallelize_module(model, None, {"proj": ColwiseParallel(), "out": RowwiseParallel()})
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buf, rtol=0, atol=0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_hash_seed_independent():
    run_ranks(_check_hash_seed_independent, 2, rank_env=lambda r: {"PYTHONHASHSEED": 11 + r})


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 36)
        self.down = torch.nn.Linear(36, 16)
        self.up2 = torch.nn.Linear(16, 36)
        self.down2 = torch.nn.Linear(36, 16)

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        return x + self.down2(torch.relu(self.up2(x)))


def _check_torch_styles(rank, world):
    """Styles tpx did not write (PyTorch's own classes) are applied by PyTorch, mixed with
    tpx's in one plan: the output and every gradient equal the unsharded block."""
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

    torch.manual_seed(0)
    ref = _Block().double()
    model = copy.deepcopy(ref)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    tpx.parallelize_module(model, mesh, {
        # A PyTorch style tpx has no class of its own for, on the block.
        "": torch_replicated_io_style(),
        "up": TorchColwise(), "down": tpx.RowwiseParallel(),        # PyTorch's, then tpx's
        "up2": tpx.ColwiseParallel(), "down2": TorchRowwise(),      # tpx's, then PyTorch's
    })
    assert isinstance(model.up.weight, torch.distributed.tensor.DTensor)
    assert isinstance(model.down, tpx.RowParallelLinear)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, y_ref = model(x), ref(x)
    assert not isinstance(y, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    dtensor = torch.distributed.tensor.DTensor
    assert_like_unsharded(model, ref, "PyTorch's and tpx's styles", grad=True,
                          local=lambda t: t.full_tensor() if isinstance(t, dtensor) else t)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_pytorch_styles_applied_by_pytorch(world):
    run_ranks(_check_torch_styles, world)


def _check_failed_plan_changes_nothing(rank, world):
    """A plan whose last entry fails after PyTorch's styles and tpx's hook styles changed
    their modules in place: the error comes, and the model is as it was (the same parameter
    objects and values, no hooks, the unsharded output); the right plan then applies."""
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise

    torch.manual_seed(0)
    ref = _Block().double()
    model = copy.deepcopy(ref)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    with pytest.raises(ValueError, match="segments"):
        tpx.parallelize_module(model, mesh, {
            "": torch_replicated_io_style(),
            "up": TorchColwise(),                                            # params replaced
            "down": tpx.RowwiseParallel(),                                   # a new module
            "up2": tpx.PrepareModuleInput(input_layouts=(tpx.Replicate(),),  # hooks
                                          desired_input_layouts=(tpx.Replicate(),)),
            "down2": tpx.ColwiseParallel(segments=[1, 2]),                   # fails
        })
    assert dict(model.named_parameters()).keys() == before.keys()
    for n, p in model.named_parameters():
        assert p is before[n][0] and type(p) is torch.nn.Parameter, n
        torch.testing.assert_close(p.detach(), before[n][1], rtol=0, atol=0)
    assert type(model.down) is torch.nn.Linear
    for m in model.modules():
        for d in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_with_kwargs"):
            assert not getattr(m, d), (type(m).__name__, d)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    tpx.parallelize_module(model, mesh, {"up": TorchColwise(), "down": tpx.RowwiseParallel()})
    torch.testing.assert_close(model(x), ref(x))


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_failed_plan_changes_nothing(world):
    run_ranks(_check_failed_plan_changes_nothing, world)


class _SharedAndRouted(torch.nn.Module):
    """Two MLPs whose row-parallel outputs are left as partial sums and reduced once, as
    torchtitan's MoE layers do with their shared experts."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = (torch.nn.Linear(16, 36), torch.nn.Linear(16, 36),
                                     torch.nn.Linear(36, 16))
        self.v1, self.v2 = torch.nn.Linear(16, 20), torch.nn.Linear(20, 16)

    def forward(self, x):
        return (self.w2(F.silu(self.w1(x)) * self.w3(x)) +
                self.v2(torch.relu(self.v1(x))))


def _check_partial_outputs(rank, world):
    """``RowwiseParallel(output_layouts=Partial())``: partial sums, added, then reduce-scattered
    once by PyTorch's PrepareModuleInputOutput (torchtitan's MoE plan); and as a ``Partial()``
    DTensor with ``use_local_output=False``. Output, input and every parameter gradient equal
    the unsharded block (biases counted once)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    torch.manual_seed(0)
    ref = _SharedAndRouted().double()
    model = copy.deepcopy(ref)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    tpx.parallelize_module(model, mesh, {
        "": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(
            Replicate(),), use_local_input=True, output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),)),
        "w1": tpx.ColwiseParallel(), "w3": tpx.ColwiseParallel(),
        "w2": tpx.RowwiseParallel(output_layouts=Partial()),
        "v1": tpx.ColwiseParallel(), "v2": tpx.RowwiseParallel(output_layouts=Partial()),
    })
    assert model.w2.reduce_output is False
    seq = 2 * world
    x_full = torch.randn(2, seq, 16, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, seq, 16, dtype=torch.float64)
    mine = slice(rank * 2, rank * 2 + 2)
    x = x_full.detach()[:, mine].clone().requires_grad_()
    with tpx.comm_stats() as st:
        y = model(x)
    assert st.calls() == 0  # the partial sums travel in PyTorch's one reduce-scatter
    y_ref = ref(x_full)
    torch.testing.assert_close(y, y_ref[:, mine])
    (y * weights[:, mine]).sum().backward()
    (y_ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad[:, mine])
    assert_like_unsharded(model, ref, "RowwiseParallel(output_layouts=Partial())", grad=True,
                          local=lambda t: t.full_tensor() if isinstance(t, DTensor) else t)

    # use_local_output=False: a Partial() DTensor whose sum is the unsharded output
    torch.manual_seed(1)
    lin = torch.nn.Linear(20, 12).double()
    ref_lin = copy.deepcopy(lin)
    tpx.parallelize_module(lin, mesh, tpx.RowwiseParallel(input_layouts=Replicate(),
                                                          output_layouts=Partial(),
                                                          use_local_output=False))
    z = torch.randn(3, 20, dtype=torch.float64)
    out = lin(z)
    assert isinstance(out, DTensor) and out.placements == (Partial(),)
    assert out.shape == (3, 12)
    full = out.full_tensor()
    torch.testing.assert_close(full, ref_lin(z))
    full.square().sum().backward()
    ref_lin(z).square().sum().backward()
    assert_like_unsharded(lin, ref_lin, "Partial() DTensor output", grad=True,
                          local=lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
    for bad, match in ((lambda: tpx.RowwiseParallel(output_layouts=Partial("avg")), "sum"),
                       (lambda: tpx.parallelize_module(torch.nn.Embedding(8, 4), mesh,
                                                       tpx.RowwiseParallel(
                                                           output_layouts=Partial())),
                        "linear layer")):
        with pytest.raises(ValueError, match=match):
            bad()


@needs_prepare_module_input_output
@pytest.mark.parametrize("world", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_rowwise_partial_outputs(world):
    run_ranks(_check_partial_outputs, world)


def _check_one_context(rank, world):
    import warnings

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    seen = []

    class Record(tpx.ParallelStyle):
        """A user's style written for the one interface: apply(module, ctx)."""

        def apply(self, module, ctx):
            seen.append(ctx)
            return module

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Legacy(tpx.ParallelStyle):
            """A user's style written for the older interface: apply(module, pg)."""

            def apply(self, module, pg):
                seen.append(pg)
                return module
    assert any(issubclass(w.category, DeprecationWarning) and "apply(self, module, ctx)"
               in str(w.message) for w in caught), [str(w.message) for w in caught]

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    mesh = DeviceMesh("cpu", torch.arange(world))
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh, {
        "0": tpx.ColwiseParallel(), "2": tpx.RowwiseParallel(), "": Record(), "1": Legacy()},
        src_rank=world - 1)
    ctx, pg = seen
    assert isinstance(ctx, tpx.parallel.TPContext)
    assert ctx.mesh is mesh and ctx.src_rank == world - 1 and ctx.layout == "1d"
    assert ctx.world == world and ctx.rank == rank == dist.get_rank(ctx.group)
    assert pg is ctx.group
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)

    # A style's apply called directly with a group (as styles were once applied).
    lin = nn.Linear(8, 12)
    col = tpx.ColwiseParallel().apply(copy.deepcopy(lin), None)
    start, end = tpx.shard_range(12)
    torch.testing.assert_close(col(x), lin(x)[:, start:end], rtol=1e-5, atol=1e-6)

    # A mesh style over a 1-D group is refused, by the style and by the plan, changing nothing.
    with pytest.raises(ValueError, match="shards over a 2-D, 2.5-D or 3-D mesh"):
        tpx.MeshParallel().apply(lin, None)
    other = copy.deepcopy(ref)
    with pytest.raises(ValueError, match="shards over a 2-D, 2.5-D or 3-D mesh"):
        tpx.parallelize_module(other, None, {"0": tpx.ColwiseParallel(),
                                             "2": tpx.MeshParallel()})
    assert type(other[0]) is nn.Linear and type(other[2]) is nn.Linear


@pytest.mark.parametrize("world", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_styles_receive_one_context(world):
    """Every style is applied with one TPContext (group, mesh, source rank, layout); styles
    written for the older apply(module, pg) keep working; at an uneven world size."""
    run_ranks(_check_one_context, world)


def _prepare_input_output(rank, world):
    """PrepareModuleInputOutput (PyTorch's style of that name): a module kept whole reads the
    gathered rows and hands back this rank's rows of its output, as one device computes."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    ref = copy.deepcopy(lin)
    x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
    mine = slice(4 * rank, 4 * rank + 4)
    tpx.parallelize_module(lin, None, tpx.PrepareModuleInputOutput(
        input_layouts=(tpx.Shard(0),), desired_input_layouts=(tpx.Replicate(),),
        use_local_input=True, output_layouts=(tpx.Replicate(),),
        desired_output_layouts=(tpx.Shard(0),)))
    out = lin(x[mine])
    assert not isinstance(out, torch.distributed.tensor.DTensor)  # use_local_output=True
    torch.testing.assert_close(out, ref(x)[mine])
    # Layouts of different lengths: tpx's ValueError, also PyTorch's AssertionError.
    for error in (ValueError, AssertionError):
        with pytest.raises(error, match="same length"):
            tpx.PrepareModuleInputOutput(input_layouts=(tpx.Shard(0), None),
                                         desired_input_layouts=(tpx.Replicate(),),
                                         output_layouts=tpx.Replicate(),
                                         desired_output_layouts=tpx.Shard(0))


def test_prepare_module_input_output():
    run_ranks(_prepare_input_output, 2)
