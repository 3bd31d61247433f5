"""Checkpoints across TP degrees: torch.distributed.checkpoint save at TP 2, load at TP 4 and
TP 1; Hugging Face safetensors read slice by slice into a sharded model."""

import os

import pytest
import torch
import torch.distributed as dist

import tpx
import tpx.checkpoint
from harness import run_ranks
from test_hf import V, tiny

pytest.importorskip("transformers")


def _batch():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, V, (2, 12), generator=g)


def _save_at(rank, world, family, ckpt, full_path):
    torch.manual_seed(0)
    model = tiny(family)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # weights away from their init
    tpx.checkpoint.save(model, ckpt)
    full = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    if rank == 0:
        torch.save(full, full_path)
    dist.barrier()


def _load_at(rank, world, family, ckpt, full_path):
    torch.manual_seed(5)  # a different initialisation: everything must come from the files
    model = tiny(family)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    tpx.checkpoint.load(model, ckpt)
    ref = tiny(family)
    ref.load_state_dict(torch.load(full_path))
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(full[key], value, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_dcp_reshards_tp2_to_tp4_and_tp1(tmp_path, family):
    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(_save_at, 2, family, ckpt, full)
    run_ranks(_load_at, 4, family, ckpt, full)
    run_ranks(_load_at, 1, family, ckpt, full)


def _hf_load(rank, world, family, path):
    torch.manual_seed(0)
    ref = tiny(family)
    if rank == 0:
        ref.save_pretrained(path)
    dist.barrier()
    torch.manual_seed(5)
    model = tiny(family)
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    unused = tpx.checkpoint.load_hf_checkpoint(model, path)
    assert unused == [], unused
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        tpx.checkpoint.load_hf_checkpoint(model, os.path.dirname(path))


@pytest.mark.parametrize("family,world", [("llama", 4), ("gpt2", 2)])
def test_load_hf_checkpoint(tmp_path, family, world):
    run_ranks(_hf_load, world, family, str(tmp_path / "hf"))
