"""Tiny random Hugging Face causal LMs for every architecture that ships a tensor-parallel plan.

``zoo_types()`` lists the ``AutoModelForCausalLM`` model types whose default config builds and
has a non-empty ``base_model_tp_plan``. ``tiny_config(mt)`` starts from that default config and
shrinks it with generic rules keyed on field names and values; ``tiny(mt)`` builds the model
in float32 (random weights, nothing downloaded, no seed set).

Rules (a field is only touched when the default config has it; only changed fields are passed
back to the config class, so whatever it derives in ``__post_init__`` is derived again):

* sizes (``FIXED``, or ``AT_MOST`` where ``None``, 0 and already small counts are kept):
  hidden 64, MLP 88, MoE / shared-expert MLP 40, vocabulary 1003 (divisible by neither 2 nor
  4), 64 positions, sliding windows, chunks and blocks 8; linear-attention, Mamba, indexer and
  low-rank fields shrink alike, with Mamba heads * head dim = expand * hidden.
* attention: 8 query heads of dim 8; multi-head attention becomes GQA with 2 KV heads (fewer
  stays fewer), except MLA (``kv_lora_rank``), whose latent is expanded to every query head, so
  KV heads = query heads = 8; MLA ranks kv 16 / q 24, nope 8 + rope 4 = qk 12, v 8, and
  ``head_dim`` keeps its ratio to the rotary part (usually it *is* the rotary part).
* experts: 4 routed experts, 2 per token (1 stays 1), at most 1 shared expert, at most 2 groups.
* layers: every per-layer description (lists as long as the layer count, lists of layer indices,
  ``per_layer_config``, "the first k layers are dense", "the last k layers share KV", period and
  offset, MoE start / end / interval) gives each default layer a kind; the tiny model keeps the
  first layer of each kind, in order, and at least 2 layers, and every description is rewritten
  for the kept layers (per-layer overrides scaled like the field they override). Where every
  layer is MoE but the MLP has a dense form (``mlp_only_layers``, ``mlp_layer_types``), the
  first layer is made dense so that the plan's dense-MLP entries are exercised too.
* no dropout or jitter noise, no KV cache (``use_cache=False``), out-of-vocabulary pad / bos /
  eos ids become 0 / 1 / 2 (the random inputs are 3..1002) and other special ids wrap into the
  vocabulary, eager attention and experts (float64 runs: grouped GEMM does not take it),
  ``tie_word_embeddings`` as in the default config; sub-configs are shrunk the same way.
* ``TYPES`` holds the few per-type settings no rule can guess (default layouts without an
  attention layer, unset experts or indexers, loops); ``**overrides`` are applied last (a new
  layer count needs its per-layer lists overridden with it).

``python tests/hf_tiny.py [type ...]`` builds each model and runs forward and backward in
float32 and in float64, one line per type, then the counts.
"""

import sys
import time
import warnings

import torch
import transformers

from tpx.parallel.twin import V, shrunk_fields as _tiny_fields  # noqa: F401  (the rules)

MAX_PARAMS = 150_000_000  # a tiny model larger than this is refused before it is built

def zoo_types() -> list[str]:
    """Causal-LM model types whose default config builds and carries a tensor-parallel plan."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = []
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cfg = transformers.AutoConfig.for_model(mt)
        except Exception:
            continue
        if getattr(cfg, "base_model_tp_plan", None):
            out.append(mt)
    return out


def _has_plan(mt: str) -> bool:
    """Whether model type ``mt``'s default config, or its text part, carries a TP plan."""
    try:
        cfg = transformers.AutoConfig.for_model(mt)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    except Exception:  # noqa: BLE001 - no config, or several text parts: none to read
        return False
    return bool(getattr(cfg, "base_model_tp_plan", None)
                or getattr(text, "base_model_tp_plan", None))


def no_plan_types() -> list[str]:
    """Causal-LM model types of the installed transformers whose config carries no
    tensor-parallel plan, nor its text part (``tpx.plans.auto`` derives one for them)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    with_plan = set(zoo_types())
    return [mt for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
            if mt not in with_plan and not _has_plan(mt)]


def no_tp_plan(mt: str):
    """Why the installed transformers gives tpx no plan to read for model type ``mt`` (it lacks
    the type, or its config carries no ``base_model_tp_plan``), or ``None``. Older releases
    (5.18, the newest whose models import on torch 2.5) lack some types and plans of later
    ones; ``tpx.plans.auto`` refuses such a model with an error that says so."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if mt not in CONFIG_MAPPING:
        return f"transformers {transformers.__version__} has no model type {mt!r}"
    cfg = transformers.AutoConfig.for_model(mt)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not (getattr(cfg, "base_model_tp_plan", None)
            or getattr(text, "base_model_tp_plan", None)):
        return f"transformers {transformers.__version__} ships no TP plan for {mt!r}"
    return None


