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


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
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
    with pytest.raises(FileNotFoundError,
                       match="load_hf_checkpoint: no weights in.*neither .safetensors"):
        tpx.checkpoint.load_hf_checkpoint(model, os.path.dirname(path))


@pytest.mark.parametrize("family,world", [("llama", 4), ("gpt2", 2)])
def test_load_hf_checkpoint(tmp_path, family, world):
    run_ranks(_hf_load, world, family, str(tmp_path / "hf"))


def _neox_load(rank, world, path, partial):
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = tiny("gpt_neox")
    if rank == 0:
        ref.save_pretrained(path)
        # The same checkpoint without the final norm's weight.
        full = os.path.join(path, "model.safetensors")
        with safe_open(full, framework="pt") as f:
            kept = {k: f.get_tensor(k) for k in f.keys() if "final_layer_norm.weight" not in k}
        os.makedirs(partial)
        save_file(kept, os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        # transformers writes the head under its legacy name; the model's key is lm_head.weight
        assert "embed_out.weight" in f.keys() and "lm_head.weight" not in f.keys()
    ids = _batch()
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    torch.manual_seed(5)
    model = tiny("gpt_neox")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    result = tpx.checkpoint.load_hf_checkpoint(model, path)
    assert result == [] and result.missing_keys == [], result
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    torch.manual_seed(5)
    model = tiny("gpt_neox")
    tpx.parallelize_module(model, None, tpx.plans.auto(model))
    before = model.gpt_neox.final_layer_norm.weight.clone()
    head_before = model.lm_head.weight.clone()
    with pytest.raises(ValueError, match=r"does not hold \['gpt_neox.final_layer_norm.weight'\]"
                                         r".*nothing was loaded.*strict=False"):
        tpx.checkpoint.load_hf_checkpoint(model, partial)
    assert torch.equal(model.lm_head.weight, head_before)  # nothing was loaded
    with pytest.warns(UserWarning, match=r"1 parameters or buffers .* keep their current "
                                         r"values: \['gpt_neox.final_layer_norm.weight'\]"):
        result = tpx.checkpoint.load_hf_checkpoint(model, partial, strict=False)
    assert result.missing_keys == ["gpt_neox.final_layer_norm.weight"] and result == []
    assert torch.equal(model.gpt_neox.final_layer_norm.weight, before)
    assert not torch.equal(model.lm_head.weight, head_before)  # the head was read


def test_load_hf_checkpoint_renamed_keys(tmp_path):
    # GPT-NeoX's save_pretrained writes embed_out.weight: loaded by transformers' own mapping.
    run_ranks(_neox_load, 2, str(tmp_path / "hf"), str(tmp_path / "partial"))
