"""The vector ops of ``custom_ops/cpu/cpu_vec.h`` against scalar references, compiled the way the
kernels are (``-O3 -march=native -ffast-math``), so on this CPU's path: AVX-512 or AVX2 + FMA.

The kernel tests (``test_layer_ops.py``, ``test_torch_attention.py``) compare whole ops; this one
pins the ops they are written in, tails and bf16 NaN/tie rounding included, in a few seconds and
without torch's headers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fastdeploy.ops import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_vec_ops_match_scalar_references(tmp_path):
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    missing = cpu_ops.missing_cpu_flags(cpu_ops._cpu_id())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")
    binary = tmp_path / "cpu_vec_check"
    build = subprocess.run(
        [cxx, "-std=c++17", *cpu_ops.CFLAGS, f"-I{ROOT / 'custom_ops' / 'cpu'}",
         str(Path(__file__).with_name("cpu_vec_check.cpp")), "-o", str(binary)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(": 0 failures")
