"""tpx under ``torch.autocast``: every operator follows the policy of its torch counterpart.

===============================================  =============================================
operator                                         under autocast (device type of the inputs)
===============================================  =============================================
``all_gather_matmul``, ``matmul_reduce_scatter``  floating inputs (activation, weight, bias)
``matmul_all_reduce``, ``replicated_matmul``,     cast to the autocast dtype, as ``aten::linear``
``local_matmul``, ``linear_2d``, ``linear_3d``    and ``aten::mm``: output in that dtype
``linear_cross_entropy``                          hidden, weight and bias cast to the autocast
                                                  dtype (the GEMM, as ``F.linear``); the loss is
                                                  fp32 (as ``F.cross_entropy``)
``vocab_parallel_cross_entropy``                  logits cast to float32 (autocast's fp32 list,
                                                  as ``F.cross_entropy``)
``vocab_parallel_embedding``, ``mesh_*``          untouched (as ``aten::embedding`` and the
                                                  collectives): output in the weight's dtype
``*_backward``                                    untouched: they see the dtypes the forward saw
===============================================  =============================================

Only floating tensors on the autocast device are cast, and never float64 (autocast's own
rule); ids and targets are never touched. The autocast dtype is read on every call
(``torch.get_autocast_dtype``), so ``float16`` and ``bfloat16`` both work.

The casts happen ABOVE autograd, as aten's own autocast does: autograd records them, so a
float32 parameter gets a float32 gradient. Two paths do it:

- the ``Autocast<Device>`` dispatch keys of every ``torch.ops.tpx`` operator above carry a
  kernel that casts and re-dispatches with autocast excluded: direct calls of
  ``torch.ops.tpx.*`` and ``torch.compile`` (AOT autograd traces the casts into the graph);
- the eager op wrappers (:mod:`tpx.ops`) run each differentiable operator through a
  ``torch.autograd.Function`` that calls it below autograd, where the kernel above would cast
  inside the Function (whose backward would then see mismatched dtypes). So the wrappers cast
  before ``Function.apply`` (:func:`eager_call`) and run it with autocast excluded, like the
  kernel's re-dispatch.

Layers (:mod:`tpx.nn`) accept an input whose dtype differs from their weights' when autocast
will cast both (:func:`autocast_casts`); the losses return float32 under autocast
(:func:`loss_dtype`); the multi-dimensional norms follow ``aten::layer_norm`` and
``aten::rms_norm`` (:func:`norm_input`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _ext  # noqa: F401  (loads the operator library)

__all__ = ["LOWER_PRECISION_OPS", "FP32_OPS", "autocast_casts", "eager_call", "loss_dtype",
           "norm_input"]

# Operators whose floating inputs are cast to the autocast dtype (GEMMs).
LOWER_PRECISION_OPS: Tuple[str, ...] = (
    "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "replicated_matmul",
    "local_matmul", "linear_cross_entropy", "linear_2d", "linear_3d")
# Operators whose floating inputs are cast to float32 (losses).
FP32_OPS: Tuple[str, ...] = ("vocab_parallel_cross_entropy",)

_POLICY = {**{op: "lower" for op in LOWER_PRECISION_OPS}, **{op: "fp32" for op in FP32_OPS}}
_DEVICE_TYPES = ("cpu", "cuda")


def _eligible(t: Tensor, device_type: str) -> bool:
    """Would autocast on ``device_type`` cast ``t``? (floating, on that device, not float64)"""
    return t.is_floating_point() and t.device.type == device_type and t.dtype != torch.float64


def _cast(args: tuple, device_type: str, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, Tensor) and _eligible(a, device_type)
                 and a.dtype != dtype else a for a in args)


def _target_dtype(policy: str, device_type: str) -> torch.dtype:
    return torch.get_autocast_dtype(device_type) if policy == "lower" else torch.float32


def _autocast_key(device_type: str):
    name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    return getattr(torch._C.DispatchKey, name)


_KEYSETS = {d: torch._C.DispatchKeySet(_autocast_key(d)) for d in _DEVICE_TYPES}


def _device_type(args: tuple) -> Optional[str]:
    for a in args:
        if isinstance(a, Tensor):
            return a.device.type
    return None


def eager_call(op: str, function, args: tuple):
    """``function.apply(*args)`` (the eager autograd of ``torch.ops.tpx.<op>``) under the
    autocast policy of ``op``: eligible inputs cast first (recorded by autograd), the Function
    then run with autocast excluded, as the dispatch-key kernel re-dispatches."""
    policy = _POLICY.get(op)
    device_type = _device_type(args)
    if (policy is None or device_type not in _KEYSETS
            or not torch.is_autocast_enabled(device_type)):
        return function.apply(*args)
    args = _cast(args, device_type, _target_dtype(policy, device_type))
    with torch._C._ExcludeDispatchKeyGuard(_KEYSETS[device_type]):
        return function.apply(*args)


def autocast_casts(x: Tensor, weight: Tensor) -> bool:
    """True when autocast is enabled for ``x``'s device type and will cast both ``x`` and
    ``weight`` (floating, not float64, on that device): a layer then accepts ``x`` whatever
    its dtype, as ``nn.Linear`` does under autocast."""
    device_type = x.device.type
    return (torch.is_autocast_enabled(device_type) and _eligible(x, device_type)
            and _eligible(weight, device_type))


def loss_dtype(x: Tensor) -> torch.dtype:
    """The dtype of a loss computed from ``x`` (logits, or the hidden states of a fused head):
    float32 under autocast when autocast would cast ``x`` (``F.cross_entropy`` is on its fp32
    list), ``x``'s dtype otherwise."""
    if torch.is_autocast_enabled(x.device.type) and _eligible(x, x.device.type):
        return torch.float32
    return x.dtype


