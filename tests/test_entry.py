"""Calls that need every rank of a group, entered by some ranks only (``if rank == 0:
model.save_pretrained(d)``): an error on the ranks that came, within ``TPX_ENTRY_GRACE``
seconds, naming the ranks that did not, with nothing written; the ranks that did not come are
not harmed (the same call made by every rank right after works). Each call at TP 2 (rank 0
alone, the tutorials' idiom) and TP 3 (the last rank missing)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tpx
import tpx.checkpoint
from harness import run_ranks
from tpx.comm.entry import RanksMissingError

transformers = pytest.importorskip("transformers")

GRACE = 1.0


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=6,
                                   num_key_value_heads=6, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg)


def _sharded():
    model = _llama()
    return tpx.parallelize_module(model, None, tpx.plans.auto(model))


def _files(path):
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _peft(model):
    import peft

    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))


# Each case: (build what the call needs, on every rank; the call; what it wrote, if anything).
def _cases(root):
    def saved(sub):  # a checkpoint every rank wrote, for the loads
        def build():
            model = _sharded()
            tpx.checkpoint.save(model, os.path.join(root, sub))
            return model
        return build

    return {
        "model.save_pretrained": (_sharded, lambda m, d: m.save_pretrained(d), True),
        "tpx.checkpoint.save_pretrained": (
            _sharded, lambda m, d: tpx.checkpoint.save_pretrained(m, d), True),
        "peft save_pretrained": (lambda: _peft(_sharded()), lambda m, d: m.save_pretrained(d),
                                 True),
        "tpx.checkpoint.save": (_sharded, lambda m, d: tpx.checkpoint.save(m, d), True),
        "tpx.checkpoint.load": (saved("dcp"),
                                lambda m, d: tpx.checkpoint.load(m, os.path.join(root, "dcp")),
                                False),
        "full_state_dict": (_sharded, lambda m, d: tpx.checkpoint.full_state_dict(m), False),
        "from_pretrained": (None, lambda m, d: tpx.from_pretrained(os.path.join(root, "hf")),
                            False),
        "parallelize_module": (_llama, lambda m, d: tpx.parallelize_module(
            m, None, tpx.plans.auto(m)), False),
    }


def _some_ranks_call(rank, world, root):
    os.environ["TPX_ENTRY_GRACE"] = str(GRACE)
    absent = world - 1
    callers = [0] if world == 2 else [r for r in range(world) if r != absent]
    missing = [r for r in range(world) if r not in callers]
    if rank == 0:
        _llama().save_pretrained(os.path.join(root, "hf"))  # for from_pretrained
    dist.barrier()
    for name, (build, call, writes) in _cases(root).items():
        target = os.path.join(root, name.replace(" ", "_"))
        model = build() if build is not None else None
        if rank in callers:
            start = time.monotonic()
            with pytest.raises(RanksMissingError) as err:
                call(model, target)
            took = time.monotonic() - start
            assert err.value.missing == missing, (name, err.value.missing)
            text = str(err.value)
            assert f"{missing}" in text and "every rank" in text and "TPX_ENTRY_GRACE" in text, text
            assert GRACE - 0.1 <= took < GRACE + 5, (name, took)
            assert "save_pretrained" in text or "save_pretrained" not in name, text
            assert _files(target) == [], (name, _files(target))  # nothing written half
        dist.barrier()  # the user's group: the ranks that skipped the call wait here
        # The same call by every rank works, on the ranks that came and those that did not.
        out = call(model, target)
        if writes:
            assert _files(target), name
        if name == "full_state_dict":
            assert set(out) == set(_llama().state_dict()), name
        if name == "parallelize_module":
            assert isinstance(model.model.layers[0].mlp.up_proj.weight,
                              torch.distributed.tensor.DTensor)
        dist.barrier()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_call_some_ranks_never_enter(tmp_path, world):
    run_ranks(_some_ranks_call, world, str(tmp_path))


def _different_calls(rank, world, root):
    os.environ["TPX_ENTRY_GRACE"] = str(GRACE)
    model = _sharded()
    tpx.checkpoint.save(model, os.path.join(root, "b"))
    # rank 0 saves while the others load: an error on every rank, nothing written
    with pytest.raises(RanksMissingError, match="different calls"):
        if rank == 0:
            tpx.checkpoint.save(model, os.path.join(root, "a"))
        else:
            tpx.checkpoint.load(model, os.path.join(root, "b"))
    # each rank names its own directory: the same
    with pytest.raises(RanksMissingError, match="different arguments"):
        model.save_pretrained(os.path.join(root, f"rank{rank}"))
    assert not os.path.exists(os.path.join(root, "a"))
    assert not os.path.exists(os.path.join(root, f"rank{rank}"))
    # and the next call made alike by every rank works
    model.save_pretrained(os.path.join(root, "ok"))
    assert os.path.exists(os.path.join(root, "ok", "model.safetensors"))


def test_calls_that_differ_across_ranks(tmp_path):
    run_ranks(_different_calls, 2, str(tmp_path))


def _late_rank(rank, world, root):
    os.environ["TPX_ENTRY_GRACE"] = str(GRACE)
    model = _sharded()
    # rank 1 comes after rank 0 gave up: both raise, neither waits in a collective
    if rank == 1:
        time.sleep(GRACE + 1)
    start = time.monotonic()
    with pytest.raises(RanksMissingError):
        tpx.checkpoint.save(model, os.path.join(root, "late"))
    assert time.monotonic() - start < GRACE + 5
    dist.barrier()
    tpx.checkpoint.save(model, os.path.join(root, "late"))
    assert tpx.checkpoint.is_complete(os.path.join(root, "late"))


def test_rank_that_comes_too_late(tmp_path):
    run_ranks(_late_rank, 2, str(tmp_path))


def test_grace_setting_checked(monkeypatch):
    from tpx import config

    monkeypatch.setenv("TPX_ENTRY_GRACE", "0")
    with pytest.raises(ValueError, match="TPX_ENTRY_GRACE"):
        config.entry_grace()
    monkeypatch.setenv("TPX_ENTRY_GRACE", "1.5")
    assert config.entry_grace() == 1.5
