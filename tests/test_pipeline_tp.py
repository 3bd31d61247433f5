"""Pipeline stages sharded by tpx: a tiny Hugging Face Llama cut into stages the ways people cut
them, each stage sharded by ``tpx.parallelize_module(stage, tp, tpx.plans.auto(stage, ...))``:

* ``"module"``: a stage module of the user's holding the layers it runs (and the embedding, the
  final norm, the LM head where it owns them, ``rotary_emb`` on every stage, the model's
  ``config``), whose forward takes token ids or hidden states;
* ``"deleted"``: torchtitan's cut of the model itself: what the stage does not own set to
  ``None``, the other stages' layers removed from ``model.model.layers``;
* ``"transformers"``: transformers' own ``apply_pipeline_parallelism`` (a
  ``PipelineIdentityLayer`` in the place of each piece another stage owns).

Every stage takes and returns whole hidden states on its TP group (sequence parallelism or
not), so ``PipelineStage`` sees the unsharded stage's shapes. Checked:

* PP 2 x TP 2 on 4 gloo ranks (a ("pp", "tp") mesh), torch.distributed.pipelining's
  ``ScheduleGPipe`` and ``Schedule1F1B`` over 2 microbatches, the stage shapes inferred or given
  (``input_args`` / ``output_args``), with and without sequence and loss parallelism, SGD and
  AdamW: the loss of every step and every parameter after the steps equal the same model
  trained on one device (a sequence of 7 positions: sequence parallelism pads it inside each
  stage);
* TP 2, three stages chained by hand on the same ranks (the middle one holds neither the
  embedding, the final norm nor the head): logits, loss and every parameter after an SGD
  step equal one device, for the Hugging Face Llama and the plain decoder in torchtitan's names.
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpx
import tpx.checkpoint
from harness import comm_counts, run_ranks

V, S = 96, 7  # vocabulary; sequence length (not a multiple of the TP size)
SHAPES = ("module", "deleted", "transformers")


def _config(layers):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=False,
                       attn_implementation="sdpa")


def _layer_range(stage, stages, layers):
    """The layers ``[start, end)`` of ``stage``: transformers' split (the first stages one more
    where they do not divide)."""
    per, extra = divmod(layers, stages)
    start = stage * per + min(stage, extra)
    return start, start + per + (stage < extra)


def _run_pieces(base, head, x):
    """A stage's forward over a Llama's pieces (``base``: ``embed_tokens``, ``layers``, ``norm``,
    ``rotary_emb``; each of the first three ``None`` or left out where the stage does not own
    it), as torchtitan's stages run: token ids or hidden states in, hidden states or logits
    out."""
    emb = getattr(base, "embed_tokens", None)
    h = emb(x) if emb is not None else x
    positions = torch.arange(h.shape[1]).unsqueeze(0)
    rope = base.rotary_emb(h, positions)
    for layer in base.layers:
        h = layer(h, position_embeddings=rope, position_ids=positions)
    if base.norm is not None:
        h = base.norm(h)
    return head(h) if head is not None else h


class LlamaStage(nn.Module):
    """Layers ``[start, end)`` of a ``LlamaForCausalLM`` as one pipeline stage, with its
    embedding on the first stage and its final norm and LM head on the last."""

    def __init__(self, model, start, end, first, last):
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[start:end])
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = model.model.rotary_emb

    def forward(self, x):
        return _run_pieces(self, self.lm_head, x)


class DeletedStage(nn.Module):
    """A ``LlamaForCausalLM`` cut as torchtitan cuts its models (what the stage does not own
    deleted), run as torchtitan's stages run."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return _run_pieces(self.model.model, self.model.lm_head, x)


class TransformersStage(nn.Module):
    """A ``LlamaForCausalLM`` cut by placeholders (transformers' ``PipelineIdentityLayer``),
    run through its own base model: token ids on the first stage, hidden states as
    ``inputs_embeds`` on the others."""

    def __init__(self, model, first):
        super().__init__()
        self.model, self.first = model, first

    def forward(self, x):
        base = self.model.model
        out = base(input_ids=x) if self.first else base(inputs_embeds=x)
        return self.model.lm_head(out.last_hidden_state)


