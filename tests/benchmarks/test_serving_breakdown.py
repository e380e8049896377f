"""``benchmarks/serving_breakdown.py`` runs at a toy size: a ratio, CPU per token and every stage."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_prints_ratio_cpu_and_stages():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "benchmarks/serving_breakdown.py", "--model", "tiny", "--num-prompts", "8",
           "--input-len", "16", "--output-len", "4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert float(re.search(r"online / offline:\s+([\d.]+)", out).group(1)) > 0
    for process in ("api_server", "engine_core"):
        assert re.search(rf"{process} CPU per output token: [\d.]+ us", out), out
    assert "per-request stages (8 requests)" in out
    for stage in ("tokenize", "to engine queue", "queue → first scheduled", "detokenize", "TTFT (server side)",
                  "per later token"):  # fmt: skip
        row = next(line for line in out.splitlines() if line.startswith(f"| {stage}"))
        median, p99 = (float(v) for v in row.strip("|").split("|")[1:3])
        assert 0 <= median <= p99, row