def _fp32_norm_device_types() -> Tuple[str, ...]:
    """The device types whose autocast puts ``aten::layer_norm`` on its fp32 list (CUDA, not
    CPU, in current torch): the ones with an autocast kernel for it."""
    found = []
    for d in _DEVICE_TYPES:
        key = "Autocast" + torch._C._dispatch_key_for_device(d)
        if torch._C._dispatch_has_kernel_for_dispatch_key("aten::layer_norm", key):
            found.append(d)
    return tuple(found)


_FP32_NORM_DEVICE_TYPES = _fp32_norm_device_types()


def norm_input(x: Tensor) -> Tensor:
    """The input of a layer or RMS norm as torch's autocast hands it to ``aten::layer_norm``:
    cast to float32 where autocast lists the norms as fp32 (CUDA), unchanged elsewhere (on
    CPU the norm runs in the input's dtype)."""
    d = x.device.type
    if d in _FP32_NORM_DEVICE_TYPES and torch.is_autocast_enabled(d) and _eligible(x, d):
        return x.float()
    return x


# Dispatch-key kernels ---------------------------------------------------------------------------

_LIB = torch.library.Library("tpx", "IMPL")


def _register(op: str, policy: str) -> None:
    overload = getattr(torch.ops.tpx, op).default
    for device_type in _DEVICE_TYPES:
        if not torch.amp.is_autocast_available(device_type):
            continue
        key = _autocast_key(device_type)
        keyset = _KEYSETS[device_type]

        def kernel(*args, _device_type=device_type, _keyset=keyset, **kwargs):
            dtype = _target_dtype(policy, _device_type)
            args = _cast(args, _device_type, dtype)
            kwargs = dict(zip(kwargs, _cast(tuple(kwargs.values()), _device_type, dtype)))
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return overload(*args, **kwargs)

        # The Python dispatcher (tracing under torch.compile) reads py_kernels; the C++
        # dispatcher (eager calls of torch.ops.tpx.*) the library registration.
        overload.py_impl(key)(kernel)
        _LIB.impl(op, lambda _keys, *args, _kernel=kernel, **kwargs: _kernel(*args, **kwargs),
                  key.name, with_keyset=True)


for _op, _policy in _POLICY.items():
    _register(_op, _policy)
