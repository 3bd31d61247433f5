"""What every tpx operator shares: the eager call path (an autograd Function per operator,
or the operator itself where no gradient is wanted), the registration of an operator's
autograd (:func:`register`; under activation checkpointing, the two nodes of
:func:`register_saved_first`), and the checks that resolve a group and, with
``TPX_DEBUG_CHECKS=1``, compare the arguments that shape a collective across ranks."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..comm.guard import guarded
from ..comm.owned import own, own_by_name
from ..comm.agree import check_same_on_ranks
from ..comm.groups import GroupLike, resolve_group
from . import amp

# Eager calls of the differentiable operators go through a plain ``torch.autograd.Function``
# per operator, registered here by :func:`register` with the same
# forward and backward as the operator's own autograd registration. The operator is then
# called below the autograd dispatch key, which skips the generic per-call work of
# ``torch.library``'s autograd kernel (about 40 us a call on a CPU). ``torch.compile`` and
# direct ``torch.ops.tpx.*`` calls use the operator's registration: one graph node per op.
# Under torch.autocast the eager path casts before the Function (tpx.ops.amp.eager_call), where
# the operator's own Autocast kernel would cast inside it.
_EAGER_FUNCTIONS: dict = {}
_SETUP: dict = {}  # op -> the setup_context its autograd was registered with
# Operators whose autograd saves only their inputs and whose forward ends in a collective:
# under saved-tensor hooks their eager path is two autograd nodes (register_saved_first).
_SAVED_FIRST: dict = {}


def register_eager_function(op: str, function: type) -> None:
    """Makes ``function.apply(*args)`` the eager path of ``torch.ops.tpx.<op>(*args)``
    (``function.operator``, the operator's overload, is called directly, below autograd, where
    no input needs a gradient)."""
    _EAGER_FUNCTIONS[op] = function


def call(op: str, *args):
    function = _EAGER_FUNCTIONS.get(op)
    if function is None or torch.compiler.is_compiling():
        return getattr(torch.ops.tpx, op)(*args)
    if op in _SAVED_FIRST and saving_hooks():
        function = _SAVED_FIRST[op]  # (see register_saved_first)
    if torch._C._is_any_autocast_enabled():
        # Cast above the Function, so autograd records the casts (tpx.ops.amp).
        return amp.eager_call(op, function, args)
    if not (torch.is_grad_enabled() and any_requires_grad(args)):
        # No gradient is wanted: the operator itself, with no autograd node to build.
        with torch._C._AutoDispatchBelowAutograd():
            return function.operator(*args)
    return function.apply(*args)


def call_on_params(op: str, args: tuple, transposed: tuple = ()):
    """``call(op, *args)`` where some of ``args`` are ``DTensor`` parameters: the operator
    computes on their local tensors (a transposed view at the positions in ``transposed``)
    and, where autograd records, ONE Function takes the parameters themselves and hands
    their gradients back as ``DTensor`` s of their placements (the layer's own local views
    and the operator's Function would be two autograd nodes). Elsewhere (no gradient wanted,
    ``torch.compile``, ``torch.autocast``) it is ``call`` on the local tensors, with the
    parameters' gradients reaching them through ``tpx.layout.param_dtensors.local_params``."""
    DTensor = _dtensor_class()
    function = _EAGER_FUNCTIONS.get(op)
    if (function is None or torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or torch._C._is_any_autocast_enabled() or not any_requires_grad(args)):
        # DTensor's own to_local: differentiable wherever autograd (or the compiler) records
        local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
        for i in transposed:
            local[i] = local[i].t()
        return call(op, *local)
    if op in _SAVED_FIRST and saving_hooks():
        return _SAVED_FIRST[op].apply_on_params(args, transposed)
    return on_params_function(op, transposed).apply(*args)


PLAIN, ON_PARAMS = 1, 2


