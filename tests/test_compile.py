"""torch.compile(fullgraph=True) traces the tpx layers (through the ops' fake
implementations) and gives eager's numbers, forward and backward."""


import pytest
import torch
from torch import nn

import tpx
from harness import private_compile_cache, run_ranks


@private_compile_cache()
def _check_compile(rank, world):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 4 * world + 2), nn.ReLU(), nn.Linear(4 * world + 2, 16))
    for sp in (False, True):
        kw = dict(sequence_parallel=sp, chunks=2)
        eager = nn.Sequential(tpx.ColumnParallelLinear.from_linear(ref[0], **kw), nn.ReLU(),
                              tpx.RowParallelLinear.from_linear(ref[2], **kw))
        compiled = torch.compile(eager, fullgraph=True)
        x = torch.randn(2, 4 * world, 16)
        if sp:
            x = x[:, 4 * rank:4 * rank + 4]
        y = compiled(x)
        grads = torch.autograd.grad(y.square().sum(), list(eager.parameters()))
        y_ref = eager(x)
        grads_ref = torch.autograd.grad(y_ref.square().sum(), list(eager.parameters()))
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2])
def test_compile_fullgraph_matches_eager(world):
    run_ranks(_check_compile, world, timeout=600)


@private_compile_cache()
def _check_compile_decoder(rank, world):
    import copy

    from tiny_llama import Decoder, tp_plan

    torch.manual_seed(0)
    # The hand-written plan, and tpx.plans.auto's (with its ShardedAttention hooks).
    # One decoder layer: the traced graph (and the compile time) grows with every layer, and
    # the layers are alike.
    plans = [lambda sp, lp: tp_plan(sp, lp),
             lambda sp, lp: tpx.plans.auto(Decoder(vocab=1003, n_layers=1), sequence_parallel=sp,
                                           loss_parallel=lp)]
    # The first through AOT autograd only (the graph traced through the ops' fakes), the
    # second (sequence and loss parallel) through inductor's code generation too.
    for (sp, lp), plan, backend in zip([(False, False), (True, True)], plans,
                                       ["aot_eager", "inductor"]):
        ref = Decoder(vocab=1003, n_layers=1)
        eager = tpx.parallelize_module(copy.deepcopy(ref), None, plan(sp, lp))
        compiled = torch.compile(tpx.parallelize_module(copy.deepcopy(ref), None, plan(sp, lp)),
                                 fullgraph=True, backend=backend)
        ids = torch.randint(0, 1003, (2, 8))
        y, y_ref = compiled(ids), eager(ids)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        y.square().mean().backward()
        y_ref.square().mean().backward()
        for (name, p), p_ref in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name} sp={sp} lp={lp}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_compile_parallelized_decoder_fullgraph(world):
    run_ranks(_check_compile_decoder, world, timeout=600)
