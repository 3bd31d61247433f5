"""Quantized checkpoints read slice by slice and dequantized to the model's dtype.

The Hub's largest models ship their weights quantized; transformers reads them dequantized on
a machine that cannot compute in the quantized format (``dequantize=True``), and so does tpx,
with each rank reading only the quantized blocks its slice covers:

- **block FP8** (``quant_method: "fp8"``: DeepSeek-V3 / R1, Kimi K2, MiniMax-M2, Qwen3 ``-FP8``):
  ``weight`` in ``float8_e4m3fn`` and a ``weight_scale_inv`` holding one scale per block of
  ``weight_block_size`` (``[128, 128]``) of the last two dims, the grid rounded up where a size
  does not divide the block; the value is ``float(weight) * scale`` of its block. Scales in
  float32 / bf16, or ``uint8`` exponents (``ue8m0``: ``2 ** (byte - 127)``).
- **MXFP4** (``quant_method: "mxfp4"``: gpt-oss's experts): ``<name>_blocks`` (``uint8``,
  ``[..., rows, groups, 16]``: two 4-bit E2M1 values per byte, the low nibble first) and
  ``<name>_scales`` (``uint8`` exponents ``[..., rows, groups]``, ``2 ** (byte - 127)``) give
  ``<name>`` of shape ``[experts, groups * 32, rows]`` (the transpose transformers' dequantizer
  returns: gpt-oss's experts are stored ``[experts, in, out]``).

The product is taken in float32 and rounded once to the destination's dtype, as transformers'
dequantizers do for float32 and bf16 models. A checkpoint quantized by another method raises
:class:`ValueError` naming it before anything is read, and a float8 tensor of the files is
never cast to the model's dtype as it is: without its scales the load raises.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .lazy import Lazy, Region

__all__ = ["BlockDequant", "Mxfp4Dequant", "check_no_raw_float8", "check_quantization",
           "dequantized_sources", "quantization_of", "FLOAT8_DTYPES"]

FLOAT8_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))
    if d is not None)
READ_METHODS = ("fp8", "mxfp4")
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
             -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantization_of(config) -> Optional[dict]:
    """The ``quantization_config`` of a model's config as a dict (``None``: not quantized)."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def check_quantization(config, what: str) -> Optional[dict]:
    """The quantization of ``config`` when tpx reads it; ``ValueError`` naming the method
    otherwise."""
    q = quantization_of(config)
    if q is None:
        return None
    method = q.get("quant_method")
    if method not in READ_METHODS:
        raise ValueError(
            f"{what}: the checkpoint is quantized with quant_method={method!r}, which tpx does "
            f"not read (it reads {', '.join(READ_METHODS)}, dequantized to the dtype asked "
            "for). Dequantize it first (transformers' from_pretrained on one process, then "
            "save_pretrained), or use a release of the model in bf16 / fp16; nothing was loaded")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"{what}: quantization_config's weight_block_size must be two "
                             f"positive sizes; got {block!r}; nothing was loaded")
    return q


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _scales(src: Lazy, region: Region) -> Tensor:
    """Scales of the region's blocks, as float32 (``uint8`` ones are exponents)."""
    s = src.read(region, dtype=torch.uint8 if src.dtype == torch.uint8 else torch.float32)
    return (s.to(torch.float32) - 127.0).exp2() if s.dtype == torch.uint8 else s


