"""``benchmarks/multi_gpu.py --smoke`` on the CPU: the tp and moe sections run the tiny engines
(TP=1 and TP=2 with expert parallelism over gloo) and the report renders their numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_gpu.py"


@pytest.mark.slow
def test_multi_gpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("multi_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (
        module.main(
            [
                "--device",
                "cpu",
                "--smoke",
                "--sections",
                "moe",
                "--moe-quantizations",
                "none",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "results.json").read_text())["moe"]["rows"]
    assert [(r["tp"], r.get("enable_expert_parallel", False)) for r in rows] == [(1, False), (2, True)]
    assert all("error" not in r and r["output_tok_per_s"] > 0 for r in rows), rows
    assert "qwen3-30b-a3b | tp=2, enable_expert_parallel=True |" in capsys.readouterr().out
