"""torchtitan 0.2.2's models beyond Llama 3 under its own tensor parallelism, with PyTorch's TP
and with tpx: does a training step at TP P (gloo, CPU) equal one device?

For Qwen 3 (dense, dense with the LM head tied to the embedding as its 0.6B-4B configs, and
MoE), Llama 4 (a dense and a MoE layer with a shared expert), DeepSeek-V3 (MoE, its MLA
attention with and without q LoRA, and a dense variant) and gpt-oss (MoE with biases, attention
sinks), tiny configs (dim 64, 2 layers, 8 heads, 4 experts, vocabulary 1003), float32, the
ranks build the same model from the same seed (``init_weights()`` under ``no_grad``, as
torchtitan calls it), keep a one-device copy and shard the other by the model's own TP
functions of ``torchtitan.models.<model>.infra.parallelize``, called as its ``parallelize_*``
entry calls them on a TP-only mesh (``DeviceMesh("cpu", [0..P-1], mesh_dim_names=("tp",))``;
``apply_non_moe_tp`` then ``apply_moe_ep_tp`` with no EP mesh; loss parallelism on or off as
``disable_loss_parallel`` would; sequence parallelism as torchtitan always applies it):

* ``torch``: torchtitan's code unchanged (``torch.distributed.tensor.parallel``);
* ``tpx``: the same code with only the ``torch.distributed.tensor.parallel`` names it imported
  (``parallelize_module``, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
  ``PrepareModuleInput``, ``PrepareModuleOutput`` where imported) swapped for tpx's, by
  ``unittest.mock.patch.multiple`` on each module whose functions the model's TP runs (its own
  ``parallelize`` module, and Llama 4's whose ``apply_moe_ep_tp`` Qwen 3 and DeepSeek-V3
  reuse); ``torch.distributed.tensor.parallel.loss_parallel`` (entered by torchtitan's
  ``get_train_context``) is tpx's. torchtitan's own styles (``NoParallel``, ``TensorParallel``
  of the experts, ``GptossTensorParallel``) and PyTorch's ``PrepareModuleInputOutput`` (tpx has
  none) stay as they are: ``tpx.parallelize_module`` applies them through PyTorch;
* ``tpx_experts`` (the MoE configurations whose experts are torchtitan's ``GroupedExperts``):
  as ``tpx``, and torchtitan's ``TensorParallel`` of the experts swapped for
  ``tpx.GroupedExpertsTensorParallel`` (its defaults: the same names ``w1`` / ``w3`` / ``w2``
  and the same ``Partial`` output).

Then two SGD steps (momentum 0.9) on the same batches with torchtitan's ``cross_entropy_loss``
inside its train context; each step's loss and every gradient, and every parameter after the
steps, are compared with the one-device model (``tests/harness.py``'s
``assert_like_unsharded`` criterion: a tpx-sharded parameter against this rank's block of the
full one, a PyTorch ``DTensor`` by its ``full_tensor()``; ``|a - b| <= 2e-5 + 1e-4 * |b|``,
the loss ``1e-5 + 1e-5 * |b|``). A case is ``pass``, ``wrong`` (it runs, a number differs: the
first tensor out of tolerance and its largest difference), ``refused`` (a ``ValueError`` /
``TypeError`` / ``NotImplementedError`` from tpx whose message starts with ``tpx``) or
``crash`` (any other exception, a hang or a dead rank: the exception's type and first line).

What torchtitan's CPU path cannot run is replaced alike for the one-device model and both
columns: the experts' for-loop (``use_grouped_mm=False``: ``torch._grouped_mm`` is CUDA's);
``torch.histc`` of the routers' integer expert indices (CPU's ``histc`` takes floats only)
through a float copy; gpt-oss's compiled FlexAttention (no backward on CPU) by the same
attention written out (mask of the ``BlockMask``'s ``mask_mod``, softmax, ``lse``), and its
bfloat16 blocks in float32; SDPA of head-sharded ``DTensor`` q / k / v (Qwen 3, DeepSeek-V3)
on each rank's heads, as DTensor's CUDA strategies compute it (CPU's SDPA kernels have none).
Where torchtitan's own MoE TP is wrong (pytorch/torchtitan#2387, scores applied after the
experts), the MoE configs use ``score_before_experts=True``; one row (``qwen3_moe sbe=False``)
keeps the default of torchtitan's Qwen 3 MoE configs to show that.

    python benchmarks/torchtitan_models.py [--tp 2] [--only qwen3,llama4] [--impls torch,tpx]

prints the table and writes ``benchmarks/results/torchtitan_models.json``
(``TORCHTITAN_TRACE=1``: each failure's traceback is printed by its rank as well; it is always
in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import (append_jsonl, environment, format_table, read_jsonl,  # noqa: E402
                    run_case_group, status_of_error, write_json)

STEPS = 2
IMPLS = ("torch", "tpx", "tpx_experts")
# the configurations whose experts torchtitan shards with its own TensorParallel (Llama 4's
# apply_moe_ep_tp): the ones the tpx_experts column runs
GROUPED_EXPERTS = ("qwen3_moe", "qwen3_moe sbe=False", "llama4", "deepseek_v3",
                   "deepseek_v3 q_lora", "deepseek_v3_dense")
TP_NAMES = ("parallelize_module", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
            "PrepareModuleInput", "PrepareModuleOutput")
# torchtitan's modules that import a dependency it does not install (tests/test_torchtitan.py)
OPTIONAL = [("torchtitan.models.moe.kernels", "triton"),
            ("torchtitan.components.metrics", "tensorboard"),
            ("torchtitan.hf_datasets.text_datasets", "datasets")]
PAR = "torchtitan.models.{}.infra.parallelize"


# ---------------------------------------------------------------- the models and their TP

def _moe(**kw):
    from torchtitan.models.moe import MoEArgs

    args = dict(num_experts=4, top_k=2, use_grouped_mm=False, score_before_experts=True)
    args.update(kw)
    return MoEArgs(**args)


def _qwen3(moe: bool, sbe: bool = True, tied: bool = False):
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    extra = {}
    if moe:  # as torchtitan's Qwen 3 MoE configs route (softmax, normalised, no shared expert)
        extra = dict(moe_enabled=True, moe_inter_dim=32,
                     moe_args=_moe(num_shared_experts=0, score_func="softmax", route_norm=True,
                                   score_before_experts=sbe))
    return Qwen3Model(Qwen3ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                                     hidden_dim=128, vocab_size=1003, max_seq_len=32,
                                     qk_norm=True, enable_weight_tying=tied, **extra))


def _llama4():
    from torchtitan.models.llama4.model.args import TransformerModelArgs
    from torchtitan.models.llama4.model.model import Transformer

    # interleave_moe_layer_step=2: layer 0 dense, layer 1 MoE (one shared expert, sigmoid)
    return Transformer(TransformerModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4,
                                            vocab_size=1003, multiple_of=16, max_seq_len=32,
                                            moe_args=_moe()))


def _deepseek(n_dense: int, q_lora_rank: int = 0):
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model

    args = DeepSeekV3ModelArgs(vocab_size=1003, dim=64, inter_dim=128, moe_inter_dim=32,
                               n_layers=2, n_dense_layers=n_dense, n_heads=8, max_seq_len=32,
                               moe_args=_moe(num_shared_experts=1, score_func="softmax"),
                               q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16)
    args.moe_impl = "standard"  # what update_from_config sets from the job config
    return DeepSeekV3Model(args)


def _gpt_oss():
    from torchtitan.models.gpt_oss.model.args import GptOssModelArgs
    from torchtitan.models.gpt_oss.model.model import GptOssModel

    model = GptOssModel(GptOssModelArgs(
        dim=64, n_layers=2, head_dim=8, n_heads=8, n_kv_heads=4, vocab_size=1003,
        max_seq_len=32, moe_inter_dim=32, sliding_window_size=8,
        moe_args=_moe(num_shared_experts=0, score_func="softmax", route_norm=True,
                      gate_bias=True)))
    return model.float()  # its blocks are built in bfloat16


def _tp_llama4_style(name: str, non_moe_kwargs: dict):
    """``parallelize_<name>``'s TP on a TP-only mesh: its ``apply_non_moe_tp`` then
    ``apply_moe_ep_tp`` (Llama 4's, which Qwen 3 and DeepSeek-V3 import) without EP."""

    def apply(model, mesh, loss_parallel: bool) -> None:
        par = importlib.import_module(PAR.format(name))
        par.apply_non_moe_tp(model, mesh, loss_parallel=loss_parallel,
                             enable_float8_tensorwise_tp=False, **non_moe_kwargs)
        extra = {"use_deepep": False} if name == "llama4" else {}
        par.apply_moe_ep_tp(model, tp_mesh=mesh, ep_mesh=None, etp_mesh=None,
                            ep_etp_mesh=None, dual_pipe_v=False, **extra)
    return apply


def _tp_gpt_oss(model, mesh, loss_parallel: bool) -> None:
    par = importlib.import_module(PAR.format("gpt_oss"))
    par.apply_non_moe_tp(model, mesh, loss_parallel=loss_parallel,
                         enable_float8_tensorwise_tp=False, enable_async_tp=False)
    par.apply_moe_ep_tp(model, tp_mesh=mesh, ep_mesh=None, ep_etp_mesh=None, etp_enabled=False,
                        dual_pipe_v=False)


# name: (build, apply TP, modules whose TP names the model's TP functions use)
MODELS = {
    "qwen3": (lambda: _qwen3(False),
              _tp_llama4_style("qwen3", dict(enable_async_tp=False, cp_enabled=False)),
              ["qwen3", "llama4"]),
    "qwen3 tied": (lambda: _qwen3(False, tied=True),
                   _tp_llama4_style("qwen3", dict(enable_async_tp=False, cp_enabled=False)),
                   ["qwen3", "llama4"]),
    "qwen3_moe": (lambda: _qwen3(True),
                  _tp_llama4_style("qwen3", dict(enable_async_tp=False, cp_enabled=False)),
                  ["qwen3", "llama4"]),
    "qwen3_moe sbe=False": (lambda: _qwen3(True, sbe=False),
                            _tp_llama4_style("qwen3", dict(enable_async_tp=False,
                                                           cp_enabled=False)),
                            ["qwen3", "llama4"]),
    "llama4": (_llama4, _tp_llama4_style("llama4", {}), ["llama4"]),
    "deepseek_v3": (lambda: _deepseek(1), _tp_llama4_style("deepseek_v3", dict(cp_enabled=False)),
                    ["deepseek_v3", "llama4"]),
    "deepseek_v3 q_lora": (lambda: _deepseek(1, q_lora_rank=32),
                           _tp_llama4_style("deepseek_v3", dict(cp_enabled=False)),
                           ["deepseek_v3", "llama4"]),
    "deepseek_v3_dense": (lambda: _deepseek(2),
                          _tp_llama4_style("deepseek_v3", dict(cp_enabled=False)),
                          ["deepseek_v3", "llama4"]),
    "gpt_oss": (_gpt_oss, _tp_gpt_oss, ["gpt_oss"]),
}
# (model, loss_parallel) rows; two variants only with loss parallelism
CONFIGS = [(m, lp) for m in MODELS for lp in (True, False)
           if not (lp is False and m in ("qwen3_moe sbe=False", "deepseek_v3 q_lora"))]


def config_name(model: str, loss_parallel: bool) -> str:
    return f"{model} loss_parallel={'on' if loss_parallel else 'off'}"


# ---------------------------------------------------------------- what the CPU cannot run

def _flex_math(q, k, v, *, score_mod=None, block_mask=None, scale=None, return_lse=False,
               enable_gqa=False):
    """FlexAttention written out (CPU has no FlexAttention backward): the ``BlockMask``'s
    ``mask_mod`` on the full grid, softmax, and the log-sum-exp gpt-oss' sinks read."""
    assert score_mod is None
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if block_mask is not None:
        qi = torch.arange(q.shape[-2]).view(-1, 1)
        ki = torch.arange(k.shape[-2]).view(1, -1)
        zero = torch.zeros((), dtype=torch.long)
        mask = block_mask.mask_mod(zero, zero, qi, ki)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return (out, lse) if return_lse else out


def _sdpa_dtensor_heads(forward):
    """SDPA of q / k / v that are ``DTensor``s sharded on the heads (Qwen 3's and DeepSeek-V3's
    ``use_local_output=False`` projections): DTensor's sharding strategy for the flash /
    efficient / cuDNN kernels (CUDA) computes each rank's heads; CPU's flash kernel has no
    strategy and the math kernel mixes a plain mask into DTensors. The same here: the local
    heads, the result a ``DTensor`` of the same placements. Anything else: torchtitan's."""

    def sdpa(self, q, k, v, **kwargs):
        from torch.distributed.tensor import DTensor

        ts = (q, k, v)
        if (all(isinstance(t, DTensor) for t in ts)
                and all(len(t.placements) == 1 and t.placements[0].is_shard(1) for t in ts)):
            out = forward(self, *(t.to_local() for t in ts), **kwargs)
            return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)
        return forward(self, q, k, v, **kwargs)
    return sdpa