def lean_mode(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> int:
    """How a layer's forward may call its operator's kernel directly (``tpx._C.direct``, no
    dispatcher), skipping the general checks of the op wrappers (the layer checked its group
    and arguments when it was built):

    * :data:`PLAIN`: no gradient is wanted (grad mode off, or nothing requires one): the
      kernel alone, nothing recorded (:func:`tpx.ops.matmul.plain_linear`);
    * :data:`ON_PARAMS`: autograd records and ``weight`` is a ``DTensor``: one autograd node
      that takes the parameters themselves (:func:`tpx.ops.matmul.linear_on_params`);
    * ``0``: the op wrappers' general path, through ``torch.ops.tpx`` (autocast,
      ``torch.compile``, ``torch.jit.trace``, ``TPX_DEBUG_CHECKS``, a dispatch or
      ``__torch_function__`` mode, a functorch transform, a device other than CPU or CUDA, a
      layout other than strided, tensor subclasses as local tensors, plain-tensor parameters
      that need a gradient).
    """
    if (torch._C._is_any_autocast_enabled() or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() is not None
            or not (x.is_cpu or x.is_cuda) or x.layout is not torch.strided
            or config.debug_checks()):
        return 0
    DTensor = _dtensor_class()
    on_params = isinstance(weight, DTensor)
    bias_dtensor = isinstance(bias, DTensor)
    if (type(weight._local_tensor if on_params else weight) not in _PLAIN_TYPES
            or (bias is not None and type(bias._local_tensor if bias_dtensor else bias)
                not in _PLAIN_TYPES)):
        return 0
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)):
        return PLAIN
    return ON_PARAMS if on_params and (bias is None or bias_dtensor) else 0


# Tensors the kernels take as they are (a tensor subclass goes through the dispatcher).
_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def on_params_function(op: str, transposed: tuple = (), function: Optional[type] = None) -> type:
    """The autograd Function of :func:`call_on_params` for ``op`` (over ``function``, by
    default the operator's eager Function), made once."""
    function = function or _EAGER_FUNCTIONS[op]
    key = (op, transposed, function)
    merged = _ON_PARAMS.get(key)
    if merged is None:
        merged = _ON_PARAMS[key] = _on_params_function(op, function, transposed)
    return merged


def plain_group_name(pg) -> str:
    """The name a lean call hands the operator for ``pg`` (a group a layer resolved when it was
    built): tpx's own copy is made on first use, as :func:`group_name` does."""
    own(pg)
    return pg.group_name


def params_path(*params) -> bool:
    """Whether a layer hands its ``DTensor`` parameters to the operator itself
    (:func:`call_on_params`: where autograd records in eager mode, a parameter needs a
    gradient); otherwise it takes their local tensors (``tpx.layout.param_dtensors.local_params``)."""
    return (torch.is_grad_enabled() and isinstance(params[0], _dtensor_class())
            and any_requires_grad(params) and not torch.compiler.is_compiling()
            and not torch._C._is_any_autocast_enabled())


_ON_PARAMS: dict = {}


def _on_params_function(op: str, function: type, transposed: tuple) -> type:
    """The Function of :func:`call_on_params` for ``op`` (its eager Function ``function``),
    its arguments in the operator's order, so that ``ctx.needs_input_grad`` lines up."""
    DTensor = _dtensor_class()

    def forward(ctx, *args):
        params = {}
        local = list(args)
        for i, a in enumerate(args):
            if isinstance(a, DTensor):
                params[i] = a._spec
                local[i] = a._local_tensor
        for i in transposed:
            local[i] = local[i].t()
        ctx.param_specs = params
        out = function.forward(ctx, *local)
        # The operators are products of the input (first) and a parameter: a saved parameter
        # is read for the input's gradient only, as autograd saves nn.Linear's weight then.
        saved = getattr(ctx, "to_save", ())
        ctx.watched = tuple((args[i], args[i]._version) for i in params
                            if ctx.needs_input_grad[0] and any(local[i] is t for t in saved))
        return out

    def backward(ctx, *grads):
        check_watched(ctx.watched)
        out = list(function.backward(ctx, *grads))
        for i in transposed:
            if out[i] is not None:
                out[i] = out[i].t()
        for i, spec in ctx.param_specs.items():
            if out[i] is not None:
                out[i] = dtensor_of(out[i].contiguous(), spec)
        return tuple(out)

    return type(f"{op}_on_params_function", (torch.autograd.Function,), dict(
        forward=staticmethod(forward), backward=staticmethod(backward), __module__="tpx.ops",
        __doc__=f"``torch.ops.tpx.{op}`` on DTensor parameters (see :func:`call_on_params`)."))


