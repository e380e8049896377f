"""``benchmarks/step_transport.py`` runs at a toy size and prints its one-row table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # six processes importing torch: ~30 s on the 2-core CI machine
def test_step_transport_prints_a_row():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/step_transport.py", "--steps", "20", "--sizes", "512"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [cell.strip() for cell in proc.stdout.strip().splitlines()[-1].strip("|").split("|")]
    assert row[0] == "512 B"
    assert all(float(cell.split()[0]) > 0 for cell in row[1:]), row