def _stand_ins() -> None:
    """torchtitan importable without its optional dependencies (tests/test_torchtitan.py's
    stand-ins: a module whose every name raises when used)."""
    from test_torchtitan import _StandIn

    for module, needs in OPTIONAL:
        if importlib.util.find_spec(needs) is None and module not in sys.modules:
            sys.modules[module] = _StandIn(module, needs)


def _setup() -> None:
    """In each rank: torchtitan's stand-ins and its CPU replacements (alike for the
    one-device model and both columns)."""
    _stand_ins()
    histc = torch.histc

    def histc_any(x, bins=100, min=0, max=0):  # noqa: A002 - torch's names
        if x.is_floating_point():
            return histc(x, bins=bins, min=min, max=max)
        return histc(x.float(), bins=bins, min=min, max=max).to(x.dtype)
    torch.histc = histc_any

    from torch.nn.attention.flex_attention import create_block_mask

    import torchtitan.models.attention as attention

    attention.FlexAttentionWrapper._compiled_flex_attn = staticmethod(_flex_math)
    attention._compiled_create_block_mask = create_block_mask
    attention.ScaledDotProductAttentionWrapper.forward = _sdpa_dtensor_heads(
        attention.ScaledDotProductAttentionWrapper.forward)


# ---------------------------------------------------------------- one case