def check_watched(watched) -> None:
    """Raises, as autograd does for a saved tensor, when a ``DTensor`` parameter whose local
    tensor the backward reads was modified in place after the forward (``watched``:
    (parameter, its ``_version`` then) pairs). ``DTensor``'s in-place ops do not bump the
    version of its local tensor, so autograd's own check of the saved local tensor misses them
    and the backward would read the new values."""
    for param, version in watched:
        if param._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a DTensor parameter of shape {list(param.shape)} is at "
                f"version {param._version}; expected version {version} instead. Run the "
                "backward before changing the parameters in place (e.g. before "
                "optimizer.step()), as with nn.Linear.")


_DTENSOR: list = []


def _dtensor_class():
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def dtensor_of(local: Tensor, spec) -> Tensor:
    """``DTensor(local, spec, requires_grad=False)``. Outside ``torch.compile`` it is built by
    ``DTensor.__new__`` alone: the constructor's ``__init__`` does nothing but pass through a
    wrapper that turns ``torch.compile`` off around it, which costs about 25 us a call."""
    DTensor = _dtensor_class()
    if torch.compiler.is_compiling():
        return DTensor(local, spec, requires_grad=False)
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)


def any_requires_grad(args) -> bool:
    for t in args:
        if isinstance(t, Tensor) and t.requires_grad:
            return True
    return False


def group_name(op: str, group: GroupLike, *tensors: Optional[Tensor], **same: object) -> str:
    """Resolves ``group`` and makes sure tpx has its own copy of it where it needs one
    (:mod:`tpx.comm.owned`); with ``TPX_DEBUG_CHECKS=1`` also checks, with one extra small
    collective, that every rank calls ``op`` with the same shapes, dtypes and arguments that
    shape its collectives, so that a mismatch raises the same error on every rank instead of
    hanging one of them."""
    pg = resolve_group(group)
    name = plain_group_name(pg)
    if config.debug_checks() and pg.size() > 1 and not torch.compiler.is_compiling():
        check_same(pg, op, tensors, same)
    return name


def check_same(pg, op: str, tensors, same: dict) -> None:
    meta = [None if t is None else (tuple(t.shape), str(t.dtype)) for t in tensors]
    check_same_on_ranks(pg, f"tpx.ops.{op}", dict(op=op, tensors=meta, **same))


def mesh_groups(op: str, names, tensors, **same) -> None:
    """The multi-dimensional ops' groups (given by name): tpx's own copies, and with
    ``TPX_DEBUG_CHECKS=1`` the arguments compared over each group."""
    if torch.compiler.is_compiling():
        return
    for name in names:
        if name is not None:
            own_by_name(name)
    if config.debug_checks():
        from torch.distributed.distributed_c10d import _resolve_process_group

        for name in names:
            if name is not None:
                pg = _resolve_process_group(name)
                if pg.size() > 1:
                    check_same(pg, op, tensors, same)


