"""Checkpoints that hold only ``pytorch_model.bin`` (older models and fine-tunes): one file, or
shards with ``pytorch_model.bin.index.json``, in the Hub's layouts (a Llama; a Mixtral with
its experts per expert), read by tpx.from_pretrained at TP 2 and 3 memory-mapped, each rank
its slices: every parameter equal to transformers' one-device load of the same directory."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import tpx
import tpx.checkpoint
from harness import run_ranks

transformers = pytest.importorskip("transformers")


def _model(family):
    import hf_tiny

    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=32)
    else:
        cfg = hf_tiny.tiny_config("mixtral", num_attention_heads=6, num_key_value_heads=6,
                                  hidden_size=48, head_dim=8)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def write_bin(model, path, shards):
    """``model`` as older transformers wrote it: the keys and layout of its ``save_pretrained``
    (per-expert tensors), pickled in ``pytorch_model.bin`` or in ``shards`` files with an
    index."""
    from safetensors.torch import load_file

    model.save_pretrained(path)
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
            os.remove(os.path.join(path, f))
        elif f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    if shards == 1:
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: tensors[k] for k in keys[i::shards]}
        torch.save(part, os.path.join(path, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                  for t in tensors.values())},
                   "weight_map": weight_map}, f)


def _load_bin(rank, world, root, family, shards):
    path = os.path.join(root, f"{family}-{shards}")
    if rank == 0:
        write_bin(_model(family), path, shards)
    dist.barrier()
    assert not any(f.endswith(".safetensors") for f in os.listdir(path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = tpx.from_pretrained(path)
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"{family} .bin x{shards} TP {world}: {key}"
    ids = torch.randint(3, ref.config.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,shards,world", [
    ("llama", 1, 2), ("llama", 3, 3), ("mixtral", 2, 2),
    pytest.param("mixtral", 1, 3, marks=pytest.mark.slow)])
def test_bin_checkpoint(tmp_path, family, shards, world):
    run_ranks(_load_bin, world, str(tmp_path), family, shards)


def test_no_weights_named(tmp_path):
    (tmp_path / "config.json").write_text(transformers.LlamaConfig().to_json_string())
    with pytest.raises(FileNotFoundError, match="tpx.from_pretrained: no weights in.*"
                                                "pytorch_model.bin"):
        tpx.from_pretrained(str(tmp_path))
    torch.save({"w": torch.zeros(1)}, str(tmp_path / "optimizer.bin"))  # not weights
    with pytest.raises(FileNotFoundError, match="no weights"):
        tpx.from_pretrained(str(tmp_path))
