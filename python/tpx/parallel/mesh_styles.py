"""Styles that shard a model over a 2-D, 2.5-D or 3-D mesh (:mod:`tpx.nn.multidim`), for
``tpx.parallelize_module(model, mesh, plan)`` with a mesh from ``tpx.init_mesh("2d")``
(``"2.5d"``, ``"3d"``).

The layout is read from the mesh's dimension names, so one plan serves every layout:
``tpx.plans.auto(model, layout=...)`` writes it. Between the layers, activations stay in the
layout's blocks (batch and hidden split, see :mod:`tpx.nn.multidim`); :class:`MeshInput`
splits the model's inputs at its entry and :class:`MeshParallel` with ``gather_output=True``
makes the LM head return the full logits, so ``model(ids)`` is called as before.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor, nn

from ..comm.groups import copied_with_module
from ..mesh import MeshInfo, check_mesh, mesh_layout
from ..nn import multidim as md
from .base import MESH_LAYOUTS, TPContext
from .style import ParallelStyle

__all__ = ["MeshStyle", "MeshParallel", "MeshInput", "MeshAttention"]

_SUFFIX = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}


def mesh_info(mesh, who: str) -> MeshInfo:
    layout = mesh_layout(mesh)
    if layout not in _SUFFIX:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"tpx.{who}: needs a 2-D, 2.5-D or 3-D mesh from tpx.init_mesh (named "
                         f"('row', 'col'), ('depth', 'row', 'col') or ('input', 'weight', "
                         f"'output')); got a mesh named {names}")
    return check_mesh(mesh, layout, who)


class MeshStyle(ParallelStyle):
    """Base of the styles applied over a multi-dimensional mesh: ``apply(module, ctx)``
    (``ctx.mesh`` is the 2-D, 2.5-D or 3-D mesh) returns the sharded module."""

    layouts = MESH_LAYOUTS

    def apply_mesh(self, module: nn.Module, mesh, src_rank: Optional[int] = 0) -> nn.Module:
        """``apply`` over ``mesh`` (the interface of earlier releases)."""
        return self.apply(module, TPContext.of(mesh, src_rank))

    def validate_mesh(self, module: nn.Module, mesh) -> None:
        """``validate`` over ``mesh`` (the interface of earlier releases)."""
        self.validate(module, TPContext.of(mesh))


def _is_rmsnorm(module: nn.Module) -> bool:
    if isinstance(module, getattr(nn, "RMSNorm", ())):
        return True
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return (isinstance(w, Tensor) and w.dim() == 1 and isinstance(eps, float)
            and not isinstance(module, (nn.LayerNorm, nn.Linear, nn.Embedding))
            and sum(1 for _ in module.parameters()) == 1)


class _GatherHook:
    def __init__(self, info: MeshInfo, hidden_mesh_dim: Optional[str]) -> None:
        # The validated MeshInfo, not the DeviceMesh: nothing is re-checked per call (no host
        # read, nothing torch.compile must break on).
        self.mesh, self.hidden = info, hidden_mesh_dim

    def __call__(self, module, args, output):
        kw = {"hidden_mesh_dim": self.hidden} if self.hidden else {}
        return md.gather_output(output, self.mesh, **kw)


class MeshParallel(MeshStyle):
    """Replaces an ``nn.Linear``, ``nn.LayerNorm``, an RMSNorm (``nn.RMSNorm`` or a module
    shaped like Hugging Face's ``LlamaRMSNorm``: one 1-D ``weight`` and a float
    ``variance_epsilon`` or ``eps``) or an ``nn.Embedding`` by the mesh layout's layer
    (``Linear2D`` / ``Linear2p5D`` / ``Linear3D``, ``LayerNorm*``, ``RMSNorm*``,
    ``Embedding*``) holding this rank's blocks of the module's values.

    Placement: input and output in the layout's blocks (:mod:`tpx.nn.multidim`); an
    embedding takes ids split in batch only.

    Args:
        hidden_mesh_dim: 3-D meshes only (ignored by 2-D and 2.5-D ones, so one plan serves
            every layout): the mesh dimension splitting the features of the module's INPUT,
            ``"output"`` (the model's residual stream) or ``"weight"`` (the output of a
            ``Linear3D`` that read the residual stream: attention's output projection and
            the MLP's down projection read it). Consecutive ``Linear3D`` layers alternate
            the two. Required for an ``nn.Linear`` on a 3-D mesh (both layouts have the same
            local shape, so a wrong guess would compute wrong numbers; ``apply`` raises
            ValueError without it); norms and embeddings default to ``"output"``. At run
            time each layer raises when its input is recorded in the other layout
            (:mod:`tpx.nn.multidim`).
        gather_output: the module's output is gathered to the full tensor (``R``) by a
            forward hook: the LM head of a model whose caller expects full logits.
        chunks: pipeline depth of ``Linear3D`` (``None``: the default).
    """

    replaces = True

    def __init__(self, *, hidden_mesh_dim: Optional[str] = None, gather_output: bool = False,
                 chunks: Optional[int] = None) -> None:
        if hidden_mesh_dim not in (None, "output", "weight"):
            raise ValueError(f"tpx.MeshParallel: `hidden_mesh_dim` must be None, 'output' or "
                             f"'weight'; got {hidden_mesh_dim!r}")
        self.hidden_mesh_dim, self.gather_output, self.chunks = (hidden_mesh_dim, gather_output,
                                                                 chunks)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        mesh, src_rank = ctx.mesh, ctx.src_rank
        info = mesh_info(mesh, "MeshParallel")
        suffix = _SUFFIX[info.layout]
        three_d = info.layout == "3d"
        hkw = {"hidden_mesh_dim": self.hidden_mesh_dim or "output"} if three_d else {}
        if three_d and isinstance(module, nn.Linear) and self.hidden_mesh_dim is None:
            raise ValueError(
                "tpx.MeshParallel: on a 3-D mesh an nn.Linear needs "
                "MeshParallel(hidden_mesh_dim=...), the mesh dim splitting its input's "
                "features: 'output' for a Linear reading the residual stream (attention's QKV, "
                "the MLP's up projection, the LM head), 'weight' for one reading the output of "
                "such a Linear (attention's output projection, the MLP's down projection). "
                "Consecutive Linear3D layers alternate; both layouts have the same local shape, "
                "so there is no safe default.")
        if isinstance(module, nn.Linear):
            kw = dict(hkw, src_rank=src_rank)
            if three_d and self.chunks is not None:
                kw["chunks"] = self.chunks
            new = getattr(md, "Linear" + suffix).from_linear(module, mesh, **kw)
            out_hidden = new.output_mesh_dim if three_d else None
        else:
            if self.chunks is not None:
                raise ValueError(f"tpx.MeshParallel: `chunks` is for nn.Linear; got a "
                                 f"{type(module).__name__}")
            kw = dict(hkw, src_rank=src_rank)
            if isinstance(module, nn.LayerNorm):
                new = getattr(md, "LayerNorm" + suffix).from_layernorm(module, mesh, **kw)
            elif isinstance(module, nn.Embedding):
                new = getattr(md, "Embedding" + suffix).from_embedding(module, mesh, **kw)
            elif _is_rmsnorm(module):
                new = getattr(md, "RMSNorm" + suffix).from_rmsnorm(module, mesh, **kw)
            else:
                raise ValueError(f"tpx.MeshParallel applies to nn.Linear, nn.LayerNorm, an "
                                 f"RMSNorm or nn.Embedding; got {type(module).__name__}")
            out_hidden = hkw.get("hidden_mesh_dim")
        for p_old, p_new in zip(module.parameters(), new.parameters()):
            p_new.requires_grad_(p_old.requires_grad)
        if self.gather_output:
            new.register_forward_hook(copied_with_module(_GatherHook(info, out_hidden)))
        return new

    def __repr__(self) -> str:
        return (f"MeshParallel(hidden_mesh_dim={self.hidden_mesh_dim!r}, "
                f"gather_output={self.gather_output})")


#: Hugging Face's per-token inputs that attention reads (the mask, and the positions its
#: rotary embeddings come from): on a 3-D mesh they meet the q/k/v projections' outputs.
ATTENTION_INPUTS = ("attention_mask", "position_ids")


class MeshInput(MeshStyle):
    """At a module's entry (the model itself), splits its inputs into the layout's blocks: the
    first positional input and the keyword inputs named by ``input_kwargs``.

    * Token ids (an integer tensor ``[B, ...]``) in batch only, float activations
      ``[B, ..., H]`` in batch and hidden, with :func:`tpx.split_input`.
    * Inputs that attention reads (``attention_mask``, ``position_ids``: any dtype, any
      number of dims after the batch) in batch only, in the batch order of the tensors
      attention runs on. On a 2-D / 2.5-D mesh that is the order of the ids. On a 3-D mesh
      the q/k/v projections (``Linear3D(hidden_mesh_dim="output")``) return their batch in
      the other order (blocks over ``("input", "output")`` instead of ``("input",
      "weight")``), so a mask split like the ids would pair a row with another row's padding.
    * A keyword input whose batch is 1 while the ids' is larger (a mask or positions
      broadcast over the batch) is left whole; inputs without a batch dimension, such as
      Hugging Face's ``cache_position``, are not named here and stay whole.

    Args:
        input_kwargs: the keyword inputs to split, as names (those in ``ATTENTION_INPUTS``,
            ``("attention_mask", "position_ids")``, in attention's batch order, the others
            in the ids' order), or as a dict from name to the 3-D mesh dim splitting the
            hidden features of the activations the input meets: ``"output"`` (the residual
            stream: ids, ``inputs_embeds``) or ``"weight"`` (the q/k/v projections' outputs:
            masks, positions). ``labels`` are left whole: the loss reads the full logits, or
            under ``tpx.loss_parallel(mesh)`` slices them itself.
    """

    def __init__(self, input_kwargs=("input_ids", "attention_mask", "position_ids")) -> None:
        if isinstance(input_kwargs, str):
            raise TypeError("tpx.MeshInput: `input_kwargs` must be a sequence of names or a "
                            f"dict from name to 'output' / 'weight'; got the string "
                            f"{input_kwargs!r}")
        if not isinstance(input_kwargs, dict):
            input_kwargs = {k: ("weight" if k in ATTENTION_INPUTS else "output")
                            for k in input_kwargs}
        for key, dim in input_kwargs.items():
            if dim not in ("output", "weight"):
                raise ValueError(f"tpx.MeshInput: input_kwargs[{key!r}] must be 'output' (read "
                                 f"with the residual stream) or 'weight' (read with the q/k/v "
                                 f"projections' outputs); got {dim!r}")
        self.input_kwargs: Dict[str, str] = dict(input_kwargs)

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        info = mesh_info(ctx.mesh, "MeshInput")
        three_d = info.layout == "3d"
        names = self.input_kwargs

        def split(x, hidden):
            if not isinstance(x, Tensor):
                return x
            return md.split_input(x, info, hidden_mesh_dim=hidden if three_d else None)

        def split_batch(key, x, hidden, batch):
            """Batch-only split of an input attention reads, in that batch order."""
            if not isinstance(x, Tensor) or x.dim() == 0:
                return x
            if batch is not None and x.shape[0] == 1 and batch > 1:
                return x  # broadcast over the batch
            if batch is not None and x.shape[0] != batch:
                raise ValueError(f"tpx.MeshInput: `{key}` has {x.shape[0]} rows in dim 0 and "
                                 f"the ids {batch}: pass it for the whole batch (or with one "
                                 "row, broadcast)")
            bdims, _ = md.mesh_splits(info, hidden if three_d else None)
            index, count = md.block_of(info, bdims)
            if x.shape[0] % count:
                raise ValueError(f"tpx.MeshInput: `{key}`.shape[0] (batch) = {x.shape[0]} must "
                                 f"divide by {count}, the number of batch blocks of the "
                                 f"{info.layout!r} layout (split over mesh dims {bdims})")
            rows = x.shape[0] // count
            return x.narrow(0, index * rows, rows)

        def hook(mod, args, kwargs):
            first = args[0] if args else None
            if not isinstance(first, Tensor):
                first = next((kwargs[k] for k in names if names[k] == "output"
                              and isinstance(kwargs.get(k), Tensor)), None)
            batch = first.shape[0] if isinstance(first, Tensor) and first.dim() else None
            if args:
                args = (split(args[0], "output"),) + tuple(args[1:])
            for key, hidden in names.items():
                if key not in kwargs:
                    continue
                if key in ATTENTION_INPUTS or (hidden == "weight"):
                    kwargs[key] = split_batch(key, kwargs[key], hidden, batch)
                else:
                    kwargs[key] = split(kwargs[key], hidden)
            return args, kwargs

        module.register_forward_pre_hook(copied_with_module(hook), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"MeshInput(input_kwargs={self.input_kwargs})"


class MeshAttention(MeshStyle):
    """An attention module whose projections are sharded by :class:`MeshParallel`: each rank
    holds whole heads (``num_heads / q`` query and ``num_kv_heads / q`` KV heads, ``q`` the
    mesh side splitting the hidden features) of its batch block. Checks that the head counts
    divide by ``q`` and tells the module its local counts through ``update(module,
    local_heads, local_kv_heads)`` (attributes such as ``n_heads``, ``num_heads``).

    The module must reshape its projections with ``-1`` heads or read the updated
    attributes; positions and masks come from the sequence, which is not split.
    """

    def __init__(self, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 update=None) -> None:
        self.num_heads = int(num_heads)
        self.num_kv_heads = int(num_kv_heads) if num_kv_heads is not None else self.num_heads
        self.update = update

    def validate(self, module: nn.Module, ctx: TPContext) -> None:
        info = mesh_info(ctx.mesh, "MeshAttention")
        q = info.q
        for what, n in (("attention heads", self.num_heads),
                        ("key/value heads", self.num_kv_heads)):
            if n % q:
                raise ValueError(
                    f"tpx.MeshAttention: the model has {n} {what}, which do not divide by the "
                    f"mesh side q = {q} of the {info.layout!r} layout (each rank holds whole "
                    f"heads of 1/q of the features); choose a mesh whose side divides {n}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"tpx.MeshAttention: {self.num_heads} query heads and "
                             f"{self.num_kv_heads} KV heads: not a GQA layout")

    def apply(self, module: nn.Module, ctx: TPContext) -> nn.Module:
        self.validate(module, ctx)
        q = mesh_info(ctx.mesh, "MeshAttention").q
        if self.update is not None:
            self.update(module, self.num_heads // q, self.num_kv_heads // q)
        return module

    def __repr__(self) -> str:
        return f"MeshAttention(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads})"