def _cut(shape, model, stage, stages, pp_mesh=None):
    """``model`` (a ``LlamaForCausalLM``) cut to ``stage`` of ``stages``: (the module to shard,
    the stage module to run, the key in the whole model of each of its state-dict keys)."""
    from transformers.distributed.pipeline_parallel import (PipelineIdentityLayer,
                                                            apply_pipeline_parallelism)

    layers = model.config.num_hidden_layers
    start, end = _layer_range(stage, stages, layers)
    first, last = stage == 0, stage == stages - 1

    def offset(key, prefix):  # a layer's key, renumbered from `start`
        if key.startswith(prefix + "layers."):
            i, rest = key[len(prefix + "layers."):].split(".", 1)
            return f"model.layers.{int(i) + start}.{rest}"
        return key if prefix else ("model." + key if not key.startswith("lm_head") else key)

    if shape == "module":
        stage_module = LlamaStage(model, start, end, first, last)
        return stage_module, stage_module, lambda key: offset(key, "")
    if shape == "deleted":
        if not first:
            model.model.embed_tokens = None
        model.model.layers = nn.ModuleList(model.model.layers[start:end])
        if not last:
            model.model.norm = None
            model.lm_head = None
        return model, DeletedStage(model), lambda key: offset(key, "model.")
    if pp_mesh is not None:  # transformers' own cut
        apply_pipeline_parallelism(model, pp_mesh)
    else:  # the same, on stages that share ranks
        if not first:
            model.model.embed_tokens = PipelineIdentityLayer()
        if not last:
            model.model.norm = PipelineIdentityLayer()
            model.lm_head = PipelineIdentityLayer()
        for i in range(layers):
            if not start <= i < end:
                model.model.layers[i] = PipelineIdentityLayer()
    held = [i for i, m in enumerate(model.model.layers) if not isinstance(m, nn.Identity)]
    assert held == list(range(start, end)), (held, start, end)
    return model, TransformersStage(model, first), lambda key: key


def _loss_fn(lp, tp_group):
    def loss_fn(logits, labels):
        if not lp:
            return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))
        with tpx.loss_parallel(tp_group):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return loss_fn


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # Adam moves a weight by about lr whatever the size of its gradient, so a small gradient
    # summed in another order (microbatch by microbatch, over the TP ranks) moves it by a
    # step apart in proportion to lr: at lr 1e-2 and the default eps (1e-8), 2e-4 after 3
    # steps; at lr 1e-3 and eps 1e-5, within the 1e-5 the parameters are compared to
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def _assert_params_like(shard, to_full, ref, what, expected_keys):
    """Every parameter of the sharded stage, gathered, equals the one-device model's."""
    full = tpx.checkpoint.full_state_dict(shard)
    ref_state = ref.state_dict()
    keys = {to_full(k) for k in full}
    assert keys == set(expected_keys), (what, sorted(keys ^ set(expected_keys)))
    for key, value in full.items():
        torch.testing.assert_close(value, ref_state[to_full(key)], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


def _stage_keys(ref, stage, stages):
    start, end = _layer_range(stage, stages, ref.config.num_hidden_layers)
    keys = [k for k in ref.state_dict() if k.startswith("model.layers.")
            and start <= int(k.split(".")[2]) < end]
    if stage == 0:
        keys.append("model.embed_tokens.weight")
    if stage == stages - 1:
        keys += ["model.norm.weight", "lm_head.weight"]
    return keys


# ------------------------------------------------------------------ PP 2 x TP 2

def _pipeline_case(mesh, shape, schedule, sp, lp, layers, opt_name, static, steps=3):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from transformers import LlamaForCausalLM

    what = (f"PP 2 x TP 2 {shape} {schedule} sp={sp} lp={lp} layers={layers} {opt_name} "
            f"{'given' if static else 'inferred'} shapes")
    pp, tp = mesh["pp"].get_local_rank(), mesh["tp"]
    first, last = pp == 0, pp == 1
    torch.manual_seed(0)
    ref = LlamaForCausalLM(_config(layers))
    shard, run, to_full = _cut(shape, copy.deepcopy(ref), pp, 2, mesh["pp"])
    tpx.parallelize_module(shard, tp, tpx.plans.auto(shard, sequence_parallel=sp,
                                                     loss_parallel=lp))
    shapes = {}
    if static:  # the unsharded stage's shapes (the vocabulary this rank's, with lp); hidden
        # states that need a gradient, so that the stages exchange it in the backward
        mb, hidden = (torch.empty(2, S, 32, requires_grad=True) for _ in range(2))
        width = (lambda r: r[1] - r[0])(tpx.shard_range(V, tp.get_group())) if lp else V
        shapes = dict(input_args=torch.zeros(2, S, dtype=torch.long) if first else mb,
                      output_args=torch.empty(2, S, width) if last else hidden)
    stage = PipelineStage(run, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group(),
                          **shapes)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, n_microbatches=2, loss_fn=_loss_fn(lp, tp.get_group()))
    opt, ref_opt = _optimizer(opt_name, run.parameters()), _optimizer(opt_name, ref.parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, V, (4, S), generator=gen)
        labels = torch.randint(0, V, (4, S), generator=gen)
        ref_loss = F.cross_entropy(ref(input_ids=ids).logits.reshape(-1, V), labels.reshape(-1))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses = []
        if first:
            sched.step(ids)
        else:
            sched.step(target=labels, losses=losses)
        opt.step()
        opt.zero_grad()
        if last:  # the mean of the microbatches' losses: the batch's (equal microbatches)
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"{what}, step {step}: {m}")
    _assert_params_like(shard, to_full, ref, f"{what}, after {steps} steps",
                        _stage_keys(ref, pp, 2))