class _Wrong(Exception):
    pass


def _excess(a, b, rtol, atol):
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), float("inf")
    if not b.numel():
        return 0.0, 0.0
    diff = (a - b).abs()
    return float((diff - (atol + rtol * b.abs())).max()), float(diff.max())


def _compare(model, ref, what: str, grad: bool, worst: list, rtol=1e-4, atol=2e-5) -> None:
    """``harness.assert_like_unsharded``'s comparison (a tpx-sharded parameter against this
    rank's block, ``harness.local_vs``), a PyTorch ``DTensor`` by its ``full_tensor()``;
    raises ``_Wrong`` naming the first tensor out of tolerance; ``worst`` keeps the largest
    difference."""
    from harness import local_vs
    from torch.distributed.tensor import DTensor

    import tpx.checkpoint

    sharded = {sh.key: sh for sh in tpx.checkpoint.sharded_params(model)}
    ref_params = dict(ref.named_parameters())
    names = [k for k, _ in model.named_parameters()]
    if sorted(names) != sorted(ref_params):
        raise _Wrong(f"{what}: parameter names differ: {sorted(set(names) ^ set(ref_params))}")
    for key, p in model.named_parameters():
        expected, got = ref_params[key], p
        if grad:
            expected, got = expected.grad, p.grad
            if expected is None or got is None:
                if (expected is None) != (got is None):
                    raise _Wrong(f"{what}: gradient of {key}: unsharded "
                                 f"{'has one' if expected is not None else 'none'}, sharded "
                                 f"{'has one' if got is not None else 'none'}")
                continue
        if key in sharded:
            got = local_vs(got, expected)
            if tuple(got.shape) != tuple(expected.shape):
                expected = sharded[key].slice_of(expected)
        elif isinstance(got, DTensor):
            got = got.full_tensor()
        excess, diff = _excess(got, expected, rtol, atol)
        if diff > worst[0]:
            worst[:] = [diff, f"{what}: {'grad ' if grad else ''}{key}"]
        if excess > 0:
            shape = "" if tuple(got.shape) == tuple(expected.shape) else (
                f" (shape {tuple(got.shape)} vs {tuple(expected.shape)})")
            raise _Wrong(f"{what}: {'gradient of ' if grad else ''}{key}: largest difference "
                         f"{diff:.1e}{shape}")


