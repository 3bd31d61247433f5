"""Quantized checkpoints in the Hub's layouts, written from an unsharded model for the tests:
block FP8 as DeepSeek-V3's files hold it (``weight`` in float8_e4m3fn, a float32
``weight_scale_inv`` per block, the grid rounded up) and MXFP4 as gpt-oss's experts
(``*_blocks`` / ``*_scales``); and the dequantization of those files written out plainly, the
reference a sharded load is compared with where transformers itself cannot read them."""

import json
import math
import os

import torch

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _set_quantization(path, config):
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)


def fp8_block(w: torch.Tensor, block):
    """``(float8 weight, float32 scales)`` of ``w`` ``[out, in]`` in blocks of ``block``."""
    o, i = w.shape
    b0, b1 = block
    so, si = math.ceil(o / b0), math.ceil(i / b1)
    pad = torch.zeros(so * b0, si * b1, dtype=torch.float32)
    pad[:o, :i] = w.float()
    blocks = pad.reshape(so, b0, si, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(so * b0, si * b1)[:o, :i]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """The float32 value of a block-FP8 weight, each element times its block's scale."""
    o, i = q.shape
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:o, :i]
    return q.float() * s


def fp8_files(model, block=(128, 128), dtype=torch.bfloat16):
    """``(file tensors, what they encode)``: ``model``'s projections (every ``*proj.weight``) in
    block FP8, the rest in ``dtype``; the encoded state dict in float32."""
    out, encoded = {}, {}
    for key, w in model.state_dict().items():
        if key.endswith("proj.weight") and w.dim() == 2:
            q, s = fp8_block(w, block)
            out[key], out[key[:-len("weight")] + "weight_scale_inv"] = q, s
            encoded[key] = fp8_dequant(q, s, block)
        else:
            out[key] = w.to(dtype).contiguous()
            encoded[key] = out[key].float()
    if getattr(model.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out, encoded


def write_fp8(model, path, block=(128, 128), dtype=torch.bfloat16):
    """``model`` saved as :func:`fp8_files` encodes it, config and all. Returns what the files
    encode."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    out, encoded = fp8_files(model, block, dtype)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(path, {"quant_method": "fp8", "fmt": "e4m3",
                             "activation_scheme": "dynamic", "weight_block_size": list(block)})
    return encoded


def mxfp4(w: torch.Tensor):
    """``(blocks, scales)`` of ``w`` ``[E, in, out]`` as gpt-oss stores its experts:
    ``[E, out, in / 32, 16]`` bytes and ``[E, out, in / 32]`` exponents."""
    t = w.float().transpose(1, 2)  # [E, out, in]
    e, r, c = t.shape
    groups = t.reshape(e, r, c // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    idx = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)  # nearest E2M1 value
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def mxfp4_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lo, hi = FP4[(blocks & 0x0F).long()], FP4[(blocks >> 4).long()]
    v = torch.stack([lo, hi], -1).flatten(-2) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return v.flatten(-2).transpose(1, 2)


def write_mxfp4(model, path):
    """A gpt-oss ``model`` saved as the Hub holds gpt-oss: experts' projections in MXFP4."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    out, encoded = {}, {}
    for key, w in model.state_dict().items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            b, s = mxfp4(w)
            out[key + "_blocks"], out[key + "_scales"] = b, s
            encoded[key] = mxfp4_dequant(b, s)
        else:
            out[key] = w.contiguous()
            encoded[key] = w
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _set_quantization(path, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]})
    return encoded
