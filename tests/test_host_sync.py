"""The fast path reads nothing back to the host: an embedding + LM head + loss step (forward
and backward) calls no ``Tensor.item`` / ``__bool__`` / ``__int__`` / ``__float__`` /
``tolist`` — on a GPU each would wait for the device and break CUDA graph capture. The value
checks still raise their clear errors (``tpx.checks``)."""

import contextlib
import os

import pytest
import torch

import tpx
from harness import run_ranks, local_part

_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist")


@contextlib.contextmanager
def count_host_reads():
    counts = {name: 0 for name in _READS}
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name):
        original = saved[name]

        def counted(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return counted

    for name in _READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _step_reads(rank, world, sequence_parallel, fused):
    V, d = 1003, 16
    torch.manual_seed(0)
    emb = tpx.VocabParallelEmbedding(V, d, sequence_parallel=sequence_parallel)
    head = tpx.ColumnParallelLinear(d, V, bias=False, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, V, (2, 4 * world))
    labels = torch.randint(0, V, (2, 4 * world))
    labels[0, 0] = -100

    def step():
        h = emb(ids)
        if fused:
            if sequence_parallel:  # the fused loss takes replicated hidden states
                h = tpx.autograd.gather_dim(h, 1, [h.shape[1]] * world, rank * h.shape[1],
                                            torch.distributed.group.WORLD)
            loss = tpx.linear_cross_entropy(h.reshape(-1, d), head.weight, labels.reshape(-1),
                                            vocab_size=V)
        else:
            logits = head(h)
            loss = tpx.vocab_parallel_cross_entropy(logits, labels, vocab_size=V)
        loss.backward()
        return loss

    step()  # warm-up: one-off work (index caches) may happen here
    with count_host_reads() as counts:
        step()
    assert sum(counts.values()) == 0, f"host reads on the fast path: {counts}"


@pytest.mark.parametrize("sequence_parallel,fused", [(False, False), (True, False), (False, True)])
def test_training_step_has_no_host_reads(sequence_parallel, fused):
    run_ranks(_step_reads, 2, sequence_parallel, fused)


def _errors_still_clear(rank, world):
    V = 11
    torch.manual_seed(0)
    emb = tpx.VocabParallelEmbedding(V, 4)
    with pytest.raises(ValueError, match="id 11 is outside the table"):
        emb(torch.tensor([[1, 11]]))
    with pytest.raises(ValueError, match="id -3 is outside the table"):
        emb(torch.tensor([[-3, 2]]))
    logits = torch.randn(2, local_part(emb.weight).shape[0])  # this rank's vocabulary rows
    with pytest.raises(ValueError, match="target id 12 is outside the vocabulary"):
        tpx.vocab_parallel_cross_entropy(logits, torch.tensor([0, 12]), vocab_size=V)
    os.environ["TPX_INPUT_CHECKS"] = "sync"
    try:
        with pytest.raises(ValueError, match="id 11 is outside the table"):
            emb(torch.tensor([[1, 11]]))
    finally:
        del os.environ["TPX_INPUT_CHECKS"]
    os.environ["TPX_INPUT_CHECKS"] = "bogus"
    try:
        with pytest.raises(ValueError, match="TPX_INPUT_CHECKS must be one of"):
            emb(torch.tensor([[1, 2]]))
    finally:
        del os.environ["TPX_INPUT_CHECKS"]


def test_value_checks_raise_clear_errors():
    run_ranks(_errors_still_clear, 2)