def _case(model_name: str, loss_parallel: bool, impl: str, world: int) -> dict:
    import contextlib
    import copy
    from unittest import mock

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    import tpx
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.utils import get_train_context

    build, apply_tp, modules = MODELS[model_name]
    torch.manual_seed(0)
    ref = build()
    with torch.no_grad():
        ref.init_weights()
    model = copy.deepcopy(ref)
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("tp",))
    if impl in ("tpx", "tpx_experts"):
        with _tpx_names(modules, experts=impl == "tpx_experts"):
            apply_tp(model, mesh, loss_parallel)
    else:
        apply_tp(model, mesh, loss_parallel)
    if getattr(model, "enable_weight_tying", False):
        # torchtitan parallelizes a meta model, then its init_weights ties the LM head to the
        # (now sharded) embedding: that line, without re-initialising the values
        model.output.weight = model.tok_embeddings.weight
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
    gen = torch.Generator().manual_seed(1)
    worst = [0.0, ""]

    def lp_patch():  # torchtitan's train context enters loss_parallel(): tpx's in its place
        return (mock.patch("torch.distributed.tensor.parallel.loss_parallel", tpx.loss_parallel)
                if impl != "torch" else contextlib.nullcontext())
    for step in range(STEPS):
        tokens = torch.randint(0, 1003, (2, 16), generator=gen)
        labels = torch.randint(0, 1003, (2, 16), generator=gen)
        labels[0, :3] = -100  # torchtitan's IGNORE_INDEX
        kwargs = {}
        if getattr(ref.model_args, "attn_type", "sdpa") == "flex":
            kwargs["attention_masks"] = ref.get_attention_masks(tokens, None)
        ref_loss = cross_entropy_loss(ref(tokens, **kwargs), labels)
        ref_loss.backward()
        with lp_patch(), get_train_context(loss_parallel)():
            pred = model(tokens, **kwargs)
            loss = cross_entropy_loss(pred, labels)
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        excess, diff = _excess(loss, ref_loss, 1e-5, 1e-5)
        if excess > 0:
            raise _Wrong(f"loss at step {step}: {float(loss):.6g} vs {float(ref_loss):.6g}")
        _compare(model, ref, f"step {step}", True, worst)
        for opt, m in zip(opts, (ref, model)):
            opt.step()
            m.zero_grad()
    _compare(model, ref, f"after {STEPS} steps", False, worst)
    return dict(status="pass", detail=f"largest difference {worst[0]:.1e} ({worst[1]})",
                **_kinds(model))


