"""``benchmarks/gpubench/first_burst.py`` on the CPU with a tiny model: one line and one host profile
per burst."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpubench.settings import TINY_OVERRIDES  # noqa: E402


def test_each_burst_reports_its_first_step_and_its_profile():
    command = [sys.executable, "-m", "benchmarks.gpubench.first_burst", "--device", "cpu"]
    command += ["--num-prompts", "8", "--bursts", "2", "--hf-config-overrides", json.dumps(TINY_OVERRIDES)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = re.findall(r"^burst (\d): first step ([\d.]+) ms, burst ([\d.]+) ms$", done.stdout, re.M)
    assert [n for n, _, _ in lines] == ["1", "2"]
    assert all(0 < float(first) <= float(total) for _, first, total in lines)
    assert done.stdout.count("Ordered by: internal time") == 2  # each first step's cProfile table
