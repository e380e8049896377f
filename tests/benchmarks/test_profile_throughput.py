"""``benchmarks/gpubench/profile_throughput.py``: its phase and kernel-window tables, and a CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpubench.kernel_window import kernel_window, phase_table  # noqa: E402
from gpubench.settings import TINY_OVERRIDES  # noqa: E402


def kernel(name: str, start: float, end: float) -> SimpleNamespace:
    """A profiler event as ``kernel_window`` reads it (times in µs)."""
    return SimpleNamespace(
        name=name,
        device_type=torch.autograd.DeviceType.CUDA,
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_each_step_is_charged_the_next_steps_wall_time():
    log = [(4096, 8), (4096, 12), (20, 20), (20, 20), (20, 20), (0, 0)]
    times = [0.5, 0.2, 0.1, 0.01, 0.02, 0.03]
    rows = phase_table(log, times, max_batch=32)
    assert rows[2] == "| prefill | 2 | 150.00 | 0.300 |"
    assert rows[3] == "| decode, batch 32 | 3 | 20.00 | 0.060 |"
    assert len(rows) == 4


def test_kernel_window_reports_busy_span_and_idle_before_each_kernel():
    # two steps: gemm 0-10, attn 11-21 (1 µs gap), then 200 µs of idle before the next step
    events = [
        kernel("gemm", 0, 10),
        kernel("attn", 11, 21),
        kernel("gemm", 221, 231),
        kernel("attn", 232, 242),
    ]
    events.append(SimpleNamespace(name="Memcpy HtoD", device_type=torch.autograd.DeviceType.CUDA,
                                  time_range=SimpleNamespace(start=300, end=400)))  # fmt: skip
    lines = kernel_window(events, steps=2, wall_s=0.0005)
    assert lines[0] == "per step: wall 0.25 ms, kernel span 0.12 ms, GPU busy 0.02 ms, 2 kernels"
    assert lines[1].endswith(
        "< 1 µs 0.000 ms, < 2 µs 0.001 ms, < 4 µs 0.000 ms, < 10 µs 0.000 ms, < 100 µs 0.000 ms, >= 100 µs 0.100 ms"
    )
    table = dict(line.split(" | ", 1) for line in lines[4:])
    assert table["| `gemm`"] == "1 | 0.010 | 0.100 |"
    assert table["| `attn`"] == "1 | 0.010 | 0.001 |"


def test_runs_on_a_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpubench.profile_throughput", "benchmarks/configs/llama-3.2-1b",
         "--device", "cpu", "--num-prompts", "4", "--input-len", "32", "--output-len", "4",
         "--max-num-batched-tokens", "64", "--hf-config-overrides", json.dumps(TINY_OVERRIDES)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "4 prompts x 32 / 4 tokens" in out and "| prefill | " in out and "| decode, batch " in out