def _kinds(model) -> dict:
    """How the sharded model holds its parameters: tpx-sharded, PyTorch ``DTensor``s, plain."""
    from torch.distributed.tensor import DTensor

    import tpx.checkpoint

    tpx_keys = {sh.key for sh in tpx.checkpoint.sharded_params(model)}
    params = dict(model.named_parameters())
    dt = [k for k, p in params.items() if k not in tpx_keys and isinstance(p, DTensor)]
    return dict(params_tpx_sharded=len(tpx_keys), params_dtensor=len(dt),
                params_plain=len(params) - len(tpx_keys) - len(dt))


def _tpx_names(modules, experts: bool = False):
    """``mock.patch.multiple`` of each module's TP names with tpx's; with ``experts``, also
    torchtitan's ``TensorParallel`` of the grouped experts with
    ``tpx.GroupedExpertsTensorParallel``."""
    import contextlib
    from unittest import mock

    import tpx

    stack = contextlib.ExitStack()
    for name in modules:
        mod = importlib.import_module(PAR.format(name))
        names = {n: getattr(tpx, n) for n in TP_NAMES if n in vars(mod)}
        if experts and "TensorParallel" in vars(mod):
            names["TensorParallel"] = tpx.GroupedExpertsTensorParallel
        stack.enter_context(mock.patch.multiple(mod, **names))
    return stack


