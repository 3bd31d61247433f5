"""Parameters as ``DTensor`` s: the local tensor a layer computes with (:func:`local_of`,
:func:`local_params`, gradients landing on the ``DTensor`` parameter), a parameter replaced by
its ``DTensor`` sharing its storage (:func:`replace_param`, :func:`as_dtensor`), and the
parameters a style keeps whole on every rank made ``Replicate()`` ``DTensor`` s
(:func:`replicate_params`)."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from ..comm.groups import copied_with_module, shard_bounds
from .dtensor_io import DTensor, Replicate, Shard
from ..ops import amp
from ..ops.core import check_watched, dtensor_of

__all__ = ["REPLICATED", "as_dtensor", "compute_on_locals", "local_of", "local_params",
           "read_for_input_grad", "replace_param", "replicate_params", "replicate_params_of",
           "sum_partial_grads",
           "watch_params"]


#: Marks a parameter :func:`replicate_params` made a ``Replicate()`` ``DTensor``: its value
#: is handed out from the source rank by ``parallelize_module`` like a plain parameter's.
REPLICATED = "_tpx_replicated"


def replicate_params(module: nn.Module, group) -> List[Tuple[nn.Module, str]]:
    """Makes every plain parameter of ``module`` and its submodules a ``Replicate()``
    ``DTensor`` on the 1-D mesh over ``group``, sharing its storage (the placement PyTorch's
    styles give a parameter every rank holds whole). Returns ``(owner, name)`` of each."""
    done = []
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None or isinstance(p, DTensor):
                continue
            replicate_params_of(owner, name, group)
            done.append((owner, name))
    return done


def replicate_params_of(owner: nn.Module, name: str, group) -> nn.Parameter:
    """Makes the plain parameter ``name`` of ``owner`` a ``Replicate()`` ``DTensor`` on the 1-D
    mesh over ``group`` sharing its storage; returns it."""
    p = owner._parameters[name]
    new = replace_param(owner, name, as_dtensor(p, group, Replicate(), p.shape))
    setattr(new, REPLICATED, True)
    return new


def compute_on_locals(module: nn.Module, owned: List[Tuple[nn.Module, str]],
                      sum_grads_over=None, *, watch: bool = True,
                      only_dtensors: bool = False) -> list:
    """Runs ``module``'s own forward (code tpx did not write: a norm, an activation) on the
    local tensors of its ``DTensor`` parameters ``owned`` (``(owner, name)`` pairs, as
    :func:`replicate_params` returns them): a forward pre-hook swaps them into the owners'
    ``_parameters`` (through :func:`local_params`, so the gradients land on the ``DTensor``
    parameters) and a hook called even when the forward raises puts the ``DTensor`` s back.

    ``sum_grads_over`` (a process group): the gradients each rank computes are partial sums
    (the module saw this rank's block of the sequence, or its heads), summed over the group in
    the backward with one all-reduce (:func:`tpx.mappings.all_reduce_grads`). The sum is part
    of the autograd graph of each call, so it reaches whichever parameter object the module
    holds at that call (FSDP2's unsharded one too), a parameter made trainable later as well.

    ``watch``: the outputs check, in the backward, that no parameter the module read was
    changed in place since (:func:`watch_params`). ``only_dtensors``: at each call, only the
    entries that hold a ``DTensor`` then are swapped (``owned`` may be a list the caller
    edits later). ``copy.deepcopy`` of the module gives hooks that swap the copy's own
    parameters. Returns the hooks' handles."""
    if not owned:
        return []
    stack = []  # one entry per call in flight (a module called again inside its own forward)
    if sum_grads_over is not None and sum_grads_over.size() == 1:
        sum_grads_over = None

    def swap_in(mod, args):
        entries = owned if not only_dtensors else [
            (o, n) for o, n in owned if isinstance(o._parameters.get(n), DTensor)]
        params = [owner._parameters[name] for owner, name in entries]
        locals_ = list(local_params(*params))
        if sum_grads_over is not None:
            sum_partial_grads(locals_, sum_grads_over)
        for (owner, name), local in zip(entries, locals_):
            owner._parameters[name] = local
        stack.append((entries, params))

    def restore(mod, args, out):
        if not stack:
            return None
        entries, params = stack.pop()
        for (owner, name), p in zip(entries, params):
            owner._parameters[name] = p
        # The module's parameters are read for its inputs' gradients; outputs that are its
        # inputs passed through are not its computation.
        if not watch or not params or not any(isinstance(a, torch.Tensor) and a.requires_grad
                                              for a in args):
            return None
        if isinstance(out, (tuple, list)):
            watch_params([t for t in out if not any(t is a for a in args)], *params)
        else:
            watch_params(out, *params)
        return None

    # A copy of the module (an EMA copy) swaps its own parameters (copied_with_module).
    return [module.register_forward_pre_hook(copied_with_module(swap_in), prepend=True),
            module.register_forward_hook(copied_with_module(restore), prepend=True,
                                         always_call=True)]


def sum_partial_grads(tensors: list, pg) -> None:
    """Replaces, in the list ``tensors``, those that need a gradient by views whose gradients
    are summed over ``pg`` in the backward (one all-reduce for all of them)."""
    if not torch.is_grad_enabled():
        return
    idx = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if idx:
        from ..mappings import all_reduce_grads

        for i, t in zip(idx, all_reduce_grads([tensors[i] for i in idx], pg)):
            tensors[i] = t


def replace_param(module: nn.Module, name: str, dt: "DTensor") -> nn.Parameter:
    """Puts ``dt`` (the ``DTensor`` of parameter ``name``, sharing its storage) in its place as
    a parameter, keeping ``requires_grad`` and the attributes tpx attached (``_tpx*``)."""
    old = module._parameters[name]
    new = nn.Parameter(dt, requires_grad=old.requires_grad)
    for key, value in vars(old).items():
        if key.startswith("_tpx"):
            setattr(new, key, value)
    module._parameters[name] = new
    return new


def as_dtensor(local: torch.Tensor, group, placement, full_shape) -> "DTensor":
    """``local`` (this rank's part, a plain tensor) as a ``DTensor`` of ``full_shape`` with
    ``placement`` on the 1-D mesh over ``group``, sharing ``local``'s storage (no copy)."""
    from .dtensor_io import mesh_for_group

    local = local_of(local).detach()
    shape = torch.Size(full_shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh_for_group(group, local.device.type), [placement],
                              run_check=False, shape=shape, stride=stride)


def local_of(t):
    """The tensor this rank stores: the local tensor of a ``DTensor`` (a view of the same
    storage, outside autograd), ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _ToLocal(torch.autograd.Function):
    """The local tensors of ``DTensor`` parameters, with their gradients handed back as
    ``DTensor`` s of the same placements (one autograd node for all of a layer's
    parameters)."""

    @staticmethod
    def forward(ctx, *params):
        # A parameter the layer did not use in this call gets no gradient (as on one device),
        # not zeros: weight decay must not move it.
        ctx.set_materialize_grads(False)
        ctx.specs = [p._spec if isinstance(p, DTensor) else None for p in params]
        # detached aliases (a new tensor each, the storage and version counter shared): no
        # op that selective activation checkpointing would count, in the forward or in a
        # recomputation alike
        return tuple(local_of(p).detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(g if spec is None or g is None else dtensor_of(g.contiguous(), spec)
                     for g, spec in zip(grads, ctx.specs))




def local_params(*params):
    """The tensors a layer computes with, one per parameter (``None`` stays ``None``): the local
    tensor of a ``DTensor`` parameter, a plain parameter as it is. Where autograd records, the
    gradient reaching a local tensor lands on its ``DTensor`` parameter as a ``DTensor`` of
    the same placement; otherwise (``torch.no_grad``, frozen parameters) this is a plain
    attribute read."""
    if not torch.is_grad_enabled() or not any(
            isinstance(p, DTensor) and p.requires_grad for p in params):
        return tuple(local_of(p) for p in params)
    if torch.compiler.is_compiling():  # what the compiler traces: DTensor's own to_local
        return tuple(p.to_local() if isinstance(p, DTensor) else p for p in params)
    idx = [i for i, p in enumerate(params) if p is not None]
    outs = _ToLocal.apply(*(params[i] for i in idx))
    res = list(params)
    for i, o in zip(idx, outs):
        res[i] = o
    return tuple(res)


def read_for_input_grad(x, weight) -> bool:
    """Whether autograd keeps ``weight`` of ``y = x @ weight.T`` for the backward, as for
    ``nn.Linear``: when ``x`` needs a gradient, unless autocast computes with a cast copy of
    the weight (then the copy is what is kept, and changing the weight breaks nothing)."""
    if weight is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
        return False
    return not (amp.autocast_casts(x, weight)
                and weight.dtype != torch.get_autocast_dtype(x.device.type))


def watch_params(out, *params, read: bool = True):
    """``out`` (a layer's output: a tensor, or a tuple of them whose tensors the layer computed)
    after making the ``DTensor`` parameters among ``params`` watched as autograd watches the
    tensors it saves: when one of them is modified in place between this forward and its
    backward (``optimizer.step()`` before ``backward()``), the backward raises autograd's
    "modified by an inplace operation" error, as for ``nn.Linear``'s weight, before any of the
    layer's other backward nodes has run.

    ``read``: whether the backward reads the parameters, which the caller states as autograd
    would decide it: a Linear's weight is read for its input's gradient unless autocast
    computes with a cast copy (:func:`read_for_input_grad`), its bias never; an embedding's
    table is never read and is not watched.

    ``DTensor``'s in-place ops do not move the version of its local tensor, which is what the
    layer computed with and saved, so autograd's own check misses them. The check here is a
    pre-hook on the output's backward node, which runs before the layer's other nodes. (Under
    activation checkpointing without reentrance it still compares with the first forward,
    where torch's recomputation would use the new values.) Nothing is done where no gradient
    is recorded, or under ``torch.compile``."""
    if not read or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return out
    watched = tuple((p, p._version) for p in params if isinstance(p, DTensor))
    if not watched:
        return out
    outs = out if isinstance(out, (tuple, list)) else (out,)
    nodes = {t.grad_fn for t in outs if isinstance(t, torch.Tensor)} - {None}
    for node in nodes:
        node.register_prehook(lambda grad_outputs: check_watched(watched))
    return out


# ---------------------------------------------------------------------------------------------
# Fused segments split separately: torch's _StridedShard states them.

def strided_placement(dim: int, rows, full: int):
    """torch's ``_StridedShard(dim, split_factor=sf)`` when it states the 1-D layout ``rows``
    (per rank, the ranges of dim ``dim`` it holds, of ``full`` entries): dim cut into
    ``sf * P`` equal pieces, rank ``r`` holding pieces ``r, r + P, ...`` (a fused
    ``[gate | up]`` with each segment split by ``shard_range``). ``None`` otherwise, and where
    this torch's ``DTensor`` does not give exactly these rows, or where its
    ``torch.distributed.checkpoint`` would not refuse to save the placement (it computes one
    chunk per rank; a torch whose chunks do not overlap would write wrong ones without a
    word). No communication."""
    world, sf = len(rows), len(rows[0]) if rows else 0
    if world < 2 or sf < 2 or full % (sf * world):
        return None
    piece = full // (sf * world)
    for r, ranges in enumerate(rows):
        if tuple(ranges) != tuple(((i * world + r) * piece, (i * world + r + 1) * piece)
                                  for i in range(sf)):
            return None
    key = (world, sf, full)
    ok = _STRIDED_OK.get(key)
    if ok is None:
        ok = _strided_understood(world, sf, full, rows)
        _STRIDED_OK[key] = ok
    if not ok:
        return None
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=sf)


_STRIDED_OK: dict = {}


def _strided_understood(world: int, sf: int, full: int, rows) -> bool:
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import _StridedShard

        placement = _StridedShard(0, split_factor=sf)
        pieces = placement._split_tensor(torch.arange(full), world, with_padding=False)[0]
        for r, ranges in enumerate(rows):
            want = torch.cat([torch.arange(s, e) for s, e in ranges])
            if not torch.equal(pieces[r], want):
                return False
        chunks = sorted(
            (off[0], off[0] + size[0]) for size, off in
            (_compute_local_shape_and_global_offset((full,), (world,), [r], [placement])
             for r in range(world)))
        return any(b[0] < a[1] for a, b in zip(chunks, chunks[1:]))
    except Exception:  # a torch without these: the parameter stays plain
        return False


def strided(dt) -> bool:
    """Whether ``dt`` is a ``DTensor`` of segments split separately: a ``_StridedShard``
    placement on a dim no other mesh dimension splits (FSDP2's own ``_StridedShard`` over a TP
    ``Shard`` of the same dim is a block layout, which torch's checkpoint reads)."""
    if not isinstance(dt, DTensor):
        return False
    dims = [p.dim for p in dt.placements if not p.is_replicate()]
    return any(type(p).__name__ == "_StridedShard" and dims.count(p.dim) == 1
               for p in dt.placements)


def block_ranges(placements, mesh, coord, shape) -> List[List[Tuple[int, int]]]:
    """Per dim of the global ``shape``, the ranges this rank (``coord`` on ``mesh``) holds, in
    its local order, under ``placements`` (``Shard`` / ``_StridedShard`` on distinct dims,
    ``Replicate``)."""
    ranges = [[(0, n)] for n in shape]
    for m, p in enumerate(placements):
        if p.is_replicate():
            continue
        d, n, k = p.dim, mesh.size(m), coord[m]
        if len(ranges[d]) != 1 or ranges[d][0] != (0, shape[d]):
            raise ValueError("two mesh dimensions split the same dim in a strided layout")
        if type(p).__name__ == "_StridedShard":
            piece = shape[d] // (p.split_factor * n)
            ranges[d] = [((i * n + k) * piece, (i * n + k + 1) * piece)
                         for i in range(p.split_factor)]
        else:  # torch's Shard: shard_range's blocks
            ranges[d] = [shard_bounds(shape[d], k, n)]
    return ranges


def local_ranges(dt: "DTensor") -> List[List[Tuple[int, int]]]:
    """Per dim of ``dt``'s global shape, the ranges of the full tensor its local tensor holds,
    in local order: one range per dim for torch's ``Shard`` / ``Replicate`` (nested shards of
    one dim included), several for a strided layout."""
    if strided(dt):
        return block_ranges(dt.placements, dt.device_mesh, dt.device_mesh.get_coordinate(),
                            tuple(dt.shape))
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh,
                                                          dt.placements)
    return [[(int(o), int(o) + int(n))] for o, n in zip(offset, shape)]


def cut(full: torch.Tensor, like: "DTensor") -> "DTensor":
    """This rank's part of the full tensor ``full`` as a ``DTensor`` with the placements of
    ``like`` (any layout :func:`local_ranges` reads). No communication."""
    local = full
    for d, rs in enumerate(local_ranges(like)):
        parts = [local.narrow(d, s, e - s) for s, e in rs]
        local = parts[0] if len(parts) == 1 else torch.cat(parts, d)
    if strided(like):
        local = local.contiguous()
    return DTensor.from_local(local, like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


# ---------------------------------------------------------------------------------------------
# Blocks of the multi-dimensional layouts: one mesh per layout.

def mesh_placements(spec, info):
    """``(mesh dimension order, placements)`` of the ``DTensor`` of a multi-dimensional
    layer's parameter (``spec``: its :class:`tpx.nn.multidim.BlockSpec`; ``info``: the
    layout's :class:`tpx.mesh.MeshInfo`): ``Shard(d)`` on each mesh dimension that splits dim
    ``d``, ``Replicate()`` on the others, in the mesh's own order. A dim split by two mesh
    dimensions against that order takes ``_StridedShard`` on the inner one
    (:func:`_nested_placements`); where this torch cannot state it, the order is permuted
    to the splits' (the same ranks and groups). Made once per spec."""
    key = (tuple(spec.splits), tuple(spec.full_shape), info.names, info.shape)
    cached = _MESH_PLACEMENTS.get(key)
    if cached is None:
        cached = _MESH_PLACEMENTS[key] = _derive_mesh_placements(spec, info)
    return cached


_MESH_PLACEMENTS: dict = {}


def _dim_split_by(spec, name: str):
    """The dim of ``spec``'s parameter that mesh dimension ``name`` splits (``None``: none)."""
    return next((d for d, split in enumerate(spec.splits) if name in split), None)


def _derive_mesh_placements(spec, info):
    names = list(info.names)

    def plain(n):
        d = _dim_split_by(spec, n)
        return Replicate() if d is None else Shard(d)

    nested = [dims for dims in spec.splits
              if [names.index(d) for d in dims] != sorted(names.index(d) for d in dims)]
    if not nested:
        return names, [plain(n) for n in names]
    placements = _nested_placements(spec, info) if all(len(d) == 2 for d in nested) else None
    if placements is not None:
        return names, placements
    lead = [d for dims_ in spec.splits for d in dims_]
    order = lead + [n for n in names if n not in lead]
    return order, [plain(n) for n in order]


def _nested_placements(spec, info):
    """The placements on the mesh in its own order with ``_StridedShard(d, split_factor=``
    the outer dimension's size ``)`` on the inner of two mesh dimensions that split dim ``d``
    against that order (FSDP2's statement of a dim it splits inside TP's blocks), or ``None``
    where this torch's ``DTensor`` would not put every rank's block where ``spec`` does (its
    local shapes and offsets are checked for every rank; no communication)."""
    try:
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    names = list(info.names)
    sizes = dict(zip(names, info.shape))
    placements = []
    for n in names:
        d = _dim_split_by(spec, n)
        if d is None:
            placements.append(Replicate())
            continue
        split = spec.splits[d]
        outer = [m for m in split[:split.index(n)] if names.index(m) > names.index(n)]
        placements.append(_StridedShard(d, split_factor=sizes[outer[0]]) if outer else Shard(d))
    try:
        for index in range(len(info.ranks)):
            coord = info.coord_of(index)
            ranges = spec.ranges(info, coord)
            size, offset = _compute_local_shape_and_global_offset(
                tuple(spec.full_shape), tuple(info.shape), [coord[n] for n in names],
                placements)
            if tuple(size) != tuple(e - s for s, e in ranges) or \
                    tuple(offset) != tuple(s for s, _ in ranges):
                return None
    except Exception:  # a torch that does not compute this layout
        return None
    return placements
