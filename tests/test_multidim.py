"""2-D (SUMMA), 2.5-D and 3-D tensor parallelism against the unsharded computation: outputs,
input gradients, every parameter gradient and one SGD step, on fresh random inputs, at 2-D
with 4 and 9 ranks, 2.5-D with 8 ranks (depth 2), 3-D with 8 ranks; requires_grad
combinations; a pre-norm MLP block, embedding + vocab-parallel head + loss and the tiny Llama
decoder of examples/tiny_llama.py and Hugging Face Llama (2-D), sharded by
tpx.parallelize_module with tpx.plans.auto(model, layout=...), with and without loss
parallelism; mesh and size errors; initial weights from src_rank with differently seeded
ranks, and checkpoints across layouts (2-D -> 1-D / one device, 3-D -> one device, 1-D ->
2-D; state dicts, DCP, safetensors).

The expected blocks are cut from the full tensors here, by hand, from the placements the
layers document (not with tpx.split_input, which is tested against them)."""

import functools
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tpx
from harness import from_rank, run_ranks, local_part, local_vs


def close(actual, expected, what):
    actual = local_vs(actual, expected)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{what}: {m}")


def _coord(mesh):
    return dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))


def _act_block(full, layout, c, q, depth=1, hidden="output"):
    """This rank's block of a full activation [B, ..., H] (batch dim 0, hidden dim -1)."""
    if layout == "2d":
        bi, bn, hi = c["row"], q, c["col"]
    elif layout == "2.5d":
        bi, bn, hi = c["depth"] * q + c["row"], depth * q, c["col"]
    else:
        other = "weight" if hidden == "output" else "output"
        bi, bn, hi = c["input"] * q + c[other], q * q, c[hidden]
    b, h = full.shape[0] // bn, full.shape[-1] // q
    return full.narrow(0, bi * b, b).narrow(-1, hi * h, h)