def swapped_names() -> dict:
    """{module: the names swapped for tpx's} (recorded in the JSON)."""
    out = {}
    for name in sorted({m for _, _, mods in MODELS.values() for m in mods}):
        mod = importlib.import_module(PAR.format(name))
        out[PAR.format(name)] = [n for n in TP_NAMES if n in vars(mod)]
    return out


def _git_state() -> dict:
    """The commit of the tpx that ran and its files changed since (tpx is imported from the
    working tree)."""
    import subprocess

    def git(*a):
        r = subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True)
        return r.stdout.rstrip() if r.returncode == 0 else None
    changed = git("status", "--porcelain", "--", "python", "csrc") or ""
    return dict(commit=git("rev-parse", "HEAD"),
                changed=[x[3:] for x in changed.splitlines() if x.strip()])


def _key_frames(tb: str, keep: int = 40) -> str:
    lines = tb.rstrip().splitlines()
    return "\n".join(lines[-keep:])


# ---------------------------------------------------------------- ranks and the parent

def _rank(rank: int, world: int, cases, timeout: float, init: str, out_dir: str) -> None:
    import logging
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    _setup()
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    for i, (model_name, lp, impl) in enumerate(cases):
        t = time.perf_counter()
        failed = False
        try:
            r = _case(model_name, lp, impl, world)
        except _Wrong as e:
            r = dict(status="wrong", detail=str(e))
        except Exception as e:  # noqa: BLE001 - recorded
            failed = True
            line = (str(e).strip().splitlines() or [""])[0]
            r = dict(status=status_of_error(e), detail=f"{type(e).__name__}: {line}"[:300],
                     traceback=_key_frames(traceback.format_exc()))
            if os.environ.get("TORCHTITAN_TRACE"):
                traceback.print_exc()
        r.update(model=model_name, loss_parallel=lp, impl=impl, tp=world, rank=rank,
                 seconds=round(time.perf_counter() - t, 1), t=time.time())
        append_jsonl(path, r)  # case by case: a hang loses only its own case
        if failed:
            # The group may be out of step (a peer inside a collective): leave; the peers'
            # collectives fail on the closed connection and the parent starts a new group.
            os._exit(0)
        # every rank's record of this case before the next (no collective: a peer may have
        # failed and left)
        deadline = time.monotonic() + timeout
        while True:
            rows = [read_jsonl(os.path.join(out_dir, f"rank{r_}.jsonl")) for r_ in range(world)]
            if all(len(x) > i for x in rows):
                break
            if time.monotonic() > deadline:
                os._exit(0)
            time.sleep(0.005)
        if any(x[i]["status"] in ("crash", "refused") for x in rows):
            os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


_ORDER = {"crash": 0, "refused": 1, "wrong": 2, "pass": 3}


def _combine(records: list, world: int, case, timeout: float) -> dict:
    """One row of a case from its ranks' records: the worst status; among exceptions the
    first raised (a peer's later error is often the closed connection it left)."""
    model_name, lp, impl = case
    if not records:
        return dict(model=model_name, loss_parallel=lp, impl=impl, tp=world, status="crash",
                    detail=f"did not finish within {timeout:.0f} s on any rank (a hang or a "
                           "dead rank)")
    worst = min(records, key=lambda r: (_ORDER[r["status"]], r["t"]))
    row = {k: v for k, v in worst.items() if k not in ("t",)}
    row["ranks"] = {str(r["rank"]): r["status"] for r in records}
    missing = sorted(set(range(world)) - {r["rank"] for r in records})
    if missing:
        row["detail"] += f" (ranks {missing} did not finish: a hang or a dead rank)"
        if row["status"] in ("pass", "wrong"):
            row["status"] = "crash"
    return row


