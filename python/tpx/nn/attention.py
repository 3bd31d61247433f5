"""``nn.MultiheadAttention`` with its heads split over a tensor-parallel group
(:class:`ParallelMultiheadAttention`, what :class:`tpx.PairwiseParallel` turns one into), and
the check that a given one can be split."""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import mappings, ops
from .. import random as tpx_random
from ..comm.guard import guarded
from ..comm.groups import head_rows, resolve_group, shard_bounds, SharesGroupOnCopy
from ..layout.initial import load_initial, ShardSpec
from ..layout.sharding import KeepsParamSharding, describe_params
from ..layout.dtensor_io import Replicate, local_input
from .linear import RowParallelLinear

__all__ = ["ParallelMultiheadAttention", "check_mha"]


# --------------------------------------------------------------------------------------------
# nn.MultiheadAttention split by heads
# --------------------------------------------------------------------------------------------

def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mha(mha: nn.Module, world: int, where: str) -> None:
    """Raises (before anything is built or changed) when ``mha`` cannot be split by heads over
    ``world`` ranks. ``where``: the module's name in the model, for the messages."""
    what = f"nn.MultiheadAttention {where!r}" if where else "the nn.MultiheadAttention"
    if isinstance(mha, ParallelMultiheadAttention):
        raise ValueError(f"tpx.PairwiseParallel: {what} is a ParallelMultiheadAttention already "
                         "(sharded by an earlier call); parallelize the unsharded model once")
    if type(mha).forward is not nn.MultiheadAttention.forward:
        raise ValueError(
            f"tpx.PairwiseParallel: {what} is a {type(mha).__name__}, a subclass of "
            "nn.MultiheadAttention with its own forward, which the sharded attention would "
            "drop; use a plain nn.MultiheadAttention or shard the module with a plan")
    h, e = mha.num_heads, mha.embed_dim
    if h % world:
        raise ValueError(
            f"tpx.PairwiseParallel: {what} has num_heads={h}, which does not divide by the TP "
            f"size {world} (each rank must hold whole heads); use a TP size that divides {h} "
            f"(one of {_divisors(h)}) or a num_heads that divides by {world}")
    expected = ({"in_proj_weight": (3 * e, e)} if mha._qkv_same_embed_dim else
                {"q_proj_weight": (e, e), "k_proj_weight": (e, mha.kdim),
                 "v_proj_weight": (e, mha.vdim)})
    if mha.in_proj_bias is not None:
        expected["in_proj_bias"] = (3 * e,)
    if (mha.bias_k is None) != (mha.bias_v is None):
        raise ValueError(f"tpx.PairwiseParallel: {what} has one of bias_k / bias_v but not the "
                         "other (nn.MultiheadAttention's add_bias_kv sets both)")
    if mha.bias_k is not None:
        expected.update(bias_k=(1, 1, e), bias_v=(1, 1, e))
    for name, shape in expected.items():
        p = getattr(mha, name)
        if p is None or tuple(p.shape) != shape:
            got = None if p is None else tuple(p.shape)
            raise ValueError(
                f"tpx.PairwiseParallel: {what}.{name} has the shape {got}, not {shape} "
                f"(embed_dim={e}, kdim={mha.kdim}, vdim={mha.vdim}): was it changed or sharded "
                "already? Shard an unmodified nn.MultiheadAttention")
    out = mha.out_proj
    if not isinstance(out, nn.Linear) or tuple(out.weight.shape) != (e, e):
        raise ValueError(f"tpx.PairwiseParallel: {what}.out_proj must be the module's own "
                         f"[{e}, {e}] nn.Linear; got {type(out).__name__}")


def _float_mask(mask: Optional[Tensor], name: str, dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True: not attended) as an additive one (-inf), as PyTorch reads it."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise ValueError(f"tpx.ParallelMultiheadAttention: `{name}` must be a bool or floating "
                         f"tensor; got {mask.dtype}")
    return mask.to(dtype)