def tiny_config(mt: str, **overrides):
    """A tiny config of model type ``mt`` (see the module docstring for the rules)."""
    cfg = transformers.AutoConfig.for_model(mt)
    c = _tiny_fields(cfg)
    c.update(overrides)
    cfg = transformers.AutoConfig.for_model(mt, **c)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def tiny(mt: str, **overrides):
    """A tiny randomly initialised float32 model of type ``mt`` (seed left alone): the causal
    LM, or for :func:`multimodal_types` the generative class of :func:`auto_class`."""
    cls, cfg = auto_class(mt), tiny_config(mt, **overrides)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls.from_config(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config of {mt!r} still has {n:,d} parameters (more than "
                         f"{MAX_PARAMS:,d}): a part the rules do not shrink")
    return cls.from_config(cfg).float()


def _generative_mappings():
    from transformers.models.auto import modeling_auto as ma
    return [(ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AutoModelForCausalLM"),
            (ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "AutoModelForImageTextToText"),
            (ma.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, "AutoModelForMultimodalLM"),
            (ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "AutoModelForSeq2SeqLM"),
            (ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, "AutoModelForSpeechSeq2Seq")]


def auto_class(mt: str):
    """transformers' auto class that builds the generative model of type ``mt``: the causal
    LM where there is one, else image-text-to-text, multimodal LM, seq2seq LM or speech
    seq2seq, in that order."""
    for mapping, name in _generative_mappings():
        if mt in mapping and hasattr(transformers, name):
            return getattr(transformers, name)
    raise ValueError(f"no generative auto class of transformers {transformers.__version__} "
                     f"builds model type {mt!r}")


def multimodal_types() -> list[str]:
    """The generative model types with a tensor-parallel plan beyond :func:`zoo_types`: those
    that are not causal LMs (image / video / audio to text, multimodal LMs, seq2seq and speech
    seq2seq) and the causal LMs whose plan is in their config's text part only (Gemma 3 and 4,
    Qwen3.5: built as transformers' causal-LM class builds them, towers included)."""
    causal = set(_generative_mappings()[0][0])
    zoo = set(zoo_types())
    out = {mt for mt in causal if mt not in zoo and _has_plan(mt)}
    for mapping, name in _generative_mappings()[1:]:
        if hasattr(transformers, name):
            out.update(mt for mt in mapping if mt not in causal and _has_plan(mt))
    return sorted(out)


def image_batch(model, ids: torch.Tensor, generator: torch.Generator) -> "dict | None":
    """Inputs with one tiny random image per sequence for a vision-language ``model``
    (:func:`tpx.parallel.example.image_inputs`: as many image tokens before ``ids`` as an
    image fills), their labels ``-100`` on the image tokens; ``None`` where the model has no
    such path."""
    from tpx.parallel.example import image_inputs

    batch = image_inputs(model, ids, generator)
    if batch is None:
        return None
    labels = batch["input_ids"].clone()
    labels[:, :labels.shape[1] - ids.shape[1]] = -100
    return dict(batch, labels=labels)


def check(mt: str) -> int:
    """Build ``mt``, run forward and backward in float32 and in float64; the parameter count."""
    stage = "build"
    try:
        model = tiny(mt)
        ids = torch.randint(3, V, (2, 16))
        for stage, convert in (("float32", model.float), ("float64", model.double)):
            convert()
            model.zero_grad()
            out = model(input_ids=ids, labels=ids)
            if not torch.isfinite(out.logits).all():
                raise FloatingPointError("non-finite logits")
            out.loss.backward()
    except Exception as e:
        line = (str(e).strip().splitlines() or [""])[0][:140]
        raise RuntimeError(f"{stage}: {type(e).__name__}: {line}") from e
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    types = sys.argv[1:] or zoo_types()
    counts, start = [], time.perf_counter()
    for mt in types:
        t = time.perf_counter()
        try:
            counts.append(check(mt))
            result = f"{counts[-1]:9,d} {time.perf_counter() - t:6.2f}s OK"
        except RuntimeError as e:
            result = f"{'':9s} {time.perf_counter() - t:6.2f}s {e}"
        print(f"{mt:24s} {result}", flush=True)
    span = f", {min(counts):,d} to {max(counts):,d} parameters" if counts else ""
    print(f"{len(counts)}/{len(types)} OK, {len(types) - len(counts)} failed{span}, "
          f"{time.perf_counter() - start:.1f}s")


def written_and_loaded(mt: str, path: str):
    """``(ref, model)``: the tiny ``mt`` drawn from seed 0 on every rank, written by rank 0
    with transformers' ``save_pretrained`` and read back by ``tpx.from_pretrained`` at
    float32 over the default group (built on the meta device, so a plan tpx completes or
    derives is proved on the model's twin). Collective."""
    import copy

    import torch.distributed as dist

    import tpx

    torch.manual_seed(0)
    ref = tiny(mt)
    if dist.get_rank() == 0:
        ref.save_pretrained(path)
    dist.barrier()
    model = tpx.from_pretrained(path, dtype=torch.float32, config=copy.deepcopy(ref.config),
                                model_class=auto_class(mt))
    return ref, model