def run(cases, world: int, timeout: float) -> list:
    """Groups of ``world`` ranks run the cases in order; a case that fails or hangs ends its
    group (the case is recorded as the first rank's error, or as a hang), the cases after it
    run in a new group."""
    rows: list = []
    todo = list(cases)
    while todo:
        per_rank, codes = run_case_group(_rank, world, (todo, timeout), timeout, "tt_models_")
        done = max(len(x) for x in per_rank)
        got = []
        for i in range(min(done, len(todo))):
            recs = [x[i] for x in per_rank if len(x) > i]
            got.append(_combine(recs, world, todo[i], timeout))
            if got[-1]["status"] in ("crash", "refused"):
                break
        if len(got) < len(todo) and (not got or got[-1]["status"] not in ("crash", "refused")):
            m, lp, impl = todo[len(got)]
            got.append(dict(model=m, loss_parallel=lp, impl=impl, tp=world, status="crash",
                            detail=f"did not finish within {timeout:.0f} s (a hang or a dead "
                                   f"rank; exit codes {codes})"))
        for r in got:
            print(f"  {config_name(r['model'], r['loss_parallel']):<40} {r['impl']:<5} "
                  f"TP {world}: {r['status']:<7} {r['detail']}", flush=True)
        rows += got
        todo = todo[len(got):]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--only", default=None,
                        help="comma-separated substrings of the model names "
                             f"({', '.join(MODELS)})")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds a case may take before it counts as a hang")
    parser.add_argument("--out", default=str(HERE / "results" / "torchtitan_models.json"))
    args = parser.parse_args()
    if importlib.util.find_spec("torchtitan") is None:
        raise SystemExit("torchtitan is not installed (make test installs torchtitan 0.2.2)")
    impls = args.impls.split(",")
    only = args.only.split(",") if args.only else None
    configs = [(m, lp) for m, lp in CONFIGS if only is None or any(s in m for s in only)]
    if not configs:
        raise SystemExit(f"--only {args.only}: no model matches ({', '.join(MODELS)})")
    cases = [(m, lp, impl) for m, lp in configs for impl in impls
             if impl != "tpx_experts" or m in GROUPED_EXPERTS]
    print(f"TP {args.tp}: {len(configs)} configurations x {impls}", flush=True)
    rows = run(cases, args.tp, args.timeout)
    table = []
    for m, lp in configs:
        cells = [config_name(m, lp)]
        for impl in impls:
            cells.append(next((x["status"] for x in rows
                               if (x["model"], x["loss_parallel"], x["impl"]) == (m, lp, impl)),
                              "-"))
        table.append(cells)
    headers = ["model config"] + [{"torch": "PyTorch TP", "tpx": "tpx",
                                   "tpx_experts": "tpx + tpx experts"}.get(i, i) for i in impls]
    print(format_table(headers, table, text_columns=len(headers)))
    for impl in impls:
        mine = [r for r in rows if r["impl"] == impl]
        counts = {k: sum(r["status"] == k for r in mine) for k in ("pass", "wrong", "refused",
                                                                    "crash")}
        print(f"{impl} TP {args.tp}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    from importlib.metadata import version

    _stand_ins()
    payload = dict(
        command="python benchmarks/torchtitan_models.py " + " ".join(sys.argv[1:]),
        environment=environment(torch.device("cpu"), args.tp, "gloo"),
        torchtitan=version("torchtitan"), steps=STEPS, dtype="float32",
        optimizer="SGD(lr=0.05, momentum=0.9)", tolerance=dict(rtol=1e-4, atol=2e-5,
                                                               loss_rtol=1e-5, loss_atol=1e-5),
        tpx_source=_git_state(),
        tpx_names_swapped=swapped_names(),
        kept_pytorch=["PrepareModuleInputOutput (tpx has none; applied through PyTorch)",
                      "torchtitan's NoParallel, TensorParallel, GptossTensorParallel"],
        cpu_replacements=["MoEArgs.use_grouped_mm=False (for-loop experts)",
                          "torch.histc of integer expert indices through a float copy",
                          "SDPA of head-sharded DTensor q/k/v on the local heads, returned as "
                          "a DTensor (as DTensor's CUDA SDPA strategies; CPU's kernels have "
                          "none)",
                          "gpt-oss: FlexAttention written out (mask_mod, softmax, lse); its "
                          "bfloat16 blocks in float32"],
        results=rows)
    print("wrote", write_json(args.out, payload))


if __name__ == "__main__":
    main()
