"""Layout mistakes that shapes cannot reveal, in the 2-D, 2.5-D and 3-D layers: each either
computes the unsharded answer (forward and gradients, on fresh random inputs) or raises a
ValueError that says what to change, before any communication.

3-D (8 ranks, one group of processes):
  * the natural MLP, two ``Linear3D.from_linear`` without ``hidden_mesh_dim`` (and a plan of
    two bare ``MeshParallel()``): a clear error; the alternating one matches one device;
  * a second Linear3D built with the first one's ``hidden_mesh_dim`` (through GELU and
    dropout with autograd recording, and directly under ``torch.no_grad()``);
  * an input split with one ``hidden_mesh_dim``, read by a layer built with the other;
  * a norm built with the wrong ``hidden_mesh_dim`` (LayerNorm3D, RMSNorm3D);
  * ``gather_output`` without ``hidden_mesh_dim`` (takes the recorded layout), with a wrong
    one, and on a tensor whose layout is unknown;
  * a residual add of two layouts;
  * ids split with one ``hidden_mesh_dim``, looked up by an Embedding3D built with the other;
  * a mesh over the same ranks with the "weight" and "output" dims swapped in rank order,
    mixed with ``tpx.init_mesh``'s (and used alone: matches one device);
  * a mesh whose dimension names are in another order.
2-D (4 ranks): a transposed mesh mixed with ``init_mesh``'s (Linear2D, LayerNorm2D,
gather_output), used alone; names in another order.
2.5-D (3 ranks, depth 3): a mesh with the depth order reversed mixed with ``init_mesh``'s.

Every check runs even when an earlier one fails (the failures are listed together), and
every rank runs the same collectives whatever the outcome, so a failing check cannot hang.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import tpx
from harness import local_vs, run_ranks
from tpx.parallel.mesh_styles import MeshInput, MeshParallel


def _coord(mesh):
    return dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))


def _act(full, mesh, hidden="output", ids=False):
    """This rank's block of a full activation [B, ..., H] (or of ids [B, ...]), cut by hand
    from the placements the layers document."""
    c, names = _coord(mesh), mesh.mesh_dim_names
    q = mesh.shape[-1]
    if names == ("row", "col"):
        bi, bn, hi = c["row"], q, c["col"]
    elif names == ("depth", "row", "col"):
        bi, bn, hi = c["depth"] * q + c["row"], mesh.shape[0] * q, c["col"]
    else:
        other = "weight" if hidden == "output" else "output"
        bi, bn, hi = c["input"] * q + c[other], q * q, c[hidden]
    b = full.shape[0] // bn
    out = full.narrow(0, bi * b, b)
    if ids:
        return out
    h = full.shape[-1] // q
    return out.narrow(-1, hi * h, h)


def _w3(w, mesh, hidden):
    """The block of an nn.Linear weight [out, in] held by this rank of a Linear3D."""
    c, q = _coord(mesh), mesh.shape[0]
    other = "weight" if hidden == "output" else "output"
    n, k = w.shape
    r, h, nl = c[other] * q + c["input"], c[hidden], n // (q * q)
    return w[r * nl:(r + 1) * nl, h * k // q:(h + 1) * k // q]


def _b3(b, mesh, hidden):
    c, q = _coord(mesh), mesh.shape[0]
    j, n = c["weight" if hidden == "output" else "output"], b.shape[0]
    return b[j * n // q:(j + 1) * n // q]


def _w2(w, mesh):
    """The block of an nn.Linear weight held by this rank of a Linear2D / Linear2p5D."""
    c, q = _coord(mesh), mesh.shape[-1]
    n, k = w.shape
    i, j = c["row"], c["col"]
    return w[j * n // q:(j + 1) * n // q, i * k // q:(i + 1) * k // q]


def _close(actual, expected, what, problems):
    actual = local_vs(actual, expected)
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        problems.append(f"{what}: {str(e).splitlines()[0]} {str(e).splitlines()[-1]}")


def _raises(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _run_checks(checks, *args):
    """Runs every check; the ranks agree on which failed (one all-reduce per check) and the
    failures are reported together."""
    failed = []
    for check in checks:
        problems = []
        try:
            check(*args, problems)
        except (Exception, pytest.fail.Exception) as e:  # reported below, with the check
            problems.append(f"{type(e).__name__}: {e}")
        flag = torch.tensor([1.0 if problems else 0.0])
        dist.all_reduce(flag)
        if flag.item():
            failed.append(f"{check.__name__}: {problems or 'failed on another rank'}")
    assert not failed, "\n".join(failed)


# 3-D -------------------------------------------------------------------------------------------

H, FFN, V = 8, 16, 12  # q = 2: features divide by q, out_features by q^2 = 4


def _mlp(seed):
    torch.manual_seed(seed)  # the same modules on every rank
    return nn.Linear(H, FFN), nn.Linear(FFN, H)


def _draw(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _natural_mlp_raises(mesh, gen, problems):
    """fc1, fc2 = Linear3D.from_linear(fc, mesh) x 2 (no hidden_mesh_dim): today the second
    reads the first one's output in the wrong layout (tens of percent relative error, no
    error)."""
    fc1, fc2 = _mlp(1)
    msg = r"pass `hidden_mesh_dim`.*Consecutive Linear3D layers alternate"
    _raises(msg, tpx.Linear3D.from_linear, fc1, mesh)
    _raises(msg, tpx.Linear3D.from_linear, fc2, mesh)
    _raises(msg, tpx.Linear3D, FFN, H, mesh)
    _raises(msg, tpx.Linear3D, FFN, H, mesh, chunks=2)


def _alternating_mlp_matches(mesh, gen, problems):
    """Linear3D('output') -> GELU -> Linear3D('weight'): the alternation the errors ask for
    matches one device, forward and every gradient."""
    fc1, fc2 = _mlp(2)
    s1 = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="output")
    s2 = tpx.Linear3D.from_linear(fc2, mesh, hidden_mesh_dim="weight")
    x_full, gy = _draw(gen, 8, 3, H), _draw(gen, 8, 3, H)
    xr = x_full.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(xr)))
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    y = tpx.gather_output(s2(F.gelu(s1(tpx.split_input(xs, mesh)))), mesh)
    (y * gy).sum().backward()
    _close(y, ref.detach(), "MLP output", problems)
    _close(xs.grad, xr.grad, "MLP input grad", problems)
    _close(s1.weight.grad, _w3(fc1.weight.grad, mesh, "output"), "fc1.weight grad", problems)
    _close(s1.bias.grad, _b3(fc1.bias.grad, mesh, "output"), "fc1.bias grad", problems)
    _close(s2.weight.grad, _w3(fc2.weight.grad, mesh, "weight"), "fc2.weight grad", problems)
    _close(s2.bias.grad, _b3(fc2.bias.grad, mesh, "weight"), "fc2.bias grad", problems)


def _second_layer_same_hidden_raises(mesh, gen, problems):
    """fc2 built with hidden_mesh_dim='output' like fc1: its input is split by 'weight'."""
    fc1, fc2 = _mlp(3)
    s1 = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="output")
    s2 = tpx.Linear3D.from_linear(fc2, mesh, hidden_mesh_dim="output")
    x = tpx.split_input(_draw(gen, 8, H).requires_grad_(True), mesh)
    msg = r"features by 'weight'.*hidden_mesh_dim='weight'.*alternate"
    # Through GELU and dropout (autograd records them), and a view.
    _raises(msg, s2, F.dropout(F.gelu(s1(x)), 0.1).view(-1, FFN // 2))
    with torch.no_grad():  # passed on directly: the tensor's own record
        _raises(msg, s2, s1(x))


def _split_with_other_hidden(mesh, gen, problems):
    """An input split with hidden_mesh_dim='weight' read by Linear3D('output') raises; read
    by Linear3D('weight') it matches one device."""
    fc1, _ = _mlp(4)
    s1 = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="output")
    s1w = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="weight")
    x_full = _draw(gen, 8, H)
    xw = tpx.split_input(x_full, mesh, hidden_mesh_dim="weight")
    _raises(r"features by 'weight'.*hidden_mesh_dim='weight'", s1, xw)
    _raises(r"features by 'output'.*hidden_mesh_dim='output'", s1w, tpx.split_input(x_full, mesh))
    xr = x_full.clone().requires_grad_(True)
    ref = fc1(xr)
    gy = _draw(gen, 8, FFN)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    y = s1w(tpx.split_input(xs, mesh, hidden_mesh_dim="weight"))
    _close(y, _act(ref.detach(), mesh, "output"), "Linear3D('weight') output block", problems)
    (y * _act(gy, mesh, "output")).sum().backward()
    _close(xs.grad, xr.grad, "input grad (through split_input)", problems)
    _close(s1w.weight.grad, _w3(fc1.weight.grad, mesh, "weight"), "weight grad", problems)


def _norm_with_wrong_hidden(mesh, gen, problems):
    """A norm after a Linear3D('output') reads features split by 'weight'; built with the
    default 'output' it raises, built with 'weight' it matches one device."""
    fc1, _ = _mlp(5)
    torch.manual_seed(6)
    ln, rms = nn.LayerNorm(FFN), nn.RMSNorm(FFN, eps=1e-6)
    with torch.no_grad():
        for p in [*ln.parameters(), *rms.parameters()]:
            p.copy_(1 + 0.3 * torch.randn(p.shape))
    s1 = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="output")
    x_full = _draw(gen, 8, H)
    x = tpx.split_input(x_full, mesh)
    ln_bad = tpx.LayerNorm3D.from_layernorm(ln, mesh)
    rms_bad = tpx.RMSNorm3D.from_rmsnorm(rms, mesh, hidden_mesh_dim="output")
    msg = r"features by 'weight'.*hidden_mesh_dim='weight'"
    with torch.no_grad():
        _raises(msg, ln_bad, s1(x))
    _raises(msg, rms_bad, F.gelu(s1(x.detach().requires_grad_(True))))
    # Built right: LayerNorm3D('weight') after the Linear, forward and gradients.
    ln_ok = tpx.LayerNorm3D.from_layernorm(ln, mesh, hidden_mesh_dim="weight")
    rms_ok = tpx.RMSNorm3D.from_rmsnorm(rms, mesh, hidden_mesh_dim="weight")
    xr = x_full.clone().requires_grad_(True)
    ref = rms(F.gelu(ln(fc1(xr))))
    gy = _draw(gen, 8, FFN)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    y = tpx.gather_output(rms_ok(F.gelu(ln_ok(s1(tpx.split_input(xs, mesh))))), mesh)
    (y * gy).sum().backward()
    _close(y, ref.detach(), "norms after Linear3D output", problems)
    _close(xs.grad, xr.grad, "norms after Linear3D input grad", problems)
    c, q = _coord(mesh), 2
    j = c["weight"]
    for name, mine, full in (("ln.weight", ln_ok.weight, ln.weight), ("ln.bias", ln_ok.bias,
                             ln.bias), ("rms.weight", rms_ok.weight, rms.weight)):
        _close(mine.grad, full.grad[j * FFN // q:(j + 1) * FFN // q], f"{name} grad", problems)


def _gather_output_layouts(mesh, gen, problems):
    """gather_output with a hidden_mesh_dim other than the recorded one raises; without one,
    on a tensor whose layout is unknown (other ops under no_grad), it asks for it."""
    fc1, _ = _mlp(7)
    s1 = tpx.Linear3D.from_linear(fc1, mesh, hidden_mesh_dim="output")
    x = tpx.split_input(_draw(gen, 8, H), mesh)
    with torch.no_grad():
        y = s1(x)
        # Not named: the recorded layout ('weight') is used (today: 'output' was assumed,
        # and the blocks were put in the wrong places).
        _close(tpx.gather_output(y, mesh), fc1(tpx.gather_output(x, mesh)),
               "gather_output of a Linear3D('output') output", problems)
        _raises(r"features by 'weight'.*hidden_mesh_dim='weight'", tpx.gather_output, y, mesh,
                hidden_mesh_dim="output")
        _raises(r"pass `hidden_mesh_dim` for a 3-D activation whose layout is not recorded",
                tpx.gather_output, F.gelu(y), mesh)
        # Named, it is taken as given (and right).
        full = tpx.gather_output(F.gelu(y), mesh, hidden_mesh_dim="weight")
    _close(full, F.gelu(fc1(tpx.gather_output(x, mesh))).detach(), "gather of gelu(y)",
           problems)
    # split_input of a block already split over this mesh.
    _raises(r"already this rank's block", tpx.split_input, x, mesh)


def _residual_of_two_layouts(mesh, gen, problems):
    """x + proj(x) with proj a Linear3D H -> H: proj's output is split by 'weight', x by
    'output' (same shape); the norm reading the sum raises."""
    torch.manual_seed(8)
    proj, ln = nn.Linear(H, H), nn.LayerNorm(H)
    sp = tpx.Linear3D.from_linear(proj, mesh, hidden_mesh_dim="output")
    sln = tpx.LayerNorm3D.from_layernorm(ln, mesh)
    x = tpx.split_input(_draw(gen, 8, H).requires_grad_(True), mesh)
    _raises(r"combines tensors in different layouts.*hidden_mesh_dim", sln, x + sp(x))


def _ids_split_with_other_hidden(mesh, gen, problems):
    """Embedding3D('weight') reads ids split by ('input', 'output'): ids split with the
    default raise; split with 'weight' the lookup (gathered without naming the layout)
    matches nn.Embedding."""
    torch.manual_seed(9)
    emb = nn.Embedding(V, H)
    semb = tpx.Embedding3D.from_embedding(emb, mesh, hidden_mesh_dim="weight")
    ids = torch.randint(0, V, (8, 3), generator=gen)
    _raises(r"token ids .*hidden_mesh_dim", semb, tpx.split_input(ids, mesh))
    out = semb(tpx.split_input(ids, mesh, hidden_mesh_dim="weight"))
    y = tpx.gather_output(out, mesh)
    gy = _draw(gen, 8, 3, H)
    ref = emb(ids)
    (ref * gy).sum().backward()
    (y * gy).sum().backward()
    _close(y, ref.detach(), "Embedding3D('weight') gathered", problems)
    j = _coord(mesh)["weight"]
    _close(semb.weight.grad, emb.weight.grad[:, j * H // 2:(j + 1) * H // 2],
           "Embedding3D grad", problems)


def _swapped_mesh(mesh, gen, problems):
    """A mesh over the same 8 ranks, named as init_mesh's, whose 'weight' and 'output' dims
    are swapped in rank order: mixed with init_mesh's it raises; alone it matches one
    device."""
    ranks = torch.arange(8).reshape(2, 2, 2).permute(0, 2, 1).contiguous()
    other = DeviceMesh("cpu", ranks, mesh_dim_names=("input", "weight", "output"))
    fc1, fc2 = _mlp(10)
    s1 = tpx.Linear3D.from_linear(fc1, other, hidden_mesh_dim="output")
    s2 = tpx.Linear3D.from_linear(fc2, other, hidden_mesh_dim="weight")
    x_full = _draw(gen, 8, H)
    msg = r"different device mesh"
    _raises(msg, s1, tpx.split_input(x_full.clone().requires_grad_(True), mesh))
    with torch.no_grad():
        _raises(msg, tpx.gather_output, s1(tpx.split_input(x_full, other)), mesh)
    xr = x_full.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(xr)))
    gy = _draw(gen, 8, H)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    y = tpx.gather_output(s2(F.gelu(s1(tpx.split_input(xs, other)))), other)
    (y * gy).sum().backward()
    _close(y, ref.detach(), "MLP over the swapped mesh", problems)
    _close(xs.grad, xr.grad, "MLP over the swapped mesh, input grad", problems)
    _close(s2.weight.grad, _w3(fc2.weight.grad, other, "weight"), "swapped fc2 grad", problems)


def _names_in_other_order(mesh, gen, problems):
    sub = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("input", "output", "weight"))
    _raises(r"dimension names \('input', 'weight', 'output'\)", tpx.Linear3D, H, FFN, sub,
            hidden_mesh_dim="output")
    _raises(r"dimension names", tpx.split_input, _draw(gen, 8, H), sub)


def _plan_of_bare_mesh_parallel(mesh, gen, problems):
    """{"0": MeshParallel(), "2": MeshParallel()} on Linear-GELU-Linear at 3-D: a clear error
    (today: wrong logits); with hidden_mesh_dim 'output' / 'weight' it matches one device; with
    'output' twice the second layer raises at the call."""
    import copy

    fc1, fc2 = _mlp(11)
    ref = nn.Sequential(fc1, nn.GELU(), fc2)
    bad = {"": MeshInput(), "0": MeshParallel(), "2": MeshParallel(gather_output=True)}
    _raises(r"needs MeshParallel\(hidden_mesh_dim=\.\.\.\).*alternate",
            tpx.parallelize_module, copy.deepcopy(ref), mesh, bad)
    good = {"": MeshInput(), "0": MeshParallel(hidden_mesh_dim="output"),
            "2": MeshParallel(hidden_mesh_dim="weight", gather_output=True)}
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh, good)
    x = _draw(gen, 8, 3, H)
    gy = _draw(gen, 8, 3, H)
    (ref(x) * gy).sum().backward()
    y = model(x)
    (y * gy).sum().backward()
    _close(y, ref(x).detach(), "plan output", problems)
    _close(model[0].weight.grad, _w3(fc1.weight.grad, mesh, "output"), "plan fc1 grad", problems)
    _close(model[2].weight.grad, _w3(fc2.weight.grad, mesh, "weight"), "plan fc2 grad", problems)
    twice = {"": MeshInput(), "0": MeshParallel(hidden_mesh_dim="output"),
             "2": MeshParallel(hidden_mesh_dim="output", gather_output=True)}
    model = tpx.parallelize_module(copy.deepcopy(ref), mesh, twice)
    _raises(r"hidden_mesh_dim='weight'", model, x)


def _check_3d(rank, world):
    mesh = tpx.init_mesh("3d")
    gen = torch.Generator().manual_seed(1234)
    _run_checks([_natural_mlp_raises, _alternating_mlp_matches, _second_layer_same_hidden_raises,
                 _split_with_other_hidden, _norm_with_wrong_hidden, _gather_output_layouts,
                 _residual_of_two_layouts, _ids_split_with_other_hidden, _swapped_mesh,
                 _names_in_other_order, _plan_of_bare_mesh_parallel], mesh, gen)


def test_3d_layout_mistakes():
    run_ranks(_check_3d, 8)


# 2-D and 2.5-D ------------------------------------------------------------------------------


def _transposed_2d_mesh(mesh, gen, problems):
    """A 2 x 2 mesh named ("row", "col") whose rank grid is init_mesh's transposed: a tensor
    split over one and read (Linear2D, LayerNorm2D) or gathered over the other raises; the
    transposed mesh alone matches one device."""
    other = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T.contiguous(),
                       mesh_dim_names=("row", "col"))
    torch.manual_seed(20)
    lin, ln = nn.Linear(6, 4), nn.LayerNorm(4)
    s_other = tpx.Linear2D.from_linear(lin, other)
    ln_other = tpx.LayerNorm2D.from_layernorm(ln, other)
    x_full = _draw(gen, 4, 3, 6)
    x = tpx.split_input(x_full, mesh)
    _raises("different device mesh", s_other, x)
    _raises("different device mesh", ln_other, tpx.Linear2D.from_linear(lin, mesh)(x))
    _raises("different device mesh", tpx.gather_output, x, other)
    xr = x_full.clone().requires_grad_(True)
    ref = ln(lin(xr))
    gy = _draw(gen, 4, 3, 4)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    y = tpx.gather_output(ln_other(s_other(tpx.split_input(xs, other))), other)
    (y * gy).sum().backward()
    _close(y, ref.detach(), "2-D over the transposed mesh", problems)
    _close(xs.grad, xr.grad, "2-D over the transposed mesh, input grad", problems)
    _close(s_other.weight.grad, _w2(lin.weight.grad, other), "2-D weight grad", problems)


def _names_swapped_2d(mesh, gen, problems):
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("col", "row"))
    _raises(r"dimension names \('row', 'col'\)", tpx.Linear2D, 4, 4, swapped)
    _raises(r"dimension names", tpx.split_input, _draw(gen, 4, 4), swapped)


def _check_2d(rank, world):
    mesh = tpx.init_mesh("2d")
    gen = torch.Generator().manual_seed(4321)
    _run_checks([_transposed_2d_mesh, _names_swapped_2d], mesh, gen)


def test_2d_layout_mistakes():
    run_ranks(_check_2d, 4)


def _transposed_2p5d_mesh(mesh_2d, gen, problems):
    """2.5-D over 4 ranks (depth 1, q = 2) with the row / col rank grid transposed: a block
    split over init_mesh's mesh read by a Linear2p5D of the other one, or gathered over it,
    raises; the other mesh alone matches one device."""
    mesh = tpx.init_mesh("2.5d", depth=1)
    other = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T.reshape(1, 2, 2).contiguous(),
                       mesh_dim_names=("depth", "row", "col"))
    torch.manual_seed(30)
    lin = nn.Linear(6, 4)
    s_other = tpx.Linear2p5D.from_linear(lin, other)
    x_full = _draw(gen, 4, 6)
    _raises("different device mesh", s_other, tpx.split_input(x_full, mesh))
    with torch.no_grad():
        y = tpx.Linear2p5D.from_linear(lin, mesh)(tpx.split_input(x_full, mesh))
        _raises("different device mesh", tpx.gather_output, y, other)
    xr = x_full.clone().requires_grad_(True)
    ref = lin(xr)
    gy = _draw(gen, 4, 4)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    out = tpx.gather_output(s_other(tpx.split_input(xs, other)), other)
    (out * gy).sum().backward()
    _close(out, ref.detach(), "2.5-D over the transposed mesh", problems)
    _close(xs.grad, xr.grad, "2.5-D input grad", problems)
    _close(s_other.weight.grad, _w2(lin.weight.grad, other), "2.5-D weight grad", problems)


def _descending_2d_mesh(mesh, gen, problems):
    """A mesh listing the ranks of a dim in decreasing order: the collectives order blocks by
    group rank, the layers by mesh coordinate (today: wrong numbers even when the mesh is
    used alone); now every layer and split_input raise."""
    other = DeviceMesh("cpu", torch.tensor([[1, 0], [3, 2]]), mesh_dim_names=("row", "col"))
    _raises(r"ranks must increase along each dimension.*along 'col'", tpx.Linear2D, 4, 4, other)
    _raises(r"ranks must increase", tpx.split_input, _draw(gen, 4, 4), other)


def _check_2d(rank, world):
    mesh = tpx.init_mesh("2d")
    gen = torch.Generator().manual_seed(4321)
    _run_checks([_transposed_2d_mesh, _names_swapped_2d, _descending_2d_mesh,
                 _transposed_2p5d_mesh], mesh, gen)


def test_2d_layout_mistakes():
    run_ranks(_check_2d, 4)


def _reversed_depth_mesh(mesh, gen, problems):
    """2.5-D over 3 ranks (depth 3, q = 1) with the depth order reversed: today Linear2p5D ->
    gather_output over that mesh alone returns the batch blocks in the wrong order (about
    1600 % relative error); now the mesh is refused. init_mesh's mesh matches one device."""
    other = DeviceMesh("cpu", torch.arange(3).flip(0).reshape(3, 1, 1),
                       mesh_dim_names=("depth", "row", "col"))
    torch.manual_seed(30)
    lin = nn.Linear(5, 4)
    _raises(r"ranks must increase.*along 'depth'", tpx.Linear2p5D.from_linear, lin, other)
    _raises(r"ranks must increase.*along 'depth'", tpx.split_input, _draw(gen, 6, 5), other)
    s = tpx.Linear2p5D.from_linear(lin, mesh)
    x_full = _draw(gen, 6, 5)
    xr = x_full.clone().requires_grad_(True)
    ref = lin(xr)
    gy = _draw(gen, 6, 4)
    (ref * gy).sum().backward()
    xs = x_full.clone().requires_grad_(True)
    out = tpx.gather_output(s(tpx.split_input(xs, mesh)), mesh)
    (out * gy).sum().backward()
    _close(out, ref.detach(), "2.5-D depth 3", problems)
    _close(xs.grad, xr.grad, "2.5-D depth 3 input grad", problems)
    _close(s.weight.grad, lin.weight.grad, "2.5-D depth 3 weight grad", problems)
    _close(s.bias.grad, lin.bias.grad, "2.5-D depth 3 bias grad", problems)


def _check_2p5d(rank, world):
    mesh = tpx.init_mesh("2.5d", depth=3)
    gen = torch.Generator().manual_seed(99)
    _run_checks([_reversed_depth_mesh], mesh, gen)


def test_2p5d_layout_mistakes():
    run_ranks(_check_2p5d, 3)
