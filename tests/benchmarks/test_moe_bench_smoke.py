"""``benchmarks/gpubench/moe_bench.py --smoke`` on the CPU (Triton interpreter): both expert paths
run through the kernels, agree with the torch path, and the report renders."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke run only")


def test_moe_bench_smoke(tmp_path):
    from benchmarks.gpubench import moe_bench

    assert (
        moe_bench.main(
            ["--smoke", "--device", "cpu", "--tokens", "2", "--dtypes", "bf16", "--out", str(tmp_path)]
        )
        == 0
    )
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["path"] for r in rows] == ["gemv", "grouped"]
    for r in rows:
        assert "error" not in r, r
        assert r["rel_err_vs_torch"] < 2e-2 and r["touched_experts"] >= 2
        assert r["route_align_triton_seconds"] > 0 and r["route_align_torch_seconds"] > 0
    assert "| bf16 | 2 | gemv |" in (tmp_path / "results.md").read_text()