class BlockDequant(Lazy):
    """``float(weight) * scale`` of its ``block`` of the last two dims (module docstring)."""

    def __init__(self, weight: Lazy, scale: Lazy, block: Optional[Sequence[int]], key: str) -> None:
        if weight.ndim < 2:
            raise ValueError(f"tpx: {key} is block-quantized but has {weight.ndim} dims")
        rows, cols = weight.shape[-2:]
        if block is None:  # the grid says it: per tensor, or sizes that divide it
            grid = tuple(scale.shape[-2:]) if scale.ndim >= 2 else (1, 1)
            if rows % grid[0] or cols % grid[1]:
                raise ValueError(f"tpx: {key} of shape {tuple(weight.shape)} has scales of "
                                 f"shape {tuple(scale.shape)} and the config names no "
                                 "weight_block_size: the blocks cannot be told")
            block = (rows // grid[0], cols // grid[1])
        self.block = (int(block[0]), int(block[1]))
        want = tuple(weight.shape[:-2]) + (_ceil(rows, self.block[0]), _ceil(cols, self.block[1]))
        self.per_tensor = scale.numel() == 1
        if not self.per_tensor and tuple(scale.shape) != want:
            raise ValueError(f"tpx: {key} of shape {tuple(weight.shape)} in blocks of "
                             f"{list(self.block)} needs scales of shape {want}; the files hold "
                             f"{tuple(scale.shape)}")
        self.weight, self.scale, self.key = weight, scale, key
        self.shape, self.dtype = weight.shape, torch.float32
        self.sliced = weight.sliced and scale.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        if any(e <= s for s, e in region):
            return
        w = self.weight.read(region, dtype=torch.float32)
        if self.per_tensor:
            s = _scales(self.scale, tuple((0, n) for n in self.scale.shape)).reshape(())
            out.copy_(w * s)
            return
        (r0, r1), (c0, c1) = region[-2:]
        (b0, b1) = self.block
        g0, g1 = r0 // b0, _ceil(r1, b0)
        h0, h1 = c0 // b1, _ceil(c1, b1)
        s = _scales(self.scale, tuple(region[:-2]) + ((g0, g1), (h0, h1)))
        s = s.repeat_interleave(b0, dim=-2).repeat_interleave(b1, dim=-1)
        s = s[..., r0 - g0 * b0:r1 - g0 * b0, c0 - h0 * b1:c1 - h0 * b1]
        out.copy_(w.mul_(s))

    def sources(self):
        return self.weight.sources() + self.scale.sources()


class Mxfp4Dequant(Lazy):
    """gpt-oss's MXFP4 experts (module docstring): ``blocks`` ``[E, R, G, 16]`` and ``scales``
    ``[E, R, G]`` read as the ``[E, G * 32, R]`` tensor they encode."""

    def __init__(self, blocks: Lazy, scales: Lazy, key: str) -> None:
        if blocks.ndim < 3 or tuple(blocks.shape[:-1]) != tuple(scales.shape) \
                or blocks.shape[-1] != 16 or blocks.dtype != torch.uint8 \
                or scales.dtype != torch.uint8:
            raise ValueError(f"tpx: {key}: MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) "
                             f"and scales {tuple(scales.shape)} ({scales.dtype}) are not "
                             "[..., rows, groups, 16] and [..., rows, groups] of uint8")
        *lead, rows, groups, _ = blocks.shape
        self.blocks, self.scales, self.key = blocks, scales, key
        self.shape = torch.Size(list(lead) + [groups * 32, rows])
        self.dtype = torch.float32
        self.sliced = blocks.sliced and scales.sliced

    def read_into(self, region: Region, out: Tensor) -> None:
        if any(e <= s for s, e in region):
            return
        lead, (c0, c1), (r0, r1) = region[:-2], region[-2], region[-1]
        g0, g1 = c0 // 32, _ceil(c1, 32)
        packed = self.blocks.read(tuple(lead) + ((r0, r1), (g0, g1), (0, 16)))
        exp = self.scales.read(tuple(lead) + ((r0, r1), (g0, g1))).to(torch.int32) - 127
        lut = torch.tensor(_FP4_E2M1, dtype=torch.float32)
        values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1)
        values = torch.ldexp(values.flatten(-2), exp.unsqueeze(-1))  # [..., R, G, 32]
        values = values.flatten(-2)[..., c0 - g0 * 32:c1 - g0 * 32]   # [..., R, C]
        out.copy_(values.transpose(-2, -1))

    def sources(self):
        return self.blocks.sources() + self.scales.sources()


def dequantized_sources(sources: List[Tuple[str, Lazy]], q: Optional[dict], what: str
                        ) -> List[Tuple[str, Lazy]]:
    """The files' ``(key, tensor)`` pairs with each quantized tensor and its scales replaced
    by one dequantizing tensor under the key of the weight it encodes."""
    if q is None:
        return sources
    by_key: Dict[str, Lazy] = dict(sources)
    used = set()
    out: List[Tuple[str, Lazy]] = []
    method = q.get("quant_method")
    for key, src in sources:
        if method == "fp8" and key.endswith("weight_scale_inv"):
            continue
        if method == "fp8" and src.dtype in FLOAT8_DTYPES:
            scale_key = key[:-len("weight")] + "weight_scale_inv" if key.endswith("weight") \
                else key + "_scale_inv"
            scale = by_key.get(scale_key)
            if scale is None:
                raise ValueError(f"{what}: {key} is stored in {src.dtype} and the files hold "
                                 f"no {scale_key} to dequantize it with; nothing was loaded")
            out.append((key, BlockDequant(src, scale, q.get("weight_block_size"), key)))
            used.add(scale_key)
        elif method == "mxfp4" and key.endswith("_scales") and key[:-7] + "_blocks" in by_key:
            continue
        elif method == "mxfp4" and key.endswith("_blocks"):
            scales = by_key.get(key[:-7] + "_scales")
            if scales is None:
                raise ValueError(f"{what}: {key} (MXFP4) has no {key[:-7]}_scales in the "
                                 "files; nothing was loaded")
            out.append((key[:-7], Mxfp4Dequant(src, scales, key[:-7])))
        elif key.endswith("activation_scale") or key.endswith("input_scale"):
            continue  # scales of quantized activations: a dequantized model has no use for them
        else:
            out.append((key, src))
    orphans = [k for k, _ in sources if k.endswith("weight_scale_inv") and k not in used]
    if method == "fp8" and orphans:
        raise ValueError(f"{what}: the files hold scales {orphans[:4]} whose weights are not "
                         "float8; nothing was loaded")
    return out


def check_no_raw_float8(lazy: Dict[str, Lazy], what: str) -> None:
    """A float8 tensor of the files that would reach the model without its scales raises."""
    raw = [k for k, t in lazy.items() if t.dtype in FLOAT8_DTYPES]
    if raw:
        src = lazy[raw[0]].sources()[0]
        raise ValueError(
            f"{what}: {raw[:4]} are stored in {src.dtype} ({src.key} in {src.file}) with no "
            "quantization_config that says how to dequantize them (block FP8 needs "
            "quant_method 'fp8' and a weight_scale_inv per weight); casting the raw values "
            "would give a different model. Nothing was loaded")
