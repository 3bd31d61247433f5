"""benchmarks/bench_memory.py in its quick mode (the example's Decoder() on one device and at
TP 2, with and without sequence parallelism; its vocabulary of 1003 splits unevenly over two
ranks): the losses equal the unsharded model's, and on every rank the measured parameter,
gradient and Adam bytes equal the ones derived from the layout, exactly; the derivation's
parameter counts against the unsharded model's own."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import bench_memory as bm  # noqa: E402


def test_quick_run_measured_equals_derived(tmp_path):
    args = bm.parse_args(["--quick", "--timeout", "120", "--out", str(tmp_path / "m.json"),
                          "--plot", str(tmp_path / "m.png")])
    bm.run(args)  # raises (SystemExit) when a rank's loss differs from the unsharded one
    data = json.loads((tmp_path / "m.json").read_text())
    rows = data["results"]
    assert [(r["world"], r["layout"], r["sequence_parallel"]) for r in rows] == [
        (1, "1d", False), (2, "1d", False), (2, "1d", True)]
    assert (tmp_path / "m.png").stat().st_size > 0
    for r in rows:
        assert len(r["ranks"]) == r["world"]
        for rk in r["ranks"]:
            what = f"{r['layout']} sp={r['sequence_parallel']} P={r['world']} rank {rk['rank']}"
            # The correctness check: the losses the benchmark compared, compared again here.
            ref = rk["reference_losses"]
            torch.testing.assert_close(torch.tensor(rk["losses"][:2], dtype=torch.float64),
                                       torch.tensor([ref[0]] * 2, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(torch.tensor(rk["losses"][2], dtype=torch.float64),
                                       torch.tensor(ref[1], dtype=torch.float64),
                                       rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
            der = rk["derived"]
            for k in ("params", "grads", "adam"):
                assert rk[k] == der[k], (what, k, rk[k], der[k])
            assert rk["params_local"] == der["params"], what
            assert rk["activations"] == der["activations"], what
        assert r["summary"]["state_exact"] and r["summary"]["activations_exact"]
    # The uneven vocabulary: the two ranks hold different numbers of bytes.
    tp2 = rows[1]["ranks"]
    assert tp2[0]["params"] - tp2[1]["params"] == 2 * 32 * 4  # one vocabulary row, two tables
    # Sharding halves (about) what a rank holds.
    assert rows[1]["summary"]["state"] < 0.52 * rows[0]["summary"]["state"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_derived_parameters_add_up(world):
    """1-D: the ranks' derived parameters add up to the model's, plus the norms every rank
    holds; P = 1: exactly the Decoder's own parameter count (4 bytes each)."""
    sys.path.insert(0, str(bm.HERE.parent / "examples"))
    from tiny_llama import Decoder

    cfg = dict(bm.MODELS["quick"]["model"], n_heads=12, n_kv_heads=12, dim=36)  # 3 divides
    total = sum(p.numel() for p in Decoder(**cfg).parameters()) * 4
    norms = (2 * cfg["n_layers"] + 1) * cfg["dim"] * 4
    got = [bm.derive(cfg, 4, 12, "1d", world, r)["params"] for r in range(world)]
    assert sum(got) == total + (world - 1) * norms
    d = bm.derive(cfg, 4, 12, "1d", world, 0)
    assert d["grads"] == d["params"]
    assert d["adam"] == 2 * d["params"] + 4 * (2 + 9 * cfg["n_layers"] + 1)


def test_derived_multidim_parameters():
    """2-D and 3-D on a 2-wide mesh: every Linear and the head in q^2 (2-D) or q^3 (3-D)
    blocks, the embedding and the norms in q blocks."""
    cfg = dict(bm.MODELS["tiny"]["model"])
    D, F, V, L = cfg["dim"], cfg["hidden"], cfg["vocab"], cfg["n_layers"]
    kv = cfg["n_kv_heads"] * D // cfg["n_heads"]
    linears = L * (2 * D * D + 2 * kv * D + 3 * D * F)
    norms = (2 * L + 1) * D
    assert bm.derive(cfg, 4, 16, "2d", 4, 0)["params"] == 4 * (
        (linears + V * D) // 4 + (V * D + norms) // 2)
    assert bm.derive(cfg, 4, 16, "3d", 8, 0)["params"] == 4 * (
        (linears + V * D) // 8 + (V * D + norms) // 2)
    with pytest.raises(ValueError, match="vocab / q"):
        bm.derive(dict(cfg, vocab=1003), 4, 16, "2d", 4, 0)
