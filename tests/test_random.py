"""tpx.random: replicated and tensor-parallel streams; dropout under TP."""

import pytest
import torch
import torch.distributed as dist

import tpx
from harness import run_ranks


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _check_streams(rank, world):
    with pytest.raises(RuntimeError, match="manual_seed"):
        with tpx.random.fork():
            pass
    draws = []
    for _ in range(2):
        tpx.random.manual_seed(123)
        a = torch.rand(6)
        with tpx.random.fork():
            b = torch.rand(6)
        a2 = torch.rand(6)
        with tpx.random.fork():
            c = torch.rand(6)
        draws.append((a, b, a2, c))
    # Deterministic for the seed.
    for x, y in zip(*draws):
        assert torch.equal(x, y)
    a, b, a2, c = draws[0]
    # The replicated stream is the same on every rank and is not advanced by fork().
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(6)) and torch.equal(a2, torch.rand(6))
    for t in _gather(a):
        assert torch.equal(t, a)
    # The tensor-parallel stream differs by rank and continues from one fork to the next.
    others = _gather(b)
    assert all(not torch.equal(others[r], b) for r in range(world) if r != rank)
    assert not torch.equal(b, c)


@pytest.mark.parametrize("world", [2, 3])
def test_streams(world):
    run_ranks(_check_streams, world)


def _check_gpt2_dropout(rank, world):
    from test_hf import V, tiny

    torch.manual_seed(0)
    model = tiny("gpt2", attn_pdrop=0.5, resid_pdrop=0.3, embd_pdrop=0.3,
                 attn_implementation="eager")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    model.train()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(2):
        tpx.random.manual_seed(42)
        out = model(input_ids=ids, labels=ids, output_hidden_states=True, output_attentions=True)
        losses.append(out.loss.detach())
        # Replicated activations (the residual stream, after embedding / residual dropout)
        # stay identical on every rank.
        for h in out.hidden_states:
            for other in _gather(h.detach()):
                torch.testing.assert_close(other, h.detach(), rtol=0, atol=0)
        # Attention dropout on this rank's heads uses this rank's stream: the dropped
        # positions differ across ranks.
        dropped = (out.attentions[0] == 0).to(torch.uint8)
        masks = _gather(dropped)
        assert all(not torch.equal(masks[r], dropped) for r in range(world) if r != rank)
        out.loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)  # deterministic
    # Dropout is live: evaluation mode gives another loss.
    model.eval()
    assert not torch.equal(model(input_ids=ids, labels=ids).loss.detach(), losses[0])


def test_gpt2_dropout_under_tp():
    pytest.importorskip("transformers")
    run_ranks(_check_gpt2_dropout, 2)