def _weight_block(w, layout, c, q, hidden="output"):
    """This rank's block of an nn.Linear weight [out, in] (A = W^T)."""
    n, k = w.shape
    if layout in ("2d", "2.5d"):
        i, j = c["row"], c["col"]
        return w[j * n // q:(j + 1) * n // q, i * k // q:(i + 1) * k // q]
    other = "weight" if hidden == "output" else "output"
    r = c[other] * q + c["input"]
    nl = n // (q * q)
    h = c[hidden]
    return w[r * nl:(r + 1) * nl, h * k // q:(h + 1) * k // q]


def _bias_block(b, layout, c, q, hidden="output"):
    """The bias block of a layer whose INPUT's hidden dim is split by `hidden` (3-D: the
    bias follows the output features, split by the other activation dim)."""
    n = b.shape[0]
    j = c["col"] if layout in ("2d", "2.5d") else c["weight" if hidden == "output" else "output"]
    return b[j * n // q:(j + 1) * n // q]


def _make_linear(layout, ref, mesh, hidden="output", chunks=None):
    if layout == "2d":
        return tpx.Linear2D.from_linear(ref, mesh)
    if layout == "2.5d":
        return tpx.Linear2p5D.from_linear(ref, mesh)
    return tpx.Linear3D.from_linear(ref, mesh, hidden_mesh_dim=hidden, chunks=chunks)


def _linear_case(mesh, layout, q, depth, k, n, batch_shape, gen, hidden="output", chunks=None,
                 need_x=True, need_w=True, bias=True):
    c = _coord(mesh)
    other = "weight" if hidden == "output" else "output"
    out_hidden = other if layout == "3d" else hidden
    case = (f"{layout} q={q} k={k} n={n} batch={batch_shape} hidden={hidden} chunks={chunks} "
            f"need_x={need_x} need_w={need_w} bias={bias}")
    ref = nn.Linear(k, n, bias=bias)
    layer = _make_linear(layout, ref, mesh, hidden, chunks)
    if not need_w:
        ref.weight.requires_grad_(False)
        layer.weight.requires_grad_(False)
    x_full = torch.randn(*batch_shape, k, generator=gen)
    gy = torch.randn(*batch_shape, n, generator=gen)
    xr = x_full.clone().requires_grad_(need_x)
    y_ref = ref(xr)
    (y_ref * gy).sum().backward()

    x = _act_block(x_full, layout, c, q, depth, hidden).clone().requires_grad_(need_x)
    y = layer(x)
    close(y, _act_block(y_ref.detach(), layout, c, q, depth, out_hidden), f"output {case}")
    (y * _act_block(gy, layout, c, q, depth, out_hidden)).sum().backward()
    if need_x:
        close(x.grad, _act_block(xr.grad, layout, c, q, depth, hidden), f"grad input {case}")
    else:
        assert x.grad is None
    if need_w:
        close(layer.weight.grad, _weight_block(ref.weight.grad, layout, c, q, hidden),
              f"grad weight {case}")
    else:
        assert layer.weight.grad is None, case
    if bias:
        close(layer.bias.grad, _bias_block(ref.bias.grad, layout, c, q, hidden),
              f"grad bias {case}")
        # One SGD step leaves every block equal to the block of the stepped reference.
        params = [p for p in layer.parameters() if p.requires_grad]
        torch.optim.SGD(params, lr=0.1).step()
        torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1).step()
        close(layer.weight.detach(), _weight_block(ref.weight.detach(), layout, c, q, hidden),
              f"weight after SGD {case}")
        close(layer.bias.detach(), _bias_block(ref.bias.detach(), layout, c, q, hidden),
              f"bias after SGD {case}")


def _layout_args(layout, world):
    if layout == "2d":
        q = round(world ** 0.5)
        return q, 1, dict()
    if layout == "2.5d":
        return round((world // 2) ** 0.5), 2, dict(depth=2)
    return round(world ** (1 / 3)), 1, dict()


def _check_linear(rank, world, layout):
    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    assert mesh.mesh_dim_names == tpx.mesh.LAYOUTS[layout]
    gen = torch.Generator().manual_seed(100 + world)
    torch.manual_seed(7)  # the reference layers are drawn identically on every rank
    nb = {"2d": q, "2.5d": depth * q, "3d": q * q}[layout]
    nf = q * q if layout == "3d" else q
    k, n = 2 * q, 2 * nf
    hiddens = ("output", "weight") if layout == "3d" else ("output",)
    chunk_opts = (None, 1, 2, 4) if layout == "3d" else (None,)
    for hidden in hiddens:
        for chunks in chunk_opts:
            for shape in ((nb,), (2 * nb, 3)):          # [B, k] and [B, S, k]
                _linear_case(mesh, layout, q, depth, k, n, shape, gen, hidden, chunks)
        # requires_grad combinations, and no bias
        for need_x, need_w in ((False, True), (True, False), (False, False)):
            _linear_case(mesh, layout, q, depth, 3 * q, n, (nb, 2), gen, hidden,
                         need_x=need_x, need_w=need_w)
        _linear_case(mesh, layout, q, depth, k, 2 * n, (nb,), gen, hidden, bias=False)

    # The constructor draws the full nn.Linear, then slices: same seed -> same model.
    cls = {"2d": tpx.Linear2D, "2.5d": tpx.Linear2p5D, "3d": tpx.Linear3D}[layout]
    hk = dict(hidden_mesh_dim="output") if layout == "3d" else {}
    torch.manual_seed(11)
    full = nn.Linear(k, n)
    torch.manual_seed(11)
    layer = cls(k, n, mesh, **hk)
    c = _coord(mesh)
    close(layer.weight, _weight_block(full.weight.detach(), layout, c, q), "constructor weight")
    close(layer.bias, _bias_block(full.bias.detach(), layout, c, q), "constructor bias")

    # Communication of one forward, counted by tpx.comm_stats, against the derivation:
    # 2-D: q broadcasts of X blocks over "col" and q of weight blocks over "row";
    # 3-D (chunks=2): one all-gather of the weight over "input", two of X over the other
    # activation dim, two reduce-scatters of Y over the hidden dim.
    xs = torch.randn(nb, 3, k, generator=gen)[:, :, :k // q].contiguous()
    if layout == "3d":
        layer3 = tpx.Linear3D.from_linear(full, mesh, hidden_mesh_dim="output", chunks=2)
        with tpx.comm_stats() as stats:
            y3 = layer3(torch.randn(nb // (q * q) * q, 3, k // q))
        g = mesh.get_group
        w_bytes = local_part(layer3.weight).numel() * 4
        assert stats.calls(g("input"), "all_gather") == 1
        assert stats.bytes(g("input"), "all_gather") == w_bytes
        assert stats.calls(g("weight"), "all_gather") == 2
        assert stats.calls(g("output"), "reduce_scatter") == 2
        assert stats.bytes(g("output"), "reduce_scatter") == y3.numel() * 4
        assert stats.calls() == 5
    elif layout in ("2d", "2.5d"):
        with tpx.comm_stats() as stats:
            layer(xs)
        g = mesh.get_group
        assert stats.calls(g("col"), "broadcast") == q, stats
        assert stats.bytes(g("col"), "broadcast") == q * xs.numel() * 4
        assert stats.calls(g("row"), "broadcast") == q
        assert stats.bytes(g("row"), "broadcast") == q * local_part(layer.weight).numel() * 4
        assert stats.calls() == 2 * q

    # split_input / gather_output: the full gradient arrives on every rank.
    x_full = torch.randn(nb * 2, 3, k, generator=gen)
    gy = torch.randn(nb * 2, 3, n, generator=gen)
    xr = x_full.clone().requires_grad_(True)
    (full(xr) * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    part = tpx.split_input(xs, mesh)
    close(part, _act_block(x_full, layout, c, q, depth), "split_input")
    y = layer(part)
    out_kw = dict(hidden_mesh_dim=layer.output_mesh_dim) if layout == "3d" else {}
    y_full = tpx.gather_output(y, mesh, **out_kw)
    close(y_full, full(x_full).detach(), "gather_output")
    (y_full * gy).sum().backward()
    close(xs.grad, xr.grad, "grad through split_input / gather_output")

    # Bad sizes and meshes raise before any collective.
    with pytest.raises(ValueError, match=r"in_features = %d must divide by %d" % (q + 1, q)):
        cls(q + 1, n, mesh, **hk)
    with pytest.raises(ValueError, match=r"out_features = %d must divide by %d" % (q + 1, nf)):
        cls(k, q + 1, mesh, **hk)
    emb_cls = {"2d": tpx.Embedding2D, "2.5d": tpx.Embedding2p5D, "3d": tpx.Embedding3D}[layout]
    with pytest.raises(ValueError, match=r"embedding_dim = %d must divide by %d" % (q + 1, q)):
        emb_cls.from_embedding(nn.Embedding(5, q + 1), mesh)
    with pytest.raises(ValueError, match=r"x.shape\[0\] \(batch\) = %d" % (nb + 1)):
        tpx.split_input(torch.randn(nb + 1, k), mesh)
    with pytest.raises(ValueError, match="input must be this rank's block"):
        layer(torch.randn(2, k + 1))
    wrong = {"2d": "3d", "2.5d": "2d", "3d": "2d"}[layout]
    flat = mesh._flatten() if hasattr(mesh, "_flatten") else None
    for bad in (flat,):
        if bad is None:
            continue
        with pytest.raises(ValueError, match=f"needs a {len(mesh.shape)}-D mesh"):
            cls(k, n, bad, **hk)
    with pytest.raises(TypeError, match="must be a torch DeviceMesh"):
        cls(k, n, dist.group.WORLD, **hk)
    del wrong


def _check_world_one(rank, world):
    for layout, kw in (("2d", {}), ("2.5d", dict(depth=1)), ("3d", {})):
        mesh = tpx.init_mesh(layout, **kw)
        gen = torch.Generator().manual_seed(3)
        torch.manual_seed(5)
        _linear_case(mesh, layout, 1, 1, 4, 6, (3, 2), gen)
        _mlp_block_case(mesh, layout, 1, 1, "layernorm", gen)
    assert tpx.init_mesh("1d").mesh_dim_names == ("tp",)
    # A copied layer shares the mesh and computes the same thing.
    import copy

    layer = tpx.Linear3D(4, 4, mesh, hidden_mesh_dim="output")
    x = torch.randn(2, 4)
    close(copy.deepcopy(layer)(x), layer(x), "deepcopy of a layer")
    # Schemas, fakes and autograd registrations of the multi-dimensional ops.
    name = dist.group.WORLD.group_name
    x, w, b = torch.randn(3, 2, 4), torch.randn(6, 4), torch.randn(6)
    g = torch.randn(3, 2, 6)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    torch.library.opcheck(torch.ops.tpx.linear_2d.default, (xg, wg, bg, name, name, name))
    torch.library.opcheck(torch.ops.tpx.linear_3d.default, (xg, wg, bg, name, name, name, 1))
    torch.library.opcheck(torch.ops.tpx.linear_2d_backward.default,
                          (g, x, w, name, name, None, True, False, True))
    torch.library.opcheck(torch.ops.tpx.linear_3d.default, (x, w, b, name, name, name, 2))
    torch.library.opcheck(torch.ops.tpx.linear_3d_backward.default,
                          (g, x, w, name, name, name, None, True, True, False))
    torch.library.opcheck(torch.ops.tpx.mesh_all_reduce.default, (x, name))
    torch.library.opcheck(torch.ops.tpx.mesh_all_gather.default, (x, name))
    # torch.compile(fullgraph=True) over a model sharded by a plan (hooks, norms, attention,
    # the 2-D ops through their fakes) equals eager, outputs and every gradient.
    from tiny_llama import Decoder

    torch.manual_seed(8)
    ref = Decoder(vocab=32, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden=16)
    model = copy.deepcopy(ref)
    tpx.parallelize_module(model, tpx.init_mesh("2d"), tpx.plans.auto(model, layout="2d"))
    ids = torch.randint(0, 32, (2, 5), generator=gen)
    # aot_eager: the whole graph traced through the ops' fakes and AOT autograd (inductor's
    # code generation is covered by tests/test_compile.py).
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(ids)
    close(out, ref(ids), "compiled 2-D decoder")
    out.square().sum().backward()
    ref(ids).square().sum().backward()
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        close(p.grad, rp.grad, f"compiled 2-D decoder grad {n}")


def test_world_one():
    run_ranks(_check_world_one, 1)


def _check_mesh_errors(rank, world):
    with pytest.raises(ValueError, match=r"world size 2 is not a square \(world sizes that "
                                         r"fit: 1, 4, 9"):
        tpx.init_mesh("2d")
    with pytest.raises(ValueError, match=r"world size 2 is not a cube .*1, 8, 27"):
        tpx.init_mesh("3d")
    with pytest.raises(ValueError, match="needs `depth`"):
        tpx.init_mesh("2.5d")
    with pytest.raises(ValueError, match="must be one of"):
        tpx.init_mesh("4d")
    with pytest.raises(ValueError, match="only for the '2.5d' layout"):
        tpx.init_mesh("2d", depth=2)
    mesh1 = tpx.init_mesh("1d")
    with pytest.raises(ValueError, match=r"needs a 2-D mesh with dimension names \('row', "
                                         r"'col'\); got a 1-D mesh"):
        tpx.Linear2D(4, 4, mesh1)
    with pytest.raises(ValueError, match="needs a 3-D mesh"):
        tpx.Linear3D(4, 4, mesh1, hidden_mesh_dim="output")
    mesh25 = tpx.init_mesh("2.5d", depth=2)  # 2 x 1 x 1
    with pytest.raises(ValueError, match=r"that is the '2.5d' layout's mesh"):
        tpx.Linear2D(4, 4, mesh25)
    from torch.distributed.device_mesh import init_device_mesh
    odd = init_device_mesh("cpu", (2, 1), mesh_dim_names=("row", "col"))
    with pytest.raises(ValueError, match=r"equal sizes along \['row', 'col'\]"):
        tpx.Linear2D(4, 4, odd)


def test_mesh_errors():
    run_ranks(_check_mesh_errors, 2)


class LlamaLikeRMSNorm(nn.Module):
    """Shaped like Hugging Face's LlamaRMSNorm (weight, variance_epsilon)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


def _make_norm(kind, hidden, gen):
    if kind == "layernorm":
        m = nn.LayerNorm(hidden)
    elif kind == "rmsnorm":
        m = nn.RMSNorm(hidden, eps=1e-6)
    else:
        m = LlamaLikeRMSNorm(hidden)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


def _shard_norm(kind, layout, ref, mesh, hidden):
    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}[layout]
    kw = dict(hidden_mesh_dim=hidden) if layout == "3d" else {}
    if kind == "layernorm":
        return getattr(tpx, "LayerNorm" + suffix).from_layernorm(ref, mesh, **kw)
    return getattr(tpx, "RMSNorm" + suffix).from_rmsnorm(ref, mesh, **kw)


def _norm_block(full, layout, c, q, hidden):
    if layout in ("2d", "2.5d"):
        j = c["col"]
    else:
        j = c[hidden]
    n = full.shape[0]
    return full[j * n // q:(j + 1) * n // q]


def _mlp_block_case(mesh, layout, q, depth, kind, gen, need_x=True):
    """x + fc2(gelu(fc1(norm(x)))) against the same modules on one device."""
    c = _coord(mesh)
    nb = {"2d": q, "2.5d": depth * q, "3d": q * q}[layout]
    hidden = 4 * q if layout != "3d" else q * q * 2
    ffn = 2 * hidden
    norm, fc1, fc2 = _make_norm(kind, hidden, gen), nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    snorm = _shard_norm(kind, layout, norm, mesh, "output")
    s1 = _make_linear(layout, fc1, mesh, "output")
    s2 = _make_linear(layout, fc2, mesh, "weight" if layout == "3d" else "output")
    case = f"MLP block {layout} q={q} norm={kind} need_x={need_x}"
    x_full = torch.randn(2 * nb, 3, hidden, generator=gen)
    gy = torch.randn(2 * nb, 3, hidden, generator=gen)
    xr = x_full.clone().requires_grad_(need_x)
    y_ref = xr + fc2(torch.nn.functional.gelu(fc1(norm(xr))))
    (y_ref * gy).sum().backward()
    x = _act_block(x_full, layout, c, q, depth).clone().requires_grad_(need_x)
    y = x + s2(torch.nn.functional.gelu(s1(snorm(x))))
    close(y, _act_block(y_ref.detach(), layout, c, q, depth), f"output {case}")
    (y * _act_block(gy, layout, c, q, depth)).sum().backward()
    if need_x:
        close(x.grad, _act_block(xr.grad, layout, c, q, depth), f"grad input {case}")
    inner = "weight" if layout == "3d" else "output"
    for (name, p), (_, rp) in zip(snorm.named_parameters(), norm.named_parameters()):
        close(p.grad, _norm_block(rp.grad, layout, c, q, "output"), f"grad norm.{name} {case}")
    close(s1.weight.grad, _weight_block(fc1.weight.grad, layout, c, q, "output"), f"fc1.w {case}")
    close(s1.bias.grad, _bias_block(fc1.bias.grad, layout, c, q, "output"), f"fc1.b {case}")
    close(s2.weight.grad, _weight_block(fc2.weight.grad, layout, c, q, inner), f"fc2.w {case}")
    close(s2.bias.grad, _bias_block(fc2.bias.grad, layout, c, q, inner), f"fc2.b {case}")
    params = [*snorm.parameters(), *s1.parameters(), *s2.parameters()]
    torch.optim.SGD(params, lr=0.05).step()
    torch.optim.SGD([*norm.parameters(), *fc1.parameters(), *fc2.parameters()], lr=0.05).step()
    for (name, p), (_, rp) in zip(snorm.named_parameters(), norm.named_parameters()):
        close(p.detach(), _norm_block(rp.detach(), layout, c, q, "output"),
              f"norm.{name} after SGD {case}")
    close(s2.weight.detach(), _weight_block(fc2.weight.detach(), layout, c, q, inner),
          f"fc2.w after SGD {case}")


def _check_mlp_block(rank, world, layout):
    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    gen = torch.Generator().manual_seed(200 + world)
    torch.manual_seed(17)
    for kind in ("layernorm", "rmsnorm", "llama"):
        _mlp_block_case(mesh, layout, q, depth, kind, gen)
    _mlp_block_case(mesh, layout, q, depth, "layernorm", gen, need_x=False)
    # A frozen norm weight gets no gradient; the others are still right.
    norm = _shard_norm("layernorm", layout, nn.LayerNorm(4 * q * q), mesh, "output")
    norm.weight.requires_grad_(False)
    x = tpx.split_input(torch.randn(q * q * depth, 4 * q * q, generator=gen), mesh)
    norm(x.requires_grad_(True)).sum().backward()
    assert norm.weight.grad is None and norm.bias.grad is not None and x.grad is not None
    with pytest.raises(ValueError, match=r"normalized_shape = %d must divide by %d" % (q + 1, q)):
        _shard_norm("layernorm", layout, nn.LayerNorm(q + 1), mesh, "output")


def _check_embedding_head(rank, world, layout):
    """Embedding -> Linear head (vocab split over the hidden mesh dim of the logits) ->
    tpx.vocab_parallel_cross_entropy over that mesh dim's group, against nn.Embedding ->
    nn.Linear -> F.cross_entropy(reduction="sum")."""
    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    c = _coord(mesh)
    gen = torch.Generator().manual_seed(300 + world)
    torch.manual_seed(23)
    nb = {"2d": q, "2.5d": depth * q, "3d": q * q}[layout]
    vocab, dim = 3 * q * q, 2 * q
    emb, head = nn.Embedding(vocab, dim, padding_idx=1), nn.Linear(dim, vocab)
    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}[layout]
    semb = getattr(tpx, "Embedding" + suffix).from_embedding(emb, mesh)
    shead = _make_linear(layout, head, mesh, "output")
    ids = torch.randint(0, vocab, (2 * nb, 3), generator=gen)
    labels = torch.randint(0, vocab, (2 * nb, 3), generator=gen)
    ref_logits = head(emb(ids))
    loss_ref = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, vocab),
                                                 labels.reshape(-1), reduction="sum")
    loss_ref.backward()

    logit_dim = "weight" if layout == "3d" else "col"
    local_ids = tpx.split_input(ids, mesh)
    logits = shead(semb(local_ids))
    # The logits' batch block (3-D: the head's output, rows block input*q + output).
    bdims = {"2d": ["row"], "2.5d": ["depth", "row"], "3d": ["input", "output"]}[layout]
    bi = 0
    for d in bdims:
        bi = bi * (depth if d == "depth" else q) + c[d]
    b = ids.shape[0] // nb
    lab = labels[bi * b:(bi + 1) * b]
    loss = tpx.vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            lab.reshape(-1), group=mesh.get_group(logit_dim),
                                            reduction="sum", vocab_size=vocab)
    # This rank's loss is the loss of its batch block.
    local_ref = torch.nn.functional.cross_entropy(
        ref_logits.detach()[bi * b:(bi + 1) * b].reshape(-1, vocab),
        labels[bi * b:(bi + 1) * b].reshape(-1), reduction="sum")
    close(loss, local_ref, f"{layout} local loss")
    loss.backward()
    close(semb.weight.grad, emb.weight.grad[:, _norm_slice(dim, layout, c, q)],
          f"{layout} embedding grad")
    close(shead.weight.grad, _weight_block(head.weight.grad, layout, c, q), f"{layout} head grad")
    close(shead.bias.grad, _bias_block(head.bias.grad, layout, c, q), f"{layout} head bias grad")


def _norm_slice(n, layout, c, q):
    j = c["col"] if layout in ("2d", "2.5d") else c["output"]
    return slice(j * n // q, (j + 1) * n // q)


def _shard_decoder(model, mesh, layout):
    """examples/tiny_llama.py's Decoder with every Linear, norm and the embedding swapped for
    the layout's layers, by hand (3-D: projections into attention / the MLP take the input
    split by "output", the projections out of them the input split by "weight")."""
    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}[layout]
    lin, norm = getattr(tpx, "Linear" + suffix), getattr(tpx, "RMSNorm" + suffix)
    emb = getattr(tpx, "Embedding" + suffix)
    kw_in = dict(hidden_mesh_dim="output") if layout == "3d" else {}
    kw_mid = dict(hidden_mesh_dim="weight") if layout == "3d" else {}
    model.tok_embeddings = emb.from_embedding(model.tok_embeddings, mesh, **kw_in)
    for block in model.layers:
        block.attention_norm = norm.from_rmsnorm(block.attention_norm, mesh, **kw_in)
        block.ffn_norm = norm.from_rmsnorm(block.ffn_norm, mesh, **kw_in)
        att, ffn = block.attention, block.feed_forward
        att.wq, att.wk, att.wv = (lin.from_linear(m, mesh, **kw_in)
                                  for m in (att.wq, att.wk, att.wv))
        att.wo = lin.from_linear(att.wo, mesh, **kw_mid)
        ffn.w1, ffn.w3 = (lin.from_linear(m, mesh, **kw_in) for m in (ffn.w1, ffn.w3))
        ffn.w2 = lin.from_linear(ffn.w2, mesh, **kw_mid)
    model.norm = norm.from_rmsnorm(model.norm, mesh, **kw_in)
    model.output = lin.from_linear(model.output, mesh, **kw_in)
    return model


def _decoder_block(name, full, layout, c, q):
    """This rank's block of the full tensor ``full`` of the Decoder's parameter ``name``,
    sharded as _shard_decoder shards it."""
    if name.endswith("norm.weight"):
        return _norm_block(full, layout, c, q, "output")
    if name == "tok_embeddings.weight":
        return full[:, _norm_slice(full.shape[1], layout, c, q)]
    inner = "weight" if layout == "3d" else "output"
    hidden = inner if name.split(".")[-2] in ("wo", "w2") else "output"
    return _weight_block(full, layout, c, q, hidden)


def _expected_block(model, name, full, layout, c, q):
    """This rank's block of the full tensor ``full`` of the sharded model's parameter
    ``name``, from the placements the layers document."""
    owner, _, pname = name.rpartition(".")
    mod = model.get_submodule(owner)
    hidden = getattr(mod, "hidden_mesh_dim", None) or "output"
    if isinstance(mod, (tpx.Linear2D, tpx.Linear3D)):
        if pname == "weight":
            return _weight_block(full, layout, c, q, hidden)
        return _bias_block(full, layout, c, q, hidden)
    if isinstance(mod, tpx.Embedding2D):
        return full[:, _norm_slice(full.shape[1], layout, c, q)]
    return _norm_block(full, layout, c, q, hidden)


def _broadcast_module(module):
    """Rank 0's values on every rank (the reference model of differently seeded ranks)."""
    with torch.no_grad():
        for t in module.state_dict().values():
            dist.broadcast(t, 0)


def _check_grads_and_step(model, ref, layout, c, q, what):
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(ref_params), what
    for name, p in model.named_parameters():
        close(p.grad, _expected_block(model, name, ref_params[name].grad, layout, c, q),
              f"grad {name} ({what})")
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for name, p in model.named_parameters():
        close(p.detach(), _expected_block(model, name, ref_params[name].detach(), layout, c, q),
              f"{name} after SGD ({what})")


def _check_decoder(rank, world, layout):
    """examples/tiny_llama.py's Decoder sharded by tpx.parallelize_module with
    tpx.plans.auto(model, layout=...), called as model(ids) like the unsharded one, the ranks
    seeded differently (rank 0's model is the source): logits, every gradient, one SGD step;
    then the same with loss_parallel=True and F.cross_entropy under tpx.loss_parallel(mesh)."""
    import copy

    import torch.nn.functional as F
    from tiny_llama import Decoder

    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    nb = {"2d": q, "2.5d": depth * q, "3d": q * q}[layout]
    c = _coord(mesh)
    torch.manual_seed(31 + rank)  # different on every rank
    ref = Decoder(vocab=12 * q * q, dim=8 * q, n_layers=2, n_heads=2 * q, n_kv_heads=q,
                  hidden=4 * q * q)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = copy.deepcopy(ref)
    _broadcast_module(ref)
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout))
    vocab = ref.output.out_features
    gen = torch.Generator().manual_seed(400 + world)
    ids = torch.randint(0, vocab, (2 * nb, 5), generator=gen)
    g = torch.randn(2 * nb, 5, vocab, generator=gen)
    logits_ref = ref(ids)
    (logits_ref * g).sum().backward()
    logits = model(ids)
    close(logits, logits_ref.detach(), f"decoder logits {layout}")
    (logits * g).sum().backward()
    _check_grads_and_step(model, ref, layout, c, q, f"decoder {layout}")

    # Loss parallelism: the logits stay in the layout's blocks; the loss of the full batch.
    torch.manual_seed(77 + rank)
    ref = Decoder(vocab=vocab, dim=8 * q, n_layers=1, n_heads=2 * q, n_kv_heads=q,
                  hidden=4 * q * q)
    model = copy.deepcopy(ref)
    _broadcast_module(ref)
    tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout=layout,
                                                       loss_parallel=True))
    labels = torch.randint(0, vocab, (2 * nb, 5), generator=gen)
    labels[0, :2] = -100
    loss_ref = F.cross_entropy(ref(ids).reshape(-1, vocab), labels.reshape(-1))
    loss_ref.backward()
    local_logits = model(ids)
    assert local_logits.shape[-1] == vocab // q, tuple(local_logits.shape)
    with tpx.loss_parallel(mesh):
        loss = F.cross_entropy(local_logits.reshape(-1, local_logits.shape[-1]),
                               labels.reshape(-1))
    close(loss, loss_ref.detach(), f"loss_parallel loss {layout}")
    loss.backward()
    _check_grads_and_step(model, ref, layout, c, q, f"decoder loss_parallel {layout}")


def _check_plan_errors(rank, world):
    """Plans that cannot apply on a 2 x 2 mesh fail on every rank with the numbers."""
    from tiny_llama import Decoder

    mesh = tpx.init_mesh("2d")
    torch.manual_seed(3)
    with pytest.raises(ValueError, match=r"3 attention heads, which do not divide by the mesh "
                                         r"side q = 2"):
        m = Decoder(vocab=24, dim=12, n_layers=1, n_heads=3, n_kv_heads=3, hidden=8)
        tpx.parallelize_module(m, mesh, tpx.plans.auto(m, layout="2d"))
    m = Decoder(vocab=25, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, hidden=8)
    with pytest.raises(ValueError, match=r"'output'.*out_features = 25 must divide by 2"):
        tpx.parallelize_module(m, mesh, tpx.plans.auto(m, layout="2d"))
    m = Decoder(vocab=24, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, hidden=8)
    with pytest.raises(ValueError, match="sequence_parallel=True is for layout='1d'"):
        tpx.plans.auto(m, layout="2d", sequence_parallel=True)
    with pytest.raises(ValueError, match="`layout` must be"):
        tpx.plans.auto(m, layout="2-d")
    with pytest.raises(TypeError, match="must be a mesh style"):
        tpx.parallelize_module(m, mesh, {"output": tpx.ColwiseParallel()})
    with pytest.raises(TypeError, match="must be a dict"):
        tpx.parallelize_module(m, mesh, tpx.parallel.mesh_styles.MeshParallel())
    with pytest.raises(ValueError, match="pass a mesh from tpx.init_mesh"):
        tpx.parallelize_module(m, None, {"output": tpx.parallel.mesh_styles.MeshParallel()})
    # Tied embeddings sharded by two entries of a mesh plan (their layers split them in
    # different blocks): refused, the model left as it was (it used to untie them silently).
    m = Decoder(vocab=24, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, hidden=8)
    plan = tpx.plans.auto(m, layout="2d")
    m.output.weight = m.tok_embeddings.weight
    with pytest.raises(ValueError, match="tied parameters tok_embeddings.weight, "
                                         "output.weight.*Nothing was changed"):
        tpx.parallelize_module(m, mesh, plan)
    assert type(m.output) is torch.nn.Linear and m.output.weight is m.tok_embeddings.weight
    # Ids whose batch does not divide by q: a clear error before any collective.
    m = Decoder(vocab=24, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, hidden=8)
    tpx.parallelize_module(m, mesh, tpx.plans.auto(m, layout="2d"))
    with pytest.raises(ValueError, match=r"batch\) = 3 must divide by 2"):
        m(torch.zeros(3, 4, dtype=torch.long))


def _check_hf_llama(rank, world):
    """Hugging Face Llama (tiny config, random weights) at 2-D: logits and the model's own
    loss (labels given), then the loss under tpx.loss_parallel(mesh), every gradient."""
    import copy

    transformers = pytest.importorskip("transformers")
    mesh = tpx.init_mesh("2d")
    q = 2
    c = _coord(mesh)
    vocab = 1002
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=88,
                                   num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    for lp in (False, True):
        model = copy.deepcopy(ref)
        tpx.parallelize_module(model, mesh, tpx.plans.auto(model, layout="2d",
                                                           loss_parallel=lp))
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, vocab, (4, 12), generator=gen)
        labels = ids.clone()
        labels[1, :4] = -100
        ref.zero_grad()
        out_ref = ref(input_ids=ids, labels=labels)
        out_ref.loss.backward()
        if lp:
            with tpx.loss_parallel(mesh):
                out = model(input_ids=ids, labels=labels)
            close(out.logits, _act_block(out_ref.logits.detach(), "2d", c, q),
                  "HF Llama 2-D logits block (loss_parallel)")
        else:
            out = model(input_ids=ids, labels=labels)
            close(out.logits, out_ref.logits.detach(), "HF Llama 2-D logits")
        close(out.loss, out_ref.loss.detach(), f"HF Llama 2-D loss (loss_parallel={lp})")
        out.loss.backward()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            close(p.grad, _expected_block(model, name, ref_params[name].grad, "2d", c, q),
                  f"HF Llama 2-D grad {name} (loss_parallel={lp})")


def _check_layout(rank, world, layout):
    _check_linear(rank, world, layout)
    _check_mlp_block(rank, world, layout)
    _check_embedding_head(rank, world, layout)
    _check_decoder(rank, world, layout)
    if layout == "2d" and world == 4:
        _check_hf_llama(rank, world)
        _check_plan_errors(rank, world)


# One group of processes per layout and world size (spawning 8-9 ranks costs more than the
# checks): Linear (all requires_grad combinations, 3-D chunkings, constructor, split/gather,
# errors), the pre-norm MLP block with LayerNorm / nn.RMSNorm / a LlamaRMSNorm-shaped norm,
# embedding -> vocab-parallel head -> loss, the tiny Llama decoder through tpx.plans.auto (with
# and without loss parallelism), and at 2-D on 4 ranks Hugging Face Llama and the plan errors.
@pytest.mark.parametrize("layout,world", [("2d", 4), pytest.param("2d", 9, marks=pytest.mark.slow),
                                          pytest.param("2.5d", 8, marks=pytest.mark.slow),
                                          ("3d", 8)])
def test_layout_matches_unsharded(layout, world):
    run_ranks(_check_layout, world, layout)


# Checkpoints and initial weights of the multi-dimensional layers -----------------------------


def _raises_everywhere(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _check_initial_weights(rank, world, layout):
    """src_rank=0 (default): ranks seeded differently build each layer and get their blocks of
    rank 0's full tensors; src_rank=None: each rank's own (equal seeds match one device,
    different seeds raise, or warn for an existing module); arguments differing on one rank raise on every rank."""
    import os

    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    c = _coord(mesh)
    suffix = {"2d": "2D", "2.5d": "2p5D", "3d": "3D"}[layout]
    lin, ln, rms, emb = (getattr(tpx, n + suffix)
                         for n in ("Linear", "LayerNorm", "RMSNorm", "Embedding"))
    k, n, V, D = 2 * q, 2 * q * q, 5 * q, 2 * q
    mid = dict(hidden_mesh_dim="weight") if layout == "3d" else {}
    hid = "weight" if layout == "3d" else "output"
    if layout == "3d":  # Linear3D has no default hidden_mesh_dim
        lin = functools.partial(lin, hidden_mesh_dim="output")
        lin.from_linear = functools.partial(tpx.Linear3D.from_linear, hidden_mesh_dim="output")

    def same_linear(layer, ref, hidden="output"):
        assert torch.equal(local_part(layer.weight), _weight_block(ref.weight.detach(), layout, c, q, hidden))
        if ref.bias is not None:
            assert torch.equal(local_part(layer.bias), _bias_block(ref.bias.detach(), layout, c, q, hidden))

    # Constructors, each rank seeded differently: rank 0's draws, in rank 0's order.
    torch.manual_seed(1000 + rank)
    layer, table = lin(k, n, mesh), emb(V, D, mesh, padding_idx=1)
    layer3 = (tpx.Linear3D(k, n, mesh, bias=False, **mid) if mid
              else lin(k, n, mesh, bias=False))
    norm = ln(D, mesh)
    torch.manual_seed(1000)
    ref, ref_table = nn.Linear(k, n), nn.Embedding(V, D, padding_idx=1)
    ref3 = nn.Linear(k, n, bias=False)
    same_linear(layer, ref)
    assert torch.equal(local_part(table.weight), ref_table.weight.detach()[:, _norm_slice(D, layout, c, q)])
    assert layer3.bias is None
    same_linear(layer3, ref3, hid)
    assert torch.equal(local_part(norm.weight), torch.ones(D // q)) and torch.equal(local_part(norm.bias),
                                                                        torch.zeros(D // q))
    x = torch.randn(q * q * depth, 3, k, generator=torch.Generator().manual_seed(5))
    out_kw = dict(hidden_mesh_dim=layer.output_mesh_dim) if layout == "3d" else {}
    close(tpx.gather_output(layer(tpx.split_input(x, mesh)), mesh, **out_kw), ref(x).detach(),
          f"{layout} forward of rank 0's layer")

    # from_*: every rank holds its own module; the layer is rank 0's (or rank src's).
    torch.manual_seed(2000 + rank)
    lin_m, emb_m = nn.Linear(k, n), nn.Embedding(V, D)
    ln_m, rms_m = nn.LayerNorm(D), nn.RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        for m in (ln_m, rms_m):
            for p in m.parameters():
                p.uniform_(0.5, 1.5)
    src = world - 1
    for src_rank in (0, src):
        refs = [from_rank(m, src_rank) for m in (lin_m, emb_m, ln_m, rms_m)]
        same_linear(tpx.Linear3D.from_linear(lin_m, mesh, src_rank=src_rank, **mid)
                    if mid else lin.from_linear(lin_m, mesh, src_rank=src_rank), refs[0], hid)
        e = emb.from_embedding(emb_m, mesh, src_rank=src_rank)
        assert torch.equal(local_part(e.weight), refs[1].weight.detach()[:, _norm_slice(D, layout, c, q)])
        nl = ln.from_layernorm(ln_m, mesh, src_rank=src_rank)
        for name in ("weight", "bias"):
            assert torch.equal(local_part(getattr(nl, name)), _norm_block(getattr(refs[2], name).detach(),
                                                              layout, c, q, "output"))
        nr = rms.from_rmsnorm(rms_m, mesh, src_rank=src_rank)
        assert torch.equal(local_part(nr.weight), _norm_block(refs[3].weight.detach(), layout, c, q,
                                                  "output"))
    # Blocks scattered in many small steps (a few rows per step) arrive the same.
    os.environ["TPX_INIT_CHUNK_BYTES"] = str(16 * world)
    try:
        same_linear(lin.from_linear(lin_m, mesh), from_rank(lin_m))
    finally:
        del os.environ["TPX_INIT_CHUNK_BYTES"]

    # Peak memory of a non-source rank: its block plus one step's piece (steps of 8 KiB from
    # the source), far below the full matrix (96 KiB) that the source draws.
    from memtrack import PeakMemory

    os.environ["TPX_INIT_CHUNK_BYTES"] = str(8 << 10)
    try:
        torch.manual_seed(rank)
        with PeakMemory() as m:
            big = lin(256, 96, mesh, bias=False)
    finally:
        del os.environ["TPX_INIT_CHUNK_BYTES"]
    full_bytes, block_bytes = 256 * 96 * 4, local_part(big.weight).numel() * 4
    if rank == 0:
        assert m.peak >= full_bytes, m.peak
    else:
        bound = block_bytes + (8 << 10) // world + (4 << 10)
        assert m.peak <= bound, (rank, m.peak, bound)
    del big

    # src_rank=None with the same seed everywhere: one device's module, no weights moved; the
    # generators stay in step with one device's.
    torch.manual_seed(3000)
    ref, ref_table = nn.Linear(k, n), nn.Embedding(V, D)
    after_ref = torch.randn(4)
    torch.manual_seed(3000)
    layer = lin(k, n, mesh, src_rank=None)
    table = emb(V, D, mesh, src_rank=None)
    assert torch.equal(torch.randn(4), after_ref)
    same_linear(layer, ref)
    assert torch.equal(local_part(table.weight), ref_table.weight.detach()[:, _norm_slice(D, layout, c, q)])
    # ... and with src_rank=0 the source's generator state is handed on.
    torch.manual_seed(3000)
    lin(k, n, mesh)
    emb(V, D, mesh)
    assert torch.equal(torch.randn(4), after_ref), "generator not in step with one device"
    # src_rank=None with different seeds: the checksum differs, on every rank.
    torch.manual_seed(rank)
    _raises_everywhere("initial_weights", lin, k, n, mesh, src_rank=None)
    # an existing module: each rank keeps its blocks of its own, with a warning
    with pytest.warns(UserWarning, match="ranks' modules differ"):
        emb.from_embedding(nn.Embedding(V, D), mesh, src_rank=None)
    # Arguments that differ on one rank raise on every rank, before any weight moves (also
    # when that rank's arguments would fail a local check).
    bad = rank == world - 1
    _raises_everywhere("different arguments", lin, k, n + (q * q if bad else 0), mesh)
    _raises_everywhere("different arguments", lin, k + (1 if bad else 0), n, mesh)
    _raises_everywhere("different arguments", lin, k, n, mesh, src_rank=rank)
    _raises_everywhere("different arguments", ln, D * (2 if bad else 1), mesh)
    _raises_everywhere("different arguments", emb.from_embedding,
                       nn.Embedding(V + (1 if bad else 0), D), mesh)
    _raises_everywhere("`src_rank` must be None or the index of a rank of the mesh", lin, k, n,
                       mesh, src_rank=world)
    if world == 8:
        # A 2-D mesh of 4 ranks inside a data-parallel mesh of 8: src_rank is a rank of the
        # mesh (its first rank by default: global rank 0 or 4), each replica its own.
        from torch.distributed.device_mesh import init_device_mesh

        outer = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "row", "col"))
        sub, dp = outer["row", "col"], outer.get_coordinate()[0]
        torch.manual_seed(4000 + rank)
        layer = tpx.Linear2D(4, 8, sub)
        torch.manual_seed(4000 + 4 * dp)
        ref = nn.Linear(4, 8)
        cs = _coord(sub)
        assert torch.equal(local_part(layer.weight), _weight_block(ref.weight.detach(), "2d", cs, 2))
        assert torch.equal(local_part(layer.bias), _bias_block(ref.bias.detach(), "2d", cs, 2))
        full = tpx.checkpoint.full_state_dict(layer)
        assert torch.equal(full["weight"], ref.weight) and torch.equal(full["bias"], ref.bias)
    t = torch.ones(1)
    dist.all_reduce(t)  # still in step
    assert t.item() == world


def _ckpt_decoder(q, seed):
    """A tiny Llama decoder whose heads divide at 2-D / 3-D (q = 2) and at 1-D TP 4."""
    from tiny_llama import Decoder

    torch.manual_seed(seed)
    model = Decoder(vocab=12 * q * q, dim=8 * q, n_layers=2, n_heads=2 * q, n_kv_heads=2 * q,
                    hidden=4 * q * q)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _same_state(actual, expected, what):
    assert list(actual) == list(expected), (what, list(actual), list(expected))
    for key, value in expected.items():
        assert actual[key].shape == value.shape, (what, key, actual[key].shape, value.shape)
        assert torch.equal(actual[key], value), (what, key)


def _check_checkpoint(rank, world, layout, tmp):
    """full_state_dict / load_full_state_dict / DCP save and load / safetensors at 2-D or 3-D:
    the original model's keys and shapes; a 2-D checkpoint loads at 1-D (TP 4) and on one
    device, a 3-D one on one device, a 1-D one back at 2-D; same logits everywhere."""
    import copy
    import os

    import torch.distributed.checkpoint as dcp

    q, depth, kw = _layout_args(layout, world)
    mesh = tpx.init_mesh(layout, **kw)
    c = _coord(mesh)
    nb = {"2d": q, "2.5d": depth * q, "3d": q * q}[layout]
    ref = _ckpt_decoder(q, 31)
    model = _shard_decoder(copy.deepcopy(ref), mesh, layout)
    # The original keys and full shapes, exactly, on every rank.
    _same_state(tpx.checkpoint.full_state_dict(model), ref.state_dict(), "full_state_dict")
    full0 = tpx.checkpoint.full_state_dict(model, rank0_only=True)
    assert (full0 == {}) == (rank != 0)

    # A fresh full state dict: each rank keeps its blocks of it.
    fresh = {k: v.detach().clone() for k, v in _ckpt_decoder(q, 99).state_dict().items()}
    tpx.checkpoint.load_full_state_dict(model, fresh)
    for name, p in model.named_parameters():
        assert torch.equal(local_part(p), _decoder_block(name, fresh[name], layout, c, q)), name
    _same_state(tpx.checkpoint.full_state_dict(model), fresh, "round trip")
    with pytest.raises(ValueError, match="tok_embeddings.weight has shape"):
        tpx.checkpoint.load_full_state_dict(
            model, dict(fresh, **{"tok_embeddings.weight": torch.zeros(3, 3)}))
    ref.load_state_dict(fresh)
    gen = torch.Generator().manual_seed(500 + world)
    ids = torch.randint(0, ref.output.out_features, (nb, 5), generator=gen)
    out_kw = dict(hidden_mesh_dim=model.output.output_mesh_dim) if layout == "3d" else {}
    with torch.no_grad():
        logits_ref = ref(ids)
        logits = tpx.gather_output(model(tpx.split_input(ids, mesh)), mesh, **out_kw)
    close(logits, logits_ref, f"{layout} logits of the loaded state")

    ckpt = os.path.join(tmp, f"dcp_{layout}")
    tpx.checkpoint.save(model, ckpt)
    # Back into the same layout: a differently initialised model gets the saved blocks.
    back = _shard_decoder(_ckpt_decoder(q, 7), mesh, layout)
    tpx.checkpoint.load(back, ckpt)
    _same_state(tpx.checkpoint.full_state_dict(back), fresh, f"DCP {layout} -> {layout}")

    # On one device: plain torch.distributed.checkpoint into the unsharded Decoder (rank 0
    # alone, without the process group, at 3-D; every rank at 2-D). torch < 2.6 has no
    # no_dist= on dcp.load: there every rank loads.
    alone = layout == "3d" and "no_dist" in inspect.signature(dcp.load).parameters

    def one_device():
        single = _ckpt_decoder(q, 8)
        state = single.state_dict()
        dcp.load(state, checkpoint_id=ckpt, **({"no_dist": True} if alone else {}))
        single.load_state_dict(state)
        with torch.no_grad():
            close(single(ids), logits, f"{layout} checkpoint on one device")

    if layout == "3d":
        if rank == 0 or not alone:
            one_device()
        dist.barrier()
        return
    one_device()

    # At 1-D (TP 4 over the same ranks): tpx.parallelize_module with the example's plan.
    from tiny_llama import tp_plan

    one_d = _ckpt_decoder(q, 9)
    tpx.parallelize_module(one_d, None, tp_plan())
    tpx.checkpoint.load(one_d, ckpt)
    with torch.no_grad():
        close(one_d(ids), logits, "2-D checkpoint loaded at 1-D")
    # ... and a 1-D checkpoint back at 2-D.
    ckpt1 = os.path.join(tmp, "dcp_1d")
    tpx.checkpoint.save(one_d, ckpt1)
    back = _shard_decoder(_ckpt_decoder(q, 10), mesh, layout)
    tpx.checkpoint.load(back, ckpt1)
    _same_state(tpx.checkpoint.full_state_dict(back), fresh, "DCP 1-D -> 2-D")

    # Hugging Face safetensors: each rank reads its blocks.
    from safetensors.torch import save_file

    path = os.path.join(tmp, "model.safetensors")
    if rank == 0:
        save_file({k: v.contiguous() for k, v in fresh.items()}, path)
    dist.barrier()
    hf = _shard_decoder(_ckpt_decoder(q, 11), mesh, layout)
    assert tpx.checkpoint.load_hf_checkpoint(hf, path) == []
    for name, p in hf.named_parameters():
        assert torch.equal(local_part(p), _decoder_block(name, fresh[name], layout, c, q)), name


def _check_ckpt_and_init(rank, world, layout, tmp):
    _check_initial_weights(rank, world, layout)
    _check_checkpoint(rank, world, layout, tmp)


# One group of processes per layout: initial weights from src_rank (and the argument checks),
# then checkpoints (2-D: full/sliced state dicts, DCP 2-D -> 2-D / 1-D / one device, 1-D ->
# 2-D, safetensors; 3-D: state dicts, DCP 3-D -> 3-D / one device).
@pytest.mark.parametrize("layout,world", [("2d", 4), pytest.param("3d", 8, marks=pytest.mark.slow)])
def test_checkpoint_and_initial_weights(tmp_path, layout, world):
    run_ranks(_check_ckpt_and_init, world, layout, str(tmp_path))
