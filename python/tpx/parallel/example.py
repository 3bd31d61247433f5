"""The batch a plan tpx derives is traced on and a plan it derives or completes is proved on.

``BATCH`` sequences of ``SEQ`` random token ids, the same on every rank (an odd length, so that
no size is mistaken for a head count), as keyword arguments the model takes; a decoder with
cross-attention also gets encoder states, and a vision-language model one tiny random image
per sequence before its tokens (:func:`image_inputs`), so that the trace and the proof run
its vision tower too.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from .hf_styles import text_config

__all__ = ["BATCH", "SEQ", "example_inputs", "image_inputs"]

BATCH, SEQ = 2, 7


def example_inputs(model: nn.Module) -> Dict[str, Tensor]:
    """The traced batch: ``BATCH`` x ``SEQ`` token ids (the same on every rank), as keyword
    arguments a Hugging Face model takes (``decoder_input_ids`` too for an encoder-decoder;
    for a vision-language model with values, an image per sequence before them: see
    :func:`image_inputs`), or ``{"input_ids": ids}`` for a plain module (passed
    positionally)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(text_config(model), "vocab_size", None) if cfg is not None else None
    if not vocab:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise ValueError(f"tpx.plans.derive: {type(model).__name__} has no nn.Embedding to "
                             "take token ids; pass example_inputs=")
        vocab = emb.num_embeddings
    p = next(model.parameters(), None)
    device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, min(int(vocab), 1000), (BATCH, SEQ), generator=gen).to(device)
    kwargs = {"input_ids": ids}
    if cfg is not None:
        if getattr(cfg, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = ids
        params = inspect.signature(model.forward).parameters
        if "use_cache" in params:
            kwargs["use_cache"] = False
        width = _cross_width(model)
        if width and "encoder_hidden_states" in params and "decoder_input_ids" not in kwargs:
            # a decoder with cross-attention (BART's as a causal LM): states of an encoder,
            # so that the trace runs, and the plan splits, the cross-attention too
            kwargs["encoder_hidden_states"] = torch.randn(
                BATCH, SEQ - 2, width, generator=gen).to(device, p.dtype)
        if p is not None and p.device.type != "meta":
            kwargs.update(image_inputs(model, ids, gen) or {})
    return kwargs


_CROSS = ("encoder_attn", "crossattention", "cross_attn")


def _cross_width(model: nn.Module) -> Optional[int]:
    """The width of the encoder states a decoder's cross-attention reads (the input
    features of its key projection), or ``None`` for a model without one."""
    for name, mod in model.named_modules():
        parts = name.split(".")
        if any(c in parts for c in _CROSS) and parts[-1] in ("k_proj", "key", "k") and (
                isinstance(mod, nn.Linear)):
            return mod.in_features
    return None




def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _image_size(vision) -> Optional[int]:
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)) and size:
        size = size[0]
    if isinstance(size, dict):
        size = size.get("height")
    return size if _is_int(size) else None


def _features_per_image(features, b: int) -> Optional[int]:
    """How many image tokens each of ``b`` images fills, from ``get_image_features``'s
    result (a tensor, a list of one tensor per image, or an output holding one)."""
    if not torch.is_tensor(features):
        pooled = getattr(features, "pooler_output", None)
        features = pooled if pooled is not None else getattr(features, "last_hidden_state",
                                                             features)
    if isinstance(features, (list, tuple)):
        if len(features) != b or not all(torch.is_tensor(x) for x in features):
            return None
        counts = {x.reshape(-1, x.shape[-1]).shape[0] for x in features}
        return counts.pop() if len(counts) == 1 else None
    if torch.is_tensor(features):
        return features.reshape(-1, features.shape[-1]).shape[0] // b
    return None


def image_inputs(model: nn.Module, ids: Tensor, generator: torch.Generator
                 ) -> Optional[Dict[str, Tensor]]:
    """Inputs with one random image per sequence for a vision-language ``model``: its
    ``get_image_features`` run on ``pixel_values`` of its vision config's size (4-D, else 5-D
    with one image per sample; with ``image_sizes`` where it takes them) tells how many image
    tokens each image fills, and that many ``image_token_id`` are put before ``ids``.
    ``None`` where the model has no such path or needs more than pixels (grids, crops)."""
    cfg = getattr(model, "config", None)
    token = next((getattr(cfg, k) for k in ("image_token_id", "image_token_index")
                  if _is_int(getattr(cfg, k, None))), None)
    vision, get = getattr(cfg, "vision_config", None), getattr(model, "get_image_features", None)
    size = _image_size(vision) if vision is not None else None
    p = next(model.parameters(), None)
    if size is None or p is None:
        return None
    b = ids.shape[0]
    pixels = torch.randn(b, getattr(vision, "num_channels", 3), size, size,
                         generator=generator).to(p.device, p.dtype)
    if token is None and get is None:
        return _prefix_image(model, ids, pixels)
    if token is None or get is None:
        return None
    extra = {}
    if "image_sizes" in inspect.signature(get).parameters:  # Mistral 3, Pixtral, LLaVA-NeXT
        extra["image_sizes"] = torch.tensor([[size, size]] * b, device=p.device)
    for pix in (pixels, pixels[:, None]):
        try:
            with torch.no_grad():
                n = _features_per_image(get(pixel_values=pix, **extra), b)
        except Exception:  # noqa: BLE001 - this model takes more than pixels, or other shapes
            continue
        if n is None:
            continue
        full = torch.cat([torch.full((b, n), token, dtype=ids.dtype, device=ids.device), ids], 1)
        return dict(pixel_values=pix, input_ids=full, **extra)
    return None


def _prefix_image(model: nn.Module, ids: Tensor, pixels: Tensor) -> Optional[Dict[str, Tensor]]:
    """``pixel_values`` beside ``ids`` for a model whose forward puts an image's features
    before the tokens itself (GIT: no image token), where a forward with them runs."""
    if "pixel_values" not in inspect.signature(model.forward).parameters:
        return None
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(input_ids=ids, pixel_values=pixels)
    except Exception:  # noqa: BLE001 - it takes more than pixels: no image
        return None
    finally:
        model.train(was)
    return dict(pixel_values=pixels, input_ids=ids)
