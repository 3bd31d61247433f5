"""tpx under torch.autocast behaves as torch's layers do under it: GEMMs in the autocast dtype
from float32 parameters, losses in float32, embeddings untouched, float32 gradients for float32
parameters; eager and torch.compile alike. A Llama-style decoder sharded by tpx.plans.auto
trains two steps as the unsharded one, in float32 and under autocast, on any device (the CPU
here, a GPU in test_cuda.py).

Low-precision results are judged against a float64 run of the same torch model: the error of
tpx's result must be within a small multiple of the error of torch's own autocast result (the
two round differently, so they are not compared to each other bit for bit)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import tpx
import tpx.checkpoint
from harness import private_compile_cache, run_ranks, local_part, local_vs
from tiny_llama import Decoder

BF16 = torch.bfloat16


def _autocast(dtype=BF16):
    return torch.autocast("cpu", dtype=dtype)


def close_lowp(actual, lowp, ref64, what, factor=4.0):
    """``actual`` (tpx under autocast) has the dtype of ``lowp`` (torch under autocast), and its
    error against the float64 ``ref64`` is at most ``factor`` times torch's own."""
    actual = local_vs(actual, lowp)
    assert actual.dtype == lowp.dtype, f"{what}: dtype {actual.dtype}, torch gives {lowp.dtype}"
    assert actual.shape == lowp.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(lowp.shape)}"
    ref = ref64.double()
    err = (actual.double() - ref).norm().item()
    err_torch = (lowp.double() - ref).norm().item()
    scale = ref.norm().item()
    bound = factor * err_torch + 1e-6 * scale
    assert err <= bound, (f"{what}: error {err:.3e} vs float64 (relative {err / scale:.2e}) "
                          f"exceeds {factor} x torch's autocast error {err_torch:.3e}")


def close(actual, expected, what, **tol):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, **(tol or dict(rtol=1e-5, atol=1e-5)),
                               msg=lambda m: f"{what}: {m}")