def _pipeline_like_one_device(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    for case in cases:
        _pipeline_case(mesh, *case)


def test_pipeline_1f1b_sequence_and_loss_parallel():
    """One stage module per stage, Schedule1F1B, sequence and loss parallelism, AdamW."""
    run_ranks(_pipeline_like_one_device, 4,
              [("module", "1f1b", True, True, 2, "adamw", False)], timeout=120)


# every shape under both schedules, with and without sequence parallelism; loss parallelism,
# the optimizer, the layer count (3: an uneven split) and given shapes varied along
_CASES = [(shape, schedule, sp, (i + j) % 2 == 1, (4, 3)[i % 2], ("sgd", "adamw")[j % 2],
           (i + j + sp) % 2 == 0)
          for i, shape in enumerate(SHAPES)
          for j, schedule in enumerate(("gpipe", "1f1b")) for sp in (False, True)]


@pytest.mark.slow
def test_pipeline_every_cut_and_schedule():
    run_ranks(_pipeline_like_one_device, 4, _CASES, timeout=600)


# ------------------------------------------------------------------ three stages by hand

def _chained_llama(shape, sp, lp):
    """Three stages of a 3-layer Llama at TP 2 on the same ranks, chained by hand."""
    from transformers import LlamaForCausalLM

    what = f"TP 2, 3 stages by hand, {shape} sp={sp} lp={lp}"
    torch.manual_seed(0)
    ref = LlamaForCausalLM(_config(3))
    stages = [_cut(shape, copy.deepcopy(ref), i, 3) for i in range(3)]
    for shard, _, _ in stages:
        tpx.parallelize_module(shard, None, tpx.plans.auto(shard, sequence_parallel=sp,
                                                           loss_parallel=lp))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, S), generator=gen)
    labels = torch.randint(0, V, (2, S), generator=gen)
    x = ids
    for i, (_, run, _) in enumerate(stages):
        with tpx.comm_stats() as stats:
            x = run(x)
        if i == 1:  # whole hidden states in and out; sequence parallel inside
            expected = {"all_gather": 3, "reduce_scatter": 2} if sp else {"all_reduce": 2}
            assert comm_counts(stats) == expected, (what, comm_counts(stats))
    ref_logits = ref(input_ids=ids).logits
    start, end = tpx.shard_range(V) if lp else (0, V)
    torch.testing.assert_close(x, ref_logits[..., start:end], rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: logits: {m}")
    loss = _loss_fn(lp, None)(x, labels)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, V), labels.reshape(-1))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: loss: {m}")
    loss.backward()
    ref_loss.backward()
    for m in [ref] + [run for _, run, _ in stages]:
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    for i, (shard, _, to_full) in enumerate(stages):
        _assert_params_like(shard, to_full, ref, f"{what}, stage {i} after a step",
                            _stage_keys(ref, i, 3))


def _chained_decoder(sp):
    """The plain decoder (torchtitan's names) cut as torchtitan cuts it, three stages of one
    layer each; under sequence parallelism a stage splits in equal blocks only."""
    from tiny_llama import Decoder

    what = f"TP 2, plain decoder, 3 stages by hand, sp={sp}"
    torch.manual_seed(0)
    ref = Decoder(vocab=V, n_layers=3)
    stages = []
    for i in range(3):
        m = copy.deepcopy(ref)
        if i:
            m.tok_embeddings = None
        m.layers = nn.ModuleList([m.layers[i]])
        if i < 2:
            m.norm = m.output = None
        tpx.parallelize_module(m, None, tpx.plans.auto(m, sequence_parallel=sp))
        stages.append(m)

    def run(m, x):
        h = m.tok_embeddings(x) if m.tok_embeddings is not None else x
        for layer in m.layers:
            h = layer(h)
        return m.output(m.norm(h)) if m.output is not None else h

    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    x = ids
    for m in stages:
        x = run(m, x)
    ref_logits = ref(ids)
    torch.testing.assert_close(x, ref_logits, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: logits: {m}")
    x.square().mean().backward()
    ref_logits.square().mean().backward()
    for m in [ref] + stages:
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    ref_state = ref.state_dict()
    for i, m in enumerate(stages):
        for key, value in tpx.checkpoint.full_state_dict(m).items():
            full_key = key.replace("layers.0.", f"layers.{i}.")
            torch.testing.assert_close(value, ref_state[full_key], rtol=1e-5, atol=1e-5,
                                       msg=lambda msg, key=key: f"{what}: stage {i}: {key}: {msg}")
    if sp:
        with pytest.raises(ValueError, match="does not split into 2 equal blocks"):
            run(stages[1], torch.randn(2, 7, 32))


def _stages_by_hand(rank, world):
    for shape, sp in itertools.product(SHAPES, (False, True)):
        _chained_llama(shape, sp, lp=sp)
    for sp in (False, True):
        _chained_decoder(sp)


def test_stages_by_hand_tp2():
    run_ranks(_stages_by_hand, 2, timeout=120)
