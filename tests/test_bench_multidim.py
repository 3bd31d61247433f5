"""The communication derivation of benchmarks/bench_multidim.py against tpx.comm_stats() at one
small configuration (2-D, 1-D and 2.5-D with depth 1 on 4 ranks), and against the closed forms
its docstring states, so neither can drift from what the layers do."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import bench_multidim as bm  # noqa: E402
from harness import run_ranks  # noqa: E402

SHAPE = dict(batch=4, seq=3, hidden=16, heads=4)


def _check_measured_equals_derived(rank, world):
    import tpx

    results = {}
    for layout, depth in (("2d", None), ("1d", None), ("2.5d", 1)):
        mesh = tpx.init_mesh(layout, **({"depth": depth} if depth else {}))
        for block in bm.BLOCKS:
            # measure_case raises on every rank when a count, a byte, a parameter or activation
            # size, or a numerical result differs.
            r = bm.measure_case(layout, depth, block, mesh, SHAPE)
            assert r["measured_comm"] == r["derived_comm"] and r["measured_comm"], r
            results[(layout, block)] = r
    # The 2.5-D code path with a depth of one costs exactly what 2-D costs.
    for block in bm.BLOCKS:
        assert results[("2.5d", block)]["measured_comm"] == results[("2d", block)][
            "measured_comm"]
    # A derivation that is off by one byte is caught, loudly.
    mesh = tpx.init_mesh("2d")
    real = bm.derive

    def off_by_one(*args, **kw):
        d = real(*args, **kw)
        key = next(iter(d["comm"]))
        calls, nbytes = d["comm"][key]
        d["comm"][key] = (calls, nbytes + 1)
        return d

    bm.derive = off_by_one
    try:
        with pytest.raises(AssertionError, match="differ from the derivation"):
            bm.measure_case("2d", None, "mlp", mesh, SHAPE)
    finally:
        bm.derive = real


def test_measured_equals_derived_p4():
    run_ranks(_check_measured_equals_derived, 4)


@pytest.mark.parametrize("q", [2, 3, 4])
def test_closed_forms(q):
    """The docstring's closed forms (MLP block, F = 4H, f = 4 bytes) equal the derivation."""
    n, h, f = 24 * 3, 144, 4
    ffn = 4 * h
    shape = dict(batch=24, seq=3, hidden=h, heads=24)
    # 1-D: two all-reduces of [N, H].
    d = bm.derive("1d", "mlp", q * q, **shape, chunks=1)
    assert bm.totals(d["comm"]) == (2, 2 * n * h * f)
    # 2-D: (4N + 3N(H+F) + 6HF + 3H + F) f / q bytes in 12q + 5 collectives.
    d = bm.derive("2d", "mlp", q * q, **shape)
    want = (4 * n + 3 * n * (h + ffn) + 6 * h * ffn + 3 * h + ffn) * f // q
    assert bm.totals(d["comm"]) == (12 * q + 5, want)
    # 2.5-D with depth 2: 2-D on N/2 rows per layer, plus the depth all-reduces.
    d = bm.derive("2.5d", "mlp", 2 * q * q, 2, **shape)
    m = n // (2 * q)
    want = (4 * m + 3 * m * (h + ffn) + (6 * h * ffn + 3 * h + ffn) // q
            + (2 * h + ffn + h) // q + 2 * h * ffn // (q * q)) * f
    assert bm.totals(d["comm"]) == (12 * q + 5 + 5, want)
    # 3-D (q = 2 divides the shape): (4N/q^2 + 4N(H+F)/q^3 + 4HF/q^3 + (5H+F)/q) f.
    if q == 2:
        d = bm.derive("3d", "mlp", q ** 3, **shape, chunks=1)
        want = (4 * n // q ** 2 + 4 * n * (h + ffn) // q ** 3 + 4 * h * ffn // q ** 3
                + (5 * h + ffn) // q) * f
        assert bm.totals(d["comm"]) == (18, want)
    # Sizes that do not divide are reported, not silently rounded.
    with pytest.raises(bm.NotApplicable, match="heads / P"):
        bm.derive("1d", "attn", 9, **shape)