class _OpDtypes(TorchDispatchMode):
    """Records the dtypes of the tensor arguments of every tpx operator that runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tpx":
            self.calls.append((func._opname,
                               [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _slice_rows(t, rng):
    return t[rng[0]:rng[1]]


# 1-D column / row linear (with and without sequence parallelism) ------------------------------


def _linear_pair_case(rank, world, sp, dtype):
    torch.manual_seed(10 + world)
    hidden, ffn, seq = 8, 3 * world + 1, 2 * world  # ffn divides unevenly
    ref = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    ref64 = copy.deepcopy(ref).double()
    col = tpx.ColumnParallelLinear.from_linear(ref[0], sequence_parallel=sp)
    row = tpx.RowParallelLinear.from_linear(ref[2], sequence_parallel=sp)
    x = torch.randn(2, seq, hidden)
    gy = torch.randn(2, seq, hidden)
    case = f"linear pair world={world} sp={sp} dtype={dtype}"

    xt = x.clone().requires_grad_(True)
    with _autocast(dtype):
        yt = ref(xt)
    (yt.float() * gy).sum().backward()
    x64 = x.double().requires_grad_(True)
    y64 = ref64(x64)
    (y64 * gy.double()).sum().backward()

    lo, hi = (2 * rank, 2 * rank + 2) if sp else (0, seq)
    xl = x[:, lo:hi].clone().requires_grad_(True)
    with _autocast(dtype), _OpDtypes() as seen:
        y = row(F.gelu(col(xl)))
    (y.float() * gy[:, lo:hi]).sum().backward()
    # Row SP returns this rank's sequence block; without SP the replicated output.
    close_lowp(y, yt[:, lo:hi], y64[:, lo:hi], f"output {case}")
    assert {name for name, _ in seen.calls} == (
        {"all_gather_matmul", "matmul_reduce_scatter"} if sp
        else {"replicated_matmul", "matmul_all_reduce"}), seen.calls
    for name, dtypes in seen.calls:  # a, b and the bias reach the GEMM in the autocast dtype
        assert dtypes == [dtype] * 3, f"{case}: {name} got {dtypes}"
    close_lowp(xl.grad, xt.grad[:, lo:hi], x64.grad[:, lo:hi], f"grad input {case}")
    out_rng = (col.out_start, col.out_end)
    in_rng = (row.in_start, row.in_end)
    for got, want, want64, what in [
            (col.weight.grad, _slice_rows(ref[0].weight.grad, out_rng),
             _slice_rows(ref64[0].weight.grad, out_rng), "column weight"),
            (col.bias.grad, _slice_rows(ref[0].bias.grad, out_rng),
             _slice_rows(ref64[0].bias.grad, out_rng), "column bias"),
            (row.weight.grad, ref[2].weight.grad[:, in_rng[0]:in_rng[1]],
             ref64[2].weight.grad[:, in_rng[0]:in_rng[1]], "row weight"),
            (row.bias.grad, ref[2].bias.grad, ref64[2].bias.grad, "row bias")]:
        assert got.dtype == torch.float32, f"{what} grad {got.dtype} {case}"
        close_lowp(got, want, want64, f"grad {what} {case}")


def _check_linear(rank, world):
    for sp in (False, True):
        _linear_pair_case(rank, world, sp, BF16)
    _linear_pair_case(rank, world, False, torch.float16)  # the autocast dtype is read per call

    torch.manual_seed(3)
    ref = nn.Linear(6, 2 * world + 1)
    col = tpx.ColumnParallelLinear.from_linear(ref, gather_output=True)
    x = torch.randn(4, 6)
    # Outside autocast a dtype mismatch is still refused, before any communication.
    with pytest.raises(ValueError, match=r"input dtype torch.bfloat16 differs from the weight "
                                         r"dtype torch.float32.*torch.autocast"):
        col(x.to(BF16))
    row = tpx.RowParallelLinear.from_linear(nn.Linear(2 * world + 1, 3), input_is_parallel=False)
    with pytest.raises(ValueError, match="differs from the weight dtype"):
        row(torch.randn(4, 2 * world + 1, dtype=torch.float64))
    # Under autocast: an input autocast casts is accepted, whatever its dtype, as by
    # nn.Linear; float64 (which autocast leaves alone) is still refused.
    with _autocast():
        for xin in (x, x.to(BF16), x.half()):
            y, yt = col(xin), ref(xin)
            close_lowp(y, yt, F.linear(xin.double(), ref.weight.double(), ref.bias.double()),
                       f"gathered column output from {xin.dtype}")
        with pytest.raises(ValueError, match="float64 differs from the weight dtype"):
            col(x.double())
        y = row(torch.randn(4, 2 * world + 1))
        assert y.dtype == BF16
    # backward() inside the autocast region (common in training loops) gives the same
    # float32 gradients as outside it.
    pair = [tpx.ColumnParallelLinear.from_linear(nn.Linear(6, 5)),
            tpx.RowParallelLinear.from_linear(nn.Linear(5, 6))]
    grads = []
    for inside in (False, True):
        for m in pair:
            m.zero_grad()
        with _autocast():
            y = pair[1](F.gelu(pair[0](x)))
            if inside:
                y.float().square().sum().backward()
        if not inside:
            y.float().square().sum().backward()
        grads.append([p.grad for m in pair for p in m.parameters()])
    for g_out, g_in in zip(*grads):
        assert g_out.dtype == g_in.dtype == torch.float32
        close(g_in, g_out, "backward inside autocast")
    # Direct calls of the operator go through its autocast kernel (the dispatch key).
    group = torch.distributed.group.WORLD.group_name
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    with _autocast():
        out = torch.ops.tpx.matmul_all_reduce(a, b, group)
    assert out.dtype == BF16
    close_lowp(out, (a.to(BF16) @ b.to(BF16)) * world, (a.double() @ b.double()) * world,
               "torch.ops.tpx.matmul_all_reduce")




# Embeddings, the vocab-parallel loss, the fused head + loss -----------------------------------


def _check_embedding(rank, world):
    torch.manual_seed(20 + world)
    vocab, dim, out, seq = 3 * world + 2, 6, 2 * world + 1, 2 * world
    emb, lin = nn.Embedding(vocab, dim, padding_idx=1), nn.Linear(dim, out)
    emb64, lin64 = copy.deepcopy(emb).double(), copy.deepcopy(lin).double()
    ids = torch.randint(0, vocab, (2, seq))
    gy = torch.randn(2, seq, out)
    with _autocast():
        yt = lin(emb(ids))
        et = emb(ids)
    (yt.float() * gy).sum().backward()
    (lin64(emb64(ids)) * gy.double()).sum().backward()
    y64 = lin64(emb64(ids))
    for sp in (False, True):
        temb = tpx.VocabParallelEmbedding.from_embedding(emb, sequence_parallel=sp)
        tlin = tpx.ColumnParallelLinear.from_linear(lin, gather_output=True,
                                                    sequence_parallel=sp)
        lo, hi = (2 * rank, 2 * rank + 2) if sp else (0, seq)
        with _autocast():
            e = temb(ids)
            y = tlin(e)
        # autocast leaves the embedding alone: the lookup is exact, in the table's dtype.
        assert e.dtype == et.dtype == torch.float32
        close(e, et[:, lo:hi].detach(), f"embedding sp={sp}", rtol=0, atol=0)
        close_lowp(y, yt, y64, f"embedding -> column (gathered) sp={sp}")
        (y.float() * gy).sum().backward()
        rng = (temb.vocab_start, temb.vocab_end)
        assert temb.weight.grad.dtype == torch.float32
        close_lowp(temb.weight.grad, _slice_rows(emb.weight.grad, rng),
                   _slice_rows(emb64.weight.grad, rng), f"embedding grad sp={sp}")
    cemb = tpx.ColumnParallelEmbedding.from_embedding(emb)
    with _autocast():
        ce = cemb(ids)
    assert ce.dtype == torch.float32
    close(ce, et.detach(), "ColumnParallelEmbedding", rtol=0, atol=0)




def _check_losses(rank, world):
    torch.manual_seed(30 + world)
    n, d, vocab = 7, 8, 3 * world + 2
    head = nn.Linear(d, vocab)
    head64 = copy.deepcopy(head).double()
    h = torch.randn(n, d)
    target = torch.randint(0, vocab, (n,))
    target[2] = -100
    kw = dict(label_smoothing=0.1, ignore_index=-100)
    thead = tpx.ColumnParallelLinear.from_linear(head)  # the LM head, logits S(-1)
    rng = (thead.out_start, thead.out_end)

    def reference():
        ht = h.clone().requires_grad_(True)
        with _autocast():
            loss_t = F.cross_entropy(head(ht), target, **kw)
        loss_t.backward()
        h64 = h.double().requires_grad_(True)
        loss64 = F.cross_entropy(head64(h64), target, **kw)
        loss64.backward()
        return ht, loss_t, h64, loss64

    # LM head (column-parallel GEMM in bf16) -> vocab-parallel cross-entropy (fp32).
    for fused in (False, True):
        for m in (head, head64, thead):
            m.zero_grad()
        ht, loss_t, h64, loss64 = reference()
        assert loss_t.dtype == torch.float32
        hl = h.clone().requires_grad_(True)
        with _autocast(), _OpDtypes() as seen:
            if fused:
                loss = tpx.linear_cross_entropy(hl, thead.weight, target, bias=thead.bias,
                                                chunk_size=3, **kw)
            else:
                loss = tpx.vocab_parallel_cross_entropy(thead(hl), target, **kw)
        loss.backward()
        case = "linear_cross_entropy" if fused else "head -> vocab_parallel_cross_entropy"
        # The GEMMs get the autocast dtype, the loss float32 logits; targets stay int64.
        assert seen.calls == (
            [("linear_cross_entropy", [BF16, BF16, BF16, torch.int64])] if fused else
            [("replicated_matmul", [BF16] * 3),
             ("vocab_parallel_cross_entropy", [torch.float32, torch.int64])]), seen.calls
        close_lowp(loss, loss_t, loss64, f"loss {case}")
        close_lowp(hl.grad, ht.grad, h64.grad, f"grad hidden {case}")
        for got, want, want64, what in [
                (thead.weight.grad, head.weight.grad, head64.weight.grad, "weight"),
                (thead.bias.grad, head.bias.grad, head64.bias.grad, "bias")]:
            assert got.dtype == torch.float32
            close_lowp(got, _slice_rows(want, rng), _slice_rows(want64, rng),
                       f"grad {what} {case}")

    # The loss alone, on logits of each dtype: float32 out under autocast, as F.cross_entropy
    # (the module and reduction="none" too); the logits' gradient keeps their dtype.
    full = torch.randn(n, vocab)
    loss_mod = tpx.VocabParallelCrossEntropyLoss(reduction="none", **kw)
    for dtype in (torch.float32, BF16, torch.float16):
        lt = full.to(dtype).clone().requires_grad_(True)
        ll = full[:, rng[0]:rng[1]].to(dtype).clone().requires_grad_(True)
        with _autocast():
            want = F.cross_entropy(lt, target, reduction="none", **kw)
            got = loss_mod(ll, target)
        assert got.dtype == want.dtype == torch.float32, (dtype, got.dtype, want.dtype)
        close(got, want, f"loss of {dtype} logits")
        gl = torch.randn(n)
        (want * gl).sum().backward()
        (got * gl).sum().backward()
        assert ll.grad.dtype == lt.grad.dtype == dtype
        close(ll.grad, lt.grad[:, rng[0]:rng[1]], f"logits grad {dtype}",
              **({} if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)))
    # Outside autocast the loss keeps the logits' dtype, as F.cross_entropy.
    assert tpx.vocab_parallel_cross_entropy(
        full[:, rng[0]:rng[1]].to(BF16).contiguous(), target).dtype == BF16




def _check_1d(rank, world):
    _check_linear(rank, world)
    _check_embedding(rank, world)
    _check_losses(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_1d_autocast(world):
    """Column/row linear (with and without sequence parallelism), the embeddings, the
    vocab-parallel loss and the fused head + loss, against torch's layers under autocast."""
    run_ranks(_check_1d, world)