def world(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def dim_first_shape(t: Tensor, dim: int) -> list:
    return list(t.movedim(dim, 0).shape)

def register(op: str, backward, setup_context) -> None:
    """The autograd of ``torch.ops.tpx.<op>``: ``backward(ctx, *grads)`` and
    ``setup_context(ctx, inputs, output)`` become both the operator's own registration
    (``torch.library.register_autograd``: direct calls, ``torch.compile``) and one
    ``torch.autograd.Function`` that the op wrappers use in eager mode (see
    ``tpx.register_eager_function``); the Function runs the operator below the autograd
    key, so both paths compute the same thing. Under ``torch.autocast`` the op wrappers cast
    the inputs before ``Function.apply`` (:func:`tpx.ops.amp.eager_call`), above autograd as the
    operator's own Autocast kernel does."""
    backward = guarded(backward)
    _SETUP[op] = setup_context
    torch.library.register_autograd(f"tpx::{op}", backward, setup_context=setup_context)
    overload = getattr(torch.ops.tpx, op).default

    # forward(ctx, ...) rather than a separate setup_context: Function.apply then binds no
    # signature per call (inspect.signature costs as much as the dispatch work saved). Not
    # guarded itself: only the op wrappers apply it, and they are.
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = overload(*args)
        setup_context(ctx, args, output)
        return output

    function = type(f"{op}_function", (torch.autograd.Function,), dict(
        forward=staticmethod(forward), backward=staticmethod(backward), operator=overload,
        __module__="tpx.ops",
        __doc__=f"Eager autograd of ``torch.ops.tpx.{op}`` (see :func:`register`)."))
    register_eager_function(op, function)


_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saving_hooks() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``:
    non-reentrant activation checkpointing, its recomputation, ``save_on_cpu``)."""
    return _TOP_HOOKS is not None and _TOP_HOOKS(False) is not None


def register_saved_first(op: str, out_shape) -> None:
    """Under saved-tensor hooks, records ``torch.ops.tpx.<op>`` (registered by
    :func:`register`, whose ``setup_context`` saves inputs only) as two autograd nodes: one
    that saves the inputs and outputs a one-element placeholder expanded to the output's shape
    (``out_shape(*args)``), whose backward is the operator's own; then the operator itself,
    whose backward hands the output's gradient to the placeholder. Autograd packs the saved
    tensors when the first node is recorded, before the operator's collective runs, so the
    recomputation of non-reentrant activation checkpointing, which stops once the last saved
    tensor is packed again, does not run a collective whose output the backward does not
    need (PyTorch's TP, whose collective follows the GEMM as its own op, skips it the same
    way). Same kernels, same gradients; without saved-tensor hooks the operator stays one node."""
    function = _EAGER_FUNCTIONS[op]
    _SAVED_FIRST[op] = _SavedFirst(op, function, out_shape)


class _SavedFirst:
    """The two nodes of :func:`register_saved_first` for one operator; ``apply`` and
    ``operator`` as an eager Function's (``tpx.ops.core.call``, ``tpx.ops.amp.eager_call``)."""

    def __init__(self, op: str, function: type, out_shape) -> None:
        self.operator = overload = function.operator
        setup_context = _SETUP[op]

        def save(ctx, *args):
            setup_context(ctx, args, None)
            return args[0].new_empty(()).expand(out_shape(*args))

        def run(ctx, placeholder, *args):
            ctx.inputs = len(args)
            with torch._C._AutoDispatchBelowAutograd():
                return overload(*args)

        def run_backward(ctx, grad):
            return (grad,) + (None,) * ctx.inputs

        self.save = type(f"{op}_save_function", (torch.autograd.Function,), dict(
            forward=staticmethod(save), backward=staticmethod(function.backward),
            __module__="tpx.ops", __doc__=f"``torch.ops.tpx.{op}``'s saved inputs and backward "
            "(see :func:`register_saved_first`)."))
        self.run = type(f"{op}_run_function", (torch.autograd.Function,), dict(
            forward=staticmethod(run), backward=staticmethod(run_backward),
            __module__="tpx.ops", __doc__=f"``torch.ops.tpx.{op}`` after its saved inputs "
            "(see :func:`register_saved_first`)."))
        self.op = op

    def apply(self, *args):
        return self.run.apply(self.save.apply(*args), *args)

    def apply_on_params(self, args: tuple, transposed: tuple):
        """:func:`call_on_params`'s call: the first node takes the ``DTensor`` parameters (their
        gradients handed back as ``DTensor`` s), the operator their local tensors."""
        placeholder = on_params_function(self.op, transposed, self.save).apply(*args)
        DTensor = _dtensor_class()
        local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
        for i in transposed:
            local[i] = local[i].t()
        return self.run.apply(placeholder, *local)


def grad_or_zeros(grad, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros_like(like)
