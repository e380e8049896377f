"""``benchmarks/structured_outputs.py`` on the CPU: a tiny run's JSON line carries the engine loop's
phase times and the step trace's fields, and they add up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_phases_and_first_steps():
    env = {**os.environ, "FD_STEP_TRACE": "1", "FD_GRAMMAR_PRIME_LENGTH": "0", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "structured_outputs.py"), "--num-requests", "4"]
    command += ["--output-len", "8", "--dtype", "float32", "--json", "--repeat-structured"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["structured_requests"] == 2 and result["output_tokens"] > 0
    assert 0 < result["throughput_ratio"] < 5
    for run, wall_s in [
        ("structured", result["structured_s"]),
        ("unconstrained", result["unconstrained_s"]),
        ("cached_grammars", result["cached_grammars_structured_s"]),
    ]:
        phases = result[f"phases_ms_{run}"]
        # the core's step holds the worker's execution; the two add up to the run's wall time
        assert 0 < phases["execute"] <= phases["step"] <= wall_s * 1000
        assert abs(phases["step"] + phases["outside_step"] - wall_s * 1000) < 1
        assert 0 <= result[f"first_execute_start_ms_{run}"] <= result[f"first_launch_ms_{run}"]
        assert result[f"first_steps_{run}"] and all(ms > 0 for _, ms in result[f"first_steps_{run}"])
    # only the structured runs advance matchers and fill masks
    assert result["phases_ms_structured"]["start_mask"] > 0
    assert result["phases_ms_unconstrained"]["start_mask"] == 0