# 2-D (SUMMA) layers and norm at 4 ranks -------------------------------------------------------


def _block(full, c, q):
    """Rank (row, col)'s block of a 2-D activation [B, ..., H]."""
    b, h = full.shape[0] // q, full.shape[-1] // q
    return full.narrow(0, c["row"] * b, b).narrow(-1, c["col"] * h, h)


def _wblock(w, c, q):
    n, k = w.shape
    return w[c["col"] * n // q:(c["col"] + 1) * n // q, c["row"] * k // q:(c["row"] + 1) * k // q]


def _vblock(v, c, q):
    n = v.shape[0]
    return v[c["col"] * n // q:(c["col"] + 1) * n // q]


def _check_2d(rank, world):
    mesh = tpx.init_mesh("2d")
    c = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    q = 2
    torch.manual_seed(40)
    hidden, ffn = 4 * q, 6 * q
    norm, fc1, fc2, norm2 = (nn.LayerNorm(hidden), nn.Linear(hidden, ffn),
                             nn.Linear(ffn, hidden), nn.LayerNorm(hidden))
    with torch.no_grad():
        for m in (norm, norm2):
            m.weight.normal_()
            m.bias.normal_()
    mods = [norm, fc1, fc2, norm2]
    mods64 = [copy.deepcopy(m).double() for m in mods]
    tmods = [tpx.LayerNorm2D.from_layernorm(norm, mesh), tpx.Linear2D.from_linear(fc1, mesh),
             tpx.Linear2D.from_linear(fc2, mesh), tpx.LayerNorm2D.from_layernorm(norm2, mesh)]

    def block(ms, x):
        n1, f1, f2, n2 = ms
        a = n1(x)
        u = f2(F.gelu(f1(a)))
        return a, u, n2(u), x + u  # the norm of a bf16 activation, and a residual add

    x = torch.randn(2 * q, 3, hidden)
    gy = torch.randn(2 * q, 3, hidden)
    xt = x.clone().requires_grad_(True)
    with _autocast():
        outs_t = block(mods, xt)
    (outs_t[2].float() * gy + outs_t[3] * gy).sum().backward()
    x64 = x.double().requires_grad_(True)
    outs64 = block(mods64, x64)
    (outs64[2] * gy.double() + outs64[3] * gy.double()).sum().backward()

    xl = _block(x, c, q).clone().requires_grad_(True)
    with _autocast():
        outs = block(tmods, xl)
    gl = _block(gy, c, q)
    (outs[2].float() * gl + outs[3] * gl).sum().backward()
    for got, want, want64, what in zip(outs, outs_t, outs64,
                                       ("norm (fp32 in)", "MLP", "norm (bf16 in)", "residual")):
        close_lowp(got, _block(want, c, q), _block(want64, c, q), f"2-D {what}")
    assert [o.dtype for o in outs] == [torch.float32, BF16, BF16, torch.float32]
    close_lowp(xl.grad, _block(xt.grad, c, q), _block(x64.grad, c, q), "2-D grad input")
    for tm, m, m64 in zip(tmods, mods, mods64):
        for (name, p), p_ref, p64 in zip(tm.named_parameters(), m.parameters(),
                                         m64.parameters()):
            pick = _wblock if p.dim() == 2 else _vblock
            assert p.grad.dtype == torch.float32
            close_lowp(p.grad, pick(p_ref.grad, c, q), pick(p64.grad, c, q),
                       f"2-D grad {type(tm).__name__}.{name}")
    with pytest.raises(ValueError, match="differs from the weight dtype"):
        tmods[1](xl.detach().to(BF16))


def test_2d_autocast():
    run_ranks(_check_2d, 4)


# torch.compile: the autocast kernels of the operators, compiled == eager ----------------------


@private_compile_cache()
def _check_compile(rank, world):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 4 * world + 2), nn.ReLU(), nn.Linear(4 * world + 2, 16))
    for sp in (False, True):
        kw = dict(sequence_parallel=sp, chunks=2)
        eager = nn.Sequential(tpx.ColumnParallelLinear.from_linear(ref[0], **kw), nn.ReLU(),
                              tpx.RowParallelLinear.from_linear(ref[2], **kw))
        # AOT autograd traces the operators' autocast kernels (the casts enter the graph);
        # inductor's code generation would only add compile time here.
        compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
        x = torch.randn(2, 4 * world, 16)
        if sp:
            x = x[:, 4 * rank:4 * rank + 4]
        with _autocast():
            y = compiled(x)
            y_eager = eager(x)
            y_torch = ref(x)
        assert y.dtype == y_eager.dtype == BF16
        params = list(eager.parameters())
        grads = torch.autograd.grad(y.float().square().sum(), params)
        grads_eager = torch.autograd.grad(y_eager.float().square().sum(), params)
        close(y, y_eager, f"compiled output sp={sp}", rtol=0, atol=0)
        for g, g_eager in zip(grads, grads_eager):
            assert g.dtype == torch.float32
            close(g, g_eager, f"compiled grad sp={sp}")
        if not sp:
            close_lowp(y, y_torch, copy.deepcopy(ref).double()(x.double()), "compiled vs torch")


