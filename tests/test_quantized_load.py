"""Quantized checkpoints in the Hub's layouts (block FP8 as DeepSeek-V3 ships it, MXFP4 as
gpt-oss ships its experts) read by tpx.from_pretrained at TP 2 and 3, each rank the blocks of
its slice, dequantized: every parameter equal to transformers' dequantized one-device load
(exactly: the dequantization is elementwise), logits too, in float32 and bf16. Where the
sizes do not divide the block, transformers refuses the files; the reference is then the
dequantization the files encode, computed by the test's writer. A method tpx does not read,
and float8 values without their scales, raise before anything is loaded."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import tpx
import tpx.checkpoint
from harness import run_ranks

transformers = pytest.importorskip("transformers")
import quantized_files as qf  # noqa: E402


def _llama(hidden=48, inter=96):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=211, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=32))


def _gpt_oss():
    import hf_tiny

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_tiny.tiny_config(
        "gpt_oss", intermediate_size=96, num_attention_heads=6, num_key_value_heads=6))


def _ids(vocab):
    return torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(5))


def _same_model(model, ref_state, ref_logits, ids, what, dtype):
    full = tpx.checkpoint.full_state_dict(model)
    for key, value in ref_state.items():
        assert full[key].dtype == dtype, (what, key, full[key].dtype)
        assert torch.equal(full[key], value.to(dtype)), f"{what}: {key} differs"
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{what} logits: {m}")


def _load_against_transformers(rank, world, root, kind, dtype):
    path = os.path.join(root, kind)
    unsharded = _gpt_oss() if kind == "mxfp4" else _llama()
    if rank == 0:
        if kind == "mxfp4":
            qf.write_mxfp4(unsharded, path)
        else:
            qf.write_fp8(unsharded, path, block=(16, 16))
    dist.barrier()
    kw = ({"quantization_config": transformers.Mxfp4Config(dequantize=True)}
          if kind == "mxfp4" else {})
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    ids = _ids(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    model = tpx.from_pretrained(path, dtype=dtype)
    assert getattr(model.config, "quantization_config", None) is None  # read dequantized
    _same_model(model, ref.state_dict(), ref_logits, ids, f"{kind} {dtype} TP {world}", dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_like_transformers(tmp_path, world, kind):
    run_ranks(_load_against_transformers, world, str(tmp_path), kind, torch.float32)


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_quantized_bf16(tmp_path, kind):
    run_ranks(_load_against_transformers, 2, str(tmp_path), kind, torch.bfloat16)


def _blocks_that_do_not_divide(rank, world, root, dtype):
    # Blocks of 128 over sizes that divide neither the block nor the TP size (200 rows over
    # 3 ranks, 120 columns: one block, partly filled): transformers' loader refuses these
    # files, so the reference is the dequantization they encode.
    path = os.path.join(root, "fp8-128")
    unsharded = _llama(hidden=120, inter=200)
    if rank == 0:
        qf.write_fp8(unsharded, path, block=(128, 128))
    dist.barrier()
    _, encoded = qf.fp8_files(unsharded, (128, 128))
    ref = _llama(hidden=120, inter=200).to(dtype)
    ref.load_state_dict({k: v.to(dtype) for k, v in encoded.items()}, strict=False)
    ref.tie_weights()
    ids = _ids(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    model = tpx.from_pretrained(path, dtype=dtype)
    _same_model(model, ref.state_dict(), ref_logits, ids, f"fp8 block 128, TP {world}", dtype)


@pytest.mark.parametrize("world,dtype", [(3, torch.float32), (2, torch.bfloat16)])
def test_fp8_blocks_that_do_not_divide(tmp_path, world, dtype):
    run_ranks(_blocks_that_do_not_divide, world, str(tmp_path), dtype)


def _refused(rank, world, root):
    path = os.path.join(root, "q")
    if rank == 0:
        qf.write_fp8(_llama(), path, block=(16, 16))
    dist.barrier()
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    # another method: named, before anything is built or read
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    cfg = transformers.LlamaConfig.from_dict(config)
    with pytest.raises(ValueError, match="quant_method='awq'.*nothing was loaded"):
        tpx.from_pretrained(path, config=cfg)
    # float8 values with no quantization_config: never cast as they are
    del config["quantization_config"]
    cfg = transformers.LlamaConfig.from_dict(config)
    with pytest.raises(ValueError, match="float8_e4m3fn.*Nothing was loaded"):
        tpx.from_pretrained(path, config=cfg, strict=False)


def test_quantized_refused(tmp_path):
    run_ranks(_refused, 2, str(tmp_path))


def test_block_reads_cover_only_their_blocks(tmp_path):
    """A region of a block-quantized weight reads the blocks it covers: every region of a
    weight 37 x 53 in blocks of 16 x 8 equals the same region of the whole dequantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tpx.checkpoint import lazy, quantized

    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=g)
    q, s = qf.fp8_block(w, (16, 8))
    save_file({"w": q, "s": s}, str(tmp_path / "f.safetensors"))
    f = safe_open(str(tmp_path / "f.safetensors"), framework="pt")
    node = quantized.BlockDequant(lazy.Source(f.get_slice("w"), "w", "f"),
                                  lazy.Source(f.get_slice("s"), "s", "f"), (16, 8), "w")
    whole = qf.fp8_dequant(q, s, (16, 8))
    assert torch.equal(node.read(), whole)
    for _ in range(20):
        r0 = sorted(torch.randint(0, 38, (2,), generator=g).tolist())
        c0 = sorted(torch.randint(0, 54, (2,), generator=g).tolist())
        region = ((r0[0], max(r0[1], r0[0] + 1)), (c0[0], max(c0[1], c0[0] + 1)))
        region = tuple((a, min(b, n)) for (a, b), n in zip(region, (37, 53)))
        if any(a >= b for a, b in region):
            continue
        assert torch.equal(node.read(region), whole[region[0][0]:region[0][1],
                                                    region[1][0]:region[1][1]])
    with pytest.raises(ValueError, match="needs scales of shape"):
        quantized.BlockDequant(node.weight, node.scale, (32, 8), "w")
