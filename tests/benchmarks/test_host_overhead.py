"""``benchmarks/host_overhead.py`` runs at a toy size and prints its one-row table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_overhead_prints_a_row():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/host_overhead.py", "--batch", "4", "--output-len", "8", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = proc.stdout.strip().splitlines()[-1].strip("|").split("|")
    assert [c.strip() for c in row[:3]] == ["4", "16 / 8", "1"]
    assert float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0