@pytest.mark.parametrize("world", [2])
def test_compile_autocast(world):
    run_ranks(_check_compile, world, timeout=600)


# A Llama-style decoder sharded by tpx.plans.auto, trained two steps -----------------------------

LLAMA_VOCAB = 1003  # odd: the vocabulary (embedding, LM head, loss) splits unevenly at TP 2

# float32 against the unsharded model on the same device. The sharded run sums in other orders
# (a row-parallel GEMM's partial products are all-reduced; a GPU picks other GEMM and SDPA
# kernels for other shapes), so results agree to rounding only: about 1e-6 relative per op,
# grown by the two layers, the backward and the steps (on the CPU the largest difference is 3%
# of this tolerance). A real difference (a partial sum missing or doubled, a wrong slice, a
# gradient off by 1e-3 relative) is far above it.
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _llama_loss(logits, labels, loss_parallel, reduction):
    """Cross-entropy of the decoder's logits (vocab-parallel on logits sharded over the
    vocabulary); ``reduction="none"``: one loss per token, flattened."""
    if loss_parallel:
        loss = tpx.vocab_parallel_cross_entropy(logits, labels, vocab_size=LLAMA_VOCAB,
                                                reduction=reduction)
    else:
        loss = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction=reduction)
    return loss.flatten() if reduction == "none" else loss


