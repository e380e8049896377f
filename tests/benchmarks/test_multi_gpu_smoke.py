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


@pytest.mark.slow
def test_multi_gpu_correctness_smoke(tmp_path):
    """The correctness section on the CPU (gloo): the tiny models' greedy tokens at TP=1 and TP=2,
    the tiny MoE with expert parallelism and through ``fastdeploy serve`` at DP=2 + EP, all equal
    (and equal to transformers')."""
    spec = importlib.util.spec_from_file_location("multi_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--device", "cpu", "--smoke", "--sections", "correctness", "--tp", "2", "--out", str(tmp_path)]
    assert module.main(argv) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "results.json").read_text())["correctness"]["rows"]}
    moe = rows["tiny-qwen3-moe"]
    assert "error" not in moe, moe
    assert moe["tp1_equals_tpn"] and moe["tp1_equals_tpn_ep"] and moe["tp1_equals_dpn_ep_served"]
    assert moe["tp1_equals_transformers"] and rows["tiny-llama"]["tp1_equals_tpn"]