def _dropout_stream(p: float, device: torch.device, world: int):
    """Dropout of this rank's heads draws on tpx.random's tensor-parallel stream (when it is
    seeded), so that the ranks' heads get independent masks."""
    if p > 0 and world > 1 and tpx_random.is_seeded():
        return tpx_random.fork(device)
    return contextlib.nullcontext()


def _reject_nested(module, args) -> None:
    """Forward pre-hook of :class:`ParallelMultiheadAttention`. Nested tensors come from
    ``nn.TransformerEncoder``'s inference fast path, which drops the key padding mask and
    hands the layers nested tensors; the sharded layers do not take them. Being a hook, it
    also keeps ``nn.TransformerEncoderLayer`` off its fused fast path (which it takes only
    when no module inside has hooks), which would read the sharded weights as full ones."""
    if any(isinstance(a, Tensor) and a.is_nested for a in args[:3]):
        raise RuntimeError(
            "tpx.ParallelMultiheadAttention got a nested tensor: nn.TransformerEncoder's "
            "nested-tensor fast path is on for an encoder whose attention is sharded. Apply "
            "PairwiseParallel to the encoder itself (it turns that path off), or set "
            "encoder.use_nested_tensor = False")


class ParallelMultiheadAttention(KeepsParamSharding, SharesGroupOnCopy, nn.MultiheadAttention):
    """:class:`torch.nn.MultiheadAttention` with its heads split over a tensor-parallel group
    (what :class:`PairwiseParallel` turns an ``nn.MultiheadAttention`` into).

    With ``H = num_heads`` and ``P`` ranks, rank ``r`` holds heads ``[r H/P, (r+1) H/P)``:
    their rows of each of the q, k and v segments of ``in_proj_weight`` / ``in_proj_bias``
    (concatenated q | k | v; or their rows of ``q_proj_weight`` / ``k_proj_weight`` /
    ``v_proj_weight`` when ``kdim`` / ``vdim`` differ from ``embed_dim``), their columns of
    ``bias_k`` / ``bias_v``, and their columns of ``out_proj``, a
    :class:`tpx.RowParallelLinear` whose bias is replicated and added once.

    Placement: ``query, key, value R -> attn_output R``. The projections need no
    communication forward; each rank attends over its own heads; ``out_proj`` all-reduces:
    one all-reduce forward. Backward: the input gradients are all-reduced (once for
    self-attention, where ``query is key is value``; once per distinct input tensor
    otherwise). With ``need_weights=True`` (PyTorch's default) the attention weights of the
    heads are all-gathered (an extra collective of ``N x H x L x S`` numbers) and returned
    replicated, averaged over the heads unless ``average_attn_weights=False``, as PyTorch
    returns them; pass ``need_weights=False`` when they are not used. A ``DTensor`` input is
    redistributed to ``Replicate()`` first.

    Masks are PyTorch's: ``attn_mask`` ``[L, S]`` or ``[N * H, L, S]`` (each rank keeps its
    heads' slices), ``key_padding_mask`` ``[N, S]``, boolean or additive; ``is_causal`` as in
    PyTorch. ``num_heads`` stays the model's head count; ``local_num_heads`` is this rank's.
    Attention dropout (training, ``dropout > 0``) draws on ``tpx.random``'s tensor-parallel
    stream when ``tpx.random.manual_seed`` was called (the ranks' heads get independent
    masks); otherwise on the default generator.

    The state dict has ``nn.MultiheadAttention``'s keys, each tensor this rank's part;
    :func:`tpx.checkpoint.full_state_dict` gathers the unsharded module's tensors and
    :func:`tpx.checkpoint.load_full_state_dict` slices them back.

    Args:
        mha: the ``nn.MultiheadAttention`` to shard (every rank holds it whole; the weights
            of rank ``src_rank`` are used, as in :meth:`tpx.ColumnParallelLinear.from_linear`).
        group: ``None`` (default group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        src_rank: the rank whose weights every rank takes (default 0); ``None``: each rank
            keeps its part of its own module (ranks whose modules differ get a warning).
    """

    def __init__(self, mha: nn.MultiheadAttention, group=None, *,
                 src_rank: Optional[int] = 0) -> None:
        pg = resolve_group(group)
        world, rank = pg.size(), dist.get_rank(pg)
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"tpx.ParallelMultiheadAttention expects an nn.MultiheadAttention; "
                            f"got {type(mha).__name__}")
        check_mha(mha, world, "")
        nn.Module.__init__(self)  # not MultiheadAttention's: it would allocate full weights
        e, h = mha.embed_dim, mha.num_heads
        self.group, self.world_size, self.rank, self.src_rank = pg, world, rank, src_rank
        self.embed_dim, self.kdim, self.vdim = e, mha.kdim, mha.vdim
        self._qkv_same_embed_dim = mha._qkv_same_embed_dim
        self.num_heads, self.head_dim = h, mha.head_dim
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        self.add_zero_attn = mha.add_zero_attn
        self.local_num_heads = h // world
        self.head_start = rank * self.local_num_heads
        # Per rank, the rows it holds of a [q | k | v] projection and of one of them.
        self._rows_qkv = head_rows((e, e, e), self.head_dim, False, world)
        self._rows_one = head_rows((e,), self.head_dim, False, world)
        assert self._rows_one == [[shard_bounds(e, r, world)] for r in range(world)]
        factory = {"device": mha.out_proj.weight.device, "dtype": mha.out_proj.weight.dtype}
        specs, fulls = [], []

        def add(name: str, rows, dim: int) -> None:
            source = getattr(mha, name)
            if source is None:
                self.register_parameter(name, None)
                return
            shape = list(source.shape)
            shape[dim] = sum(b - a for a, b in rows[rank])
            param = nn.Parameter(torch.empty(shape, **factory),
                                 requires_grad=source.requires_grad)
            self.register_parameter(name, param)
            specs.append(ShardSpec(param, rows, dim))
            fulls.append(source)

        add("in_proj_weight", self._rows_qkv, 0)
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            add(name, self._rows_one, 0)
        add("in_proj_bias", self._rows_qkv, 0)
        add("bias_k", self._rows_one, 2)
        add("bias_v", self._rows_one, 2)
        config = dict(embed_dim=e, num_heads=h, kdim=self.kdim, vdim=self.vdim,
                      bias=mha.in_proj_bias is not None, add_bias_kv=mha.bias_k is not None,
                      add_zero_attn=self.add_zero_attn, dropout=self.dropout,
                      batch_first=self.batch_first, dtype=str(factory["dtype"]))
        load_initial(pg, "ParallelMultiheadAttention", config, specs, lambda: fulls,
                     src_rank=src_rank, drawn=False)
        out = mha.out_proj
        self.out_proj = RowParallelLinear(
            e, e, bias=out.bias is not None, group=pg, input_is_parallel=True,
            src_rank=src_rank, _full_weights=(out.weight, out.bias), **factory)
        self.out_proj.weight.requires_grad_(out.weight.requires_grad)
        if out.bias is not None:
            self.out_proj.bias.requires_grad_(out.bias.requires_grad)
        describe_params(self)
        self.train(mha.training)
        self.register_forward_pre_hook(_reject_nested)

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """The fused fast paths of PyTorch's transformer layers call this before they read the
        weights as full matrices; a sharded attention never takes them."""
        raise RuntimeError(
            "tpx.ParallelMultiheadAttention: a fused PyTorch fast path (the transformer layer "
            "kernel) was about to run on sharded weights. Apply PairwiseParallel to the "
            "enclosing layer or encoder (it turns the fast path off), or call "
            "torch.backends.mha.set_fastpath_enabled(False)")

    def _shards(self):
        """(parameter name, sharded dim, per rank the ranges of the full tensor it holds)."""
        if self._qkv_same_embed_dim:
            yield "in_proj_weight", 0, self._rows_qkv
        else:
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                yield name, 0, self._rows_one
        if self.in_proj_bias is not None:
            yield "in_proj_bias", 0, self._rows_qkv
        if self.bias_k is not None:
            yield "bias_k", 2, self._rows_one
            yield "bias_v", 2, self._rows_one

    def _project(self, xq: Tensor, xk: Tensor, xv: Tensor, same_qkv: bool,
                 same_kv: bool) -> Tuple[Tensor, Tensor, Tensor]:
        """This rank's heads of q, k and v: ``x R -> S(-1)`` (the input gradients are
        all-reduced in backward)."""
        n = self.local_num_heads * self.head_dim
        pg = self.group

        def proj(x, w, b):
            return ops.replicated_matmul(x, w.t(), pg, bias=b)

        b = self.in_proj_bias
        bq, bk, bv = b.split(n) if b is not None else (None, None, None)
        if not self._qkv_same_embed_dim:
            return (proj(xq, self.q_proj_weight, bq), proj(xk, self.k_proj_weight, bk),
                    proj(xv, self.v_proj_weight, bv))
        w = self.in_proj_weight
        if same_qkv:
            return proj(xq, w, b).split(n, dim=-1)
        q = proj(xq, w[:n], bq)
        if same_kv:
            k, v = proj(xk, w[n:], None if b is None else b[n:]).split(n, dim=-1)
            return q, k, v
        return q, proj(xk, w[n:2 * n], bk), proj(xv, w[2 * n:], bv)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        name = "tpx.ParallelMultiheadAttention"
        for arg, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}: `{arg}` must be a Tensor; got {type(t).__name__}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{name}: query, key and value must all be 3-D (batched) or 2-D "
                             f"(unbatched); got {query.dim()}-D, {key.dim()}-D and "
                             f"{value.dim()}-D")
        for arg, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if t.shape[-1] != width:
                raise ValueError(f"{name}: {arg}.shape[-1] must be {width}; got {arg} of shape "
                                 f"{tuple(t.shape)}")
        ref = self.out_proj.weight
        autocast = torch.is_autocast_enabled(ref.device.type)  # the GEMMs cast both
        for arg, t in (("query", query), ("key", key), ("value", value)):
            if (t.dtype != ref.dtype and not autocast) or t.device != ref.device:
                raise ValueError(f"{name}: {arg} is {t.dtype} on {t.device} but the weights are "
                                 f"{ref.dtype} on {ref.device}; convert one of them")

    def _masks(self, attn_mask, key_padding_mask, n: int, tgt: int, src: int, unbatched: bool,
               dtype) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(attn_mask as [1 or N, this rank's heads or 1, L, S], key_padding_mask as
        [N, 1, 1, S]), additive, or None."""
        name = "tpx.ParallelMultiheadAttention"
        kpm = _float_mask(key_padding_mask, "key_padding_mask", dtype)
        if kpm is not None:
            want = (src,) if unbatched else (n, src)
            if tuple(kpm.shape) != want:
                raise ValueError(f"{name}: key_padding_mask must have the shape {want}; got "
                                 f"{tuple(kpm.shape)}")
            kpm = kpm.reshape(n, 1, 1, src)
        mask = _float_mask(attn_mask, "attn_mask", dtype)
        if mask is not None:
            h, mine = self.num_heads, slice(self.head_start,
                                            self.head_start + self.local_num_heads)
            if mask.dim() == 2:
                if tuple(mask.shape) != (tgt, src):
                    raise ValueError(f"{name}: the 2-D attn_mask must have the shape "
                                     f"{(tgt, src)}; got {tuple(mask.shape)}")
                mask = mask.view(1, 1, tgt, src)
            elif mask.dim() == 3:
                if tuple(mask.shape) != (n * h, tgt, src):
                    raise ValueError(f"{name}: the 3-D attn_mask must have the shape "
                                     f"{(n * h, tgt, src)} (batch * num_heads, L, S); got "
                                     f"{tuple(mask.shape)}")
                mask = mask.view(n, h, tgt, src)[:, mine]
            else:
                raise ValueError(f"{name}: attn_mask must be 2-D or 3-D; got {mask.dim()}-D")
        return mask, kpm

    @guarded
    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """As :meth:`torch.nn.MultiheadAttention.forward`. Placement: ``query, key, value R
        -> attn_output R``, attention weights ``R`` (gathered) or ``None``."""
        pg = self.group
        same_qk, same_kv = key is query, value is key
        query = local_input(query, Replicate(), pg, "ParallelMultiheadAttention")
        key = query if same_qk else local_input(key, Replicate(), pg,
                                                "ParallelMultiheadAttention")
        value = key if same_kv else local_input(value, Replicate(), pg,
                                                "ParallelMultiheadAttention")
        self._check_inputs(query, key, value)
        unbatched = query.dim() == 2

        def batch_major(x):
            if unbatched:
                return x.unsqueeze(0)
            return x if self.batch_first else x.transpose(0, 1)

        xq = batch_major(query)
        xk = xq if same_qk else batch_major(key)
        xv = xk if same_kv else batch_major(value)
        n, tgt = xq.shape[0], xq.shape[1]
        src = xk.shape[1]
        if xk.shape[:2] != xv.shape[:2] or xk.shape[0] != n:
            raise ValueError("tpx.ParallelMultiheadAttention: query, key and value must have the "
                             "same batch size, and key and value the same length; got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if is_causal and attn_mask is None:
            raise RuntimeError("tpx.ParallelMultiheadAttention: is_causal=True needs attn_mask "
                               "(the causal mask it hints at), as in PyTorch; "
                               "nn.Transformer.generate_square_subsequent_mask makes one")
        q, k, v = self._project(xq, xk, xv, same_qk and same_kv, same_kv)
        # Masks in the dtype of q (which autocast may have lowered).
        mask, kpm = self._masks(attn_mask, key_padding_mask, n, tgt, src, unbatched, q.dtype)
        causal = False
        if is_causal and kpm is None and not need_weights:
            mask, causal = None, True
        heads, hd = self.local_num_heads, self.head_dim
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, heads * hd)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, heads * hd)], dim=1)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        q = q.reshape(n, tgt, heads, hd).transpose(1, 2)
        k = k.reshape(n, k.shape[1], heads, hd).transpose(1, 2)
        v = v.reshape(n, v.shape[1], heads, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, heads, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(n, heads, 1, hd)], dim=2)
            mask = None if mask is None else F.pad(mask, (0, 1))
            kpm = None if kpm is None else F.pad(kpm, (0, 1))
        if kpm is not None:
            mask = kpm if mask is None else mask + kpm
        p = self.dropout if self.training else 0.0
        weights = None
        with _dropout_stream(p, q.device, self.world_size):
            if need_weights:
                scores = torch.matmul(q * (1.0 / math.sqrt(hd)), k.transpose(-2, -1))
                if mask is not None:
                    scores = scores + mask
                weights = torch.softmax(scores, dim=-1)
                if p > 0:
                    weights = F.dropout(weights, p=p)
                out = torch.matmul(weights, v)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                     is_causal=causal)
        out = self.out_proj(out.transpose(1, 2).reshape(n, tgt, heads * hd))
        if need_weights:
            # Every rank's heads, in order: [N, H, L, S] replicated.
            weights = mappings.gather_dim(weights, 1, [heads] * self.world_size,
                                              self.head_start, pg)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads} (local "
                f"{self.head_start}:{self.head_start + self.local_num_heads}), "
                f"kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}, "
                f"dropout={self.dropout}, world_size={self.world_size}")