def _llama_case(rank, world, dev, sp, lp, lowp):
    """Two training steps of the decoder sharded by ``tpx.plans.auto(sequence_parallel=sp,
    loss_parallel=lp)`` against the unsharded one on ``dev``: logits, loss, every parameter's
    gradient and every parameter after the optimizer step. ``lowp``: forward and loss under
    bf16 autocast, judged by ``close_lowp`` against a float64 copy run without autocast (its
    default factor 4: on the CPU, at TP 2 to 8, tpx's error is at most 2.1 x torch's, in
    gradients that follow an all-reduce of bf16 partial sums, and 1.0-1.2 x at the median);
    else float32, to ``FP32_TOL``."""
    dev_type = torch.device(dev).type
    case = f"llama {dev} world={world} sp={sp} lp={lp} {'bf16 autocast' if lowp else 'fp32'}"
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    ref = Decoder(vocab=LLAMA_VOCAB).to(dev)
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, None, tpx.plans.auto(model, sequence_parallel=sp,
                                                       loss_parallel=lp))
    ref64 = copy.deepcopy(ref).double() if lowp else None
    runs = [("torch", ref, lowp), ("tpx", model, lowp)] + (
        [("float64", ref64, False)] if lowp else [])
    # SGD with momentum (state on the sharded parameters). Not Adam: its first update,
    # lr * g / (|g| + eps), turns float32 rounding of a gradient element near eps into a
    # change of order lr (measured here: 1.5e-5 in output.weight from gradients that agree to
    # 3e-8), which no elementwise tolerance could tell from a real difference.
    # torch's foreach kernels (the default on CUDA) refuse a list mixing plain and DTensor
    # parameters. Every parameter tpx keeps whole is a Replicate() DTensor; only wk / wv stay
    # plain when the TP degree exceeds the KV heads (each is held by a group of ranks, a
    # layout no DTensor states). The per-parameter loop there; the foreach kernels where every
    # parameter is a DTensor (on the CPU too).
    foreach = all(isinstance(p, DTensor) for p in model.parameters())
    assert foreach == (world <= 4), (case, foreach)
    optims = {name: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
              for name, m, _ in runs}
    sharded = {sh.key: sh for sh in tpx.checkpoint.sharded_params(model)}
    ref_params = dict(ref.named_parameters())
    start = {k: v.double().clone() for k, v in ref.state_dict().items()}
    v0, v1 = tpx.shard_range(LLAMA_VOCAB)

    def part(key, full, local):
        """This rank's part of the unsharded ``full`` that the sharded ``local`` holds."""
        if key in sharded and tuple(local.shape) != tuple(full.shape):
            return sharded[key].slice_of(full)
        return full

    for step in range(2):
        what = f"{case} step {step}"
        ids = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=gen).to(dev)
        labels = torch.randint(0, LLAMA_VOCAB, (2, 8), generator=gen).to(dev)
        out = {}
        for name, m, autocast in runs:
            with torch.autocast(dev_type, dtype=BF16, enabled=autocast):
                logits = m(ids)
                sharded_loss = lp and m is model
                tokens = _llama_loss(logits, labels, sharded_loss, "none")
                loss = _llama_loss(logits, labels, sharded_loss, "mean")
            loss.backward()
            out[name] = logits.detach(), tokens.detach(), loss.detach()
        (logits, tokens, loss), (logits_t, tokens_t, loss_t) = out["tpx"], out["torch"]
        if lp:
            logits_t = logits_t[..., v0:v1]
        assert logits.dtype == logits_t.dtype == (BF16 if lowp else torch.float32), (
            f"{what}: logits {logits.dtype}, torch gives {logits_t.dtype}")
        assert loss.dtype == tokens.dtype == loss_t.dtype == torch.float32, (
            f"{what}: loss {loss.dtype}, per token {tokens.dtype}, torch gives {loss_t.dtype}")
        if lowp:
            logits64, tokens64, _ = out["float64"]
            close_lowp(logits, logits_t, logits64[..., v0:v1] if lp else logits64,
                       f"logits {what}")
            # The per-token losses: a single scalar's error is a lottery of rounding.
            close_lowp(tokens, tokens_t, tokens64, f"per-token loss {what}")
            close(loss, tokens.mean(), f"mean loss {what}", rtol=1e-5, atol=0)
        else:
            close(logits, logits_t, f"logits {what}", **FP32_TOL)
            close(tokens, tokens_t, f"per-token loss {what}", **FP32_TOL)
            close(loss, loss_t, f"loss {what}", **FP32_TOL)

        # Every parameter's gradient: the sharded ones against their slice of torch's.
        params64 = dict(ref64.named_parameters()) if lowp else {}
        compared = 0
        for key, p in model.named_parameters():
            assert p.grad is not None and ref_params[key].grad is not None, (
                f"{what}: {key} has no gradient")
            got = local_part(p.grad)
            want = part(key, ref_params[key].grad, got)
            assert got.dtype == want.dtype == torch.float32, (
                f"{what}: gradient of {key} {got.dtype}, torch gives {want.dtype}")
            if lowp:
                close_lowp(got, want, part(key, params64[key].grad, got),
                           f"gradient of {key} {what}")
            else:
                close(got, want, f"gradient of {key} {what}", **FP32_TOL)
            compared += 1
        assert compared == len(ref_params), (what, compared, len(ref_params))
        tpx.check_replicas(model, strict=True)  # replicated gradients equal on every rank

        # The optimizer step, then every parameter (gathered) against torch's.
        for name, m, _ in runs:
            optims[name].step()
            optims[name].zero_grad()
        full = tpx.checkpoint.full_state_dict(model)
        state = ref.state_dict()
        assert set(full) == set(state), (what, sorted(set(full) ^ set(state)))
        state64 = ref64.state_dict() if lowp else {}
        for key, value in state.items():
            assert full[key].dtype == value.dtype, (
                f"{what}: parameter {key} {full[key].dtype}, torch gives {value.dtype}")
            if lowp:  # the change since the start (all three started from the same values)
                close_lowp(full[key].double() - start[key], value.double() - start[key],
                           state64[key] - start[key], f"parameter {key} after {what}")
            else:
                close(full[key], value, f"parameter {key} after {what}", **FP32_TOL)
        tpx.check_replicas(model, grads=False, strict=True)


def _check_llama(rank, world, dev="cpu"):
    """The decoder sharded by ``tpx.plans.auto`` trains as the unsharded one on ``dev``
    (``"cuda"``: every rank on GPU 0), with and without sequence and loss parallelism, in
    float32 and under bf16 autocast."""
    if torch.device(dev).type == "cuda":
        torch.cuda.set_device(0)
    for lowp in (False, True):
        for sp in (False, True):
            for lp in (False, True):
                _llama_case(rank, world, dev, sp, lp, lowp)


# TP 3 does not divide the 8 heads. At TP 8 each rank holds one query head and the 4 KV heads
# are replicated (each held by two ranks, its gradient summed over them); the vocabulary
# splits 7 x 126 + 121.
@pytest.mark.parametrize("world", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_llama_tp_autocast(world):
    """A Llama-style decoder (GQA, SwiGLU, RMSNorm, rotary, SDPA) sharded by tpx.plans.auto:
    loss, every gradient and every parameter after two optimizer steps equal the unsharded
    model's, in float32 and under bf16 autocast (there judged against float64)."""
    run_ranks(_check_llama, world)
