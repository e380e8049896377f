"""``benchmarks/gpubench/moe_bench.py --smoke`` on the CPU (Triton interpreter): both expert paths
run through the kernels, agree with the torch path, and the report renders."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke run only")


@pytest.mark.parametrize("dtype", ["bf16", "ptpc_fp8"])
def test_moe_bench_smoke(tmp_path, dtype):
    from benchmarks.gpubench import moe_bench

    args = ["--smoke", "--device", "cpu", "--tokens", "2", "--dtypes", dtype, "--out", str(tmp_path)]
    assert moe_bench.main(args) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["path"] for r in rows] == ["gemv", "grouped"]
    for r in rows:
        assert "error" not in r, r
        # FP8 in bf16: the GEMV path is w8a16 against the torch path's w8a8, and in the grouped
        # path the interpreter's truncated bf16 intermediates flip e4m3 roundings: FP8 precision
        tol = 2e-2 if dtype == "bf16" else 0.08
        assert r["rel_err_vs_torch"] < tol and r["touched_experts"] >= 2
        assert r["route_align_triton_seconds"] > 0 and r["route_align_torch_seconds"] > 0
    assert f"| {dtype} | 2 | gemv |" in (tmp_path / "results.md").read_text()


def test_moe_bench_split_sweep_smoke(tmp_path):
    """``--sweep-split``: the grouped row carries each GEMM's best configuration (same rows) and
    times no worse than the table's pair it started from."""
    from benchmarks.gpubench import moe_bench

    args = ["--smoke", "--device", "cpu", "--tokens", "5", "--dtypes", "ptpc_fp8", "--sweep-split"]
    assert moe_bench.main(args + ["--out", str(tmp_path)]) == 0
    grouped = [
        r for r in json.loads((tmp_path / "results.json").read_text())["rows"] if r["path"] == "grouped"
    ]
    sweep = grouped[0]["sweep"]
    assert sweep["tried"] == 5  # the tables' pair, then two candidates for each GEMM
    assert sweep["gate_up"]["block_m"] == sweep["down"]["block_m"]
    assert sweep["best_seconds"] <= sweep["default_seconds"]
    assert "gate_up M16" in (tmp_path / "results.md").read_text()


def test_gemv_sweep_row_renders():
    """The GEMV sweep's winners (configurations without ``block_m`` / ``group_m``) render in the
    report (a KeyError on them lost a whole sweep's table in the twenty-sixth session)."""
    from benchmarks.gpubench import moe_bench

    gemv = {"block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 4}
    row = {
        "dtype": "ptpc_fp8", "tokens": 1, "path": "gemv", "graph_seconds": 2.4e-5, "eager_seconds": 2.8e-4,
        "weight_bytes_per_s": 1.6e12, "tflop_per_s": 3.2, "rel_err_vs_torch": 0.049,
        "sweep": {"tried": 3, "default_seconds": 2.2e-5, "best_seconds": 2.1e-5, "gate_up": gemv,
                  "down": {**gemv, "block_n": 16, "block_k": 512}},
    }  # fmt: skip
    text = moe_bench.render(
        {
            "shape": asdict(moe_bench.SMOKE_SHAPE),
            "device": {},
            "copy_bytes_per_s": None,
            "rows": [row],
        }
    )
    assert "experts 21.0 µs (default 22.0, 3 tried): gate_up N32 K256 w4 s4, down N16 K512 w4 s4" in text
