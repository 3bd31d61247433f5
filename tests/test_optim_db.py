"""torch's own optimizer test inputs on a model tpx shards.

``torch.testing._internal.common_optimizers.optim_db`` lists, per optimizer, the inputs
PyTorch's optimizer tests run (``optim_inputs_func``: default, a non-default lr, a tensor lr,
weight decay, maximize, amsgrad, momentum, dampening, nesterov, ...). Every CPU input of
AdamW, Adam and SGD, in each implementation (the for-loop, ``foreach=True``,
``fused=True``), runs three steps on a Hugging Face Llama sharded by ``tpx.plans.auto``
(every parameter a ``DTensor``: ``Shard`` for the split layers, ``Replicate`` for the norms
the plan keeps whole) and on the same model on one device; every parameter is compared after
each step. Where the optimizer itself refuses an input on one device, the input does not
apply and is counted as such; the sharded model must run every input one device runs, but
fused SGD, for which torch's ``DTensor`` has no sharding rule (``aten._fused_sgd_``: it
refuses PyTorch's own TP parameters alike, before changing any).
"""

from __future__ import annotations

import copy

import pytest
import torch

from harness import run_ranks

transformers = pytest.importorskip("transformers")

OPTIMIZERS = ("AdamW", "Adam", "SGD")
IMPLS = ("for-loop", "foreach", "fused")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40,
                                   num_attention_heads=6, num_key_value_heads=6,
                                   num_hidden_layers=1, max_position_embeddings=16,
                                   attn_implementation="eager", tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg).double()


def _kwargs(inputs, impl: str) -> dict:
    kwargs = copy.deepcopy(inputs.kwargs)
    kwargs.pop("foreach", None)
    kwargs.pop("fused", None)
    if impl == "for-loop":
        kwargs["foreach"] = False
    else:
        kwargs[impl] = True
    return kwargs


def _steps(model, opt, ids, params, steps=3):
    """Three steps; each step's parameters (full tensors)."""
    out = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        out.append([p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                    for p in params])
    return out


def _restore(params, saved):
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None


def _optim_db_cases(rank, world):
    import tpx
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.common_optimizers import optim_db

    ref = _llama()
    sharded = tpx.parallelize_module(copy.deepcopy(ref), None, tpx.plans.auto(ref))
    ref_params = list(ref.parameters())
    params = list(sharded.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    ref_saved = [p.detach().clone() for p in ref_params]
    saved = [p.detach().clone() for p in params]
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(1))

    ran, not_applicable, failures, torch_limits = 0, [], [], []
    for info in optim_db:
        name = info.optim_cls.__name__
        if name not in OPTIMIZERS:
            continue
        for inputs in info.optim_inputs_func(device="cpu"):
            for impl in IMPLS:
                if impl != "for-loop" and impl not in info.supported_impls:
                    continue
                case = f"{name}({inputs.desc}, {impl})"
                _restore(ref_params, ref_saved)
                try:
                    expected = _steps(ref, info.optim_cls(ref_params, **_kwargs(inputs, impl)),
                                      ids, ref_params)
                except (RuntimeError, ValueError, TypeError) as e:
                    not_applicable.append(f"{case}: {str(e).splitlines()[0][:80]}")
                    continue
                _restore(params, saved)
                try:
                    got = _steps(sharded, info.optim_cls(params, **_kwargs(inputs, impl)), ids,
                                 params)
                    for step, (g, e) in enumerate(zip(got, expected)):
                        for p_got, p_exp in zip(g, e):
                            torch.testing.assert_close(p_got, p_exp, rtol=1e-9, atol=1e-11,
                                                       msg=lambda m: f"step {step}: {m}")
                    ran += 1
                except NotImplementedError as e:
                    if "_fused_sgd_" not in str(e):
                        raise
                    # torch's DTensor has no sharding rule for the fused SGD kernel: PyTorch's
                    # own TP parameters refuse it alike, before any parameter changes.
                    for p, s in zip(params, saved):
                        torch.testing.assert_close(p.full_tensor(), s.full_tensor(), rtol=0,
                                                   atol=0)
                    torch_limits.append(case)
                except Exception as e:  # noqa: BLE001 - every case reported below
                    failures.append(f"{case}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    assert not failures, "\n".join(failures)
    assert len(torch_limits) <= 9, torch_limits
    # Every CPU input of AdamW and Adam in all three implementations (30), of SGD in the
    # for-loop and foreach ones (18), and fused SGD wherever torch's DTensor runs it.
    assert ran + len(torch_limits) >= 57 and ran >= 48, (ran, not_applicable, torch_limits)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_optim_db_inputs_on_sharded_parameters(world):
    run_ranks(_optim_db_cases, world)
