"""Bytes on the wire (benchmarks/bench_bytes.py) are exact: tpx never sends more per rank and
step than PyTorch's tensor parallelism on the same model and plan, as PyTorch runs it, with
and without sequence parallelism (PyTorch's test Transformer, a small configuration)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

import bench_bytes  # noqa: E402


def test_tpx_bytes_not_above_pytorch(tmp_path):
    table = bench_bytes.main(["--tp", "2", "--dim", "64", "--heads", "4", "--seq", "16",
                              "--batch", "2", "--out", str(tmp_path)])
    by = {(r["tp"], r["sequence_parallel"], r["library"]): r for r in table}
    assert len(by) == 4, by
    for sp in (False, True):
        tpx, torch_tp = by[(2, sp, "tpx")]["wire_bytes"], by[(2, sp, "PyTorch TP")]["wire_bytes"]
        assert sum(tpx.values()) <= sum(torch_tp.values()), (sp, tpx, torch_tp)
        assert sum(torch_tp.values()) > 0, torch_tp
        # kind by kind too: no collective of tpx's moves more than PyTorch's of its kind
        for kind, nbytes in tpx.items():
            assert nbytes <= torch_tp.get(kind, 0.0), (sp, kind, tpx, torch_tp)
