"""C++ kernels for CPUs, compiled on first use with ``torch.utils.cpp_extension`` and cached.

The build is keyed by the CPU model (it uses ``-march=native``) and lives under
``FD_CACHE_DIR``. If the compiler, ninja or the sources are missing, or the
build fails, ``load_cpu_ops()`` returns None and callers use their torch
fallback; ``FD_DISABLE_CUSTOM_OPS=1`` forces that.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

from fastdeploy import envs

logger = logging.getLogger(__name__)

SOURCES = [
    "cpu/bindings.cpp",
    "cpu/paged_attention.cpp",
    "cpu/prefill_attention.cpp",
    "cpu/layer_kernels.cpp",
]
HEADERS = ["cpu/cpu_ops.h", "cpu/cpu_vec.h"]


def _sources_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "custom_ops"


def _cpu_key() -> str:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line for line in f if line.startswith(("model name", "flags"))), model)
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}:{model}".encode()).hexdigest()[:10]


STALE_LOCK_S = 600
"""A build lock older than this was left by a build that died (torch would wait on it forever)."""


def _remove_stale_lock(build_dir: str) -> None:
    lock = os.path.join(build_dir, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
            logger.warning("removed a stale CPU-kernel build lock left by a killed build: %s", lock)
    except OSError:  # no lock, or another process removed it first
        pass


@functools.cache
def load_cpu_ops() -> Any | None:
    """The compiled CPU extension module, or None when it cannot be had."""
    if envs.FD_DISABLE_CUSTOM_OPS:
        return None
    sources = [_sources_dir() / s for s in SOURCES]
    headers = [_sources_dir() / h for h in HEADERS]
    if not all(s.is_file() for s in sources + headers):
        return None
    try:
        from torch.utils.cpp_extension import load

        digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources + headers)).hexdigest()[:10]
        name = f"fastdeploy_cpu_ops_{_cpu_key()}_{digest}"
        build_dir = os.path.join(envs.FD_CACHE_DIR, "torch_extensions", name)
        os.makedirs(build_dir, exist_ok=True)
        _remove_stale_lock(build_dir)
        return load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", f"-I{_sources_dir() / 'cpu'}"],
            extra_ldflags=["-fopenmp", "-lmvec"],
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: fall back to torch
        logger.warning(
            "CPU kernels unavailable, using the torch fallback: %s", str(exc).splitlines()[0][:200]
        )
        return None
