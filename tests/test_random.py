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


def _check_fork_default_device(rank, world):
    """``fork()`` without a device swaps the CPU generator and, when CUDA is in use, the current
    CUDA device's. CUDA is stubbed here (no GPU): its generator state lives in a dict."""
    import tpx.random as tr

    cuda = torch.device("cuda", 0)
    fake = {"state": torch.tensor([1], dtype=torch.uint8)}  # the replicated CUDA stream
    real_get, real_set, real_initial = tr._get, tr._set, tr._initial_state
    tr._get = lambda d: fake["state"].clone() if d.type == "cuda" else real_get(d)
    tr._set = lambda d, s: fake.__setitem__("state", s.clone()) if d.type == "cuda" else real_set(d, s)
    tr._initial_state = (lambda d: torch.tensor([2], dtype=torch.uint8) if d.type == "cuda"
                         else real_initial(d))
    real_current = tr._cuda_current
    try:
        tr.manual_seed(5)
        tr._cuda_current = lambda: None  # CUDA not in use: only the CPU generator
        assert tr._default_devices() == [torch.device("cpu")]
        tr._cuda_current = lambda: cuda  # CUDA in use
        assert tr._default_devices() == [torch.device("cpu"), cuda]
        cpu_before = torch.get_rng_state()
        with tr.fork():
            # both generators now draw the tensor-parallel stream
            assert torch.equal(fake["state"], torch.tensor([2], dtype=torch.uint8))
            inside = torch.rand(4)
            fake["state"] = torch.tensor([3], dtype=torch.uint8)  # the CUDA stream advanced
        assert torch.equal(fake["state"], torch.tensor([1], dtype=torch.uint8))  # restored
        assert torch.equal(torch.get_rng_state(), cpu_before)
        assert not torch.equal(inside, torch.rand(4))  # the CPU draw came from the TP stream
        with tr.fork():  # the CUDA tensor-parallel stream continues where it left off
            assert torch.equal(fake["state"], torch.tensor([3], dtype=torch.uint8))
        with tr.fork("cpu"):  # an explicit device swaps only that one
            assert torch.equal(fake["state"], torch.tensor([1], dtype=torch.uint8))
    finally:
        tr._get, tr._set, tr._initial_state = real_get, real_set, real_initial
        tr._cuda_current = real_current


def test_fork_default_swaps_cuda_when_in_use():
    run_ranks(_check_fork_default_device, 1)
