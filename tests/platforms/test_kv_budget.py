"""KV-cache sizing: CPU from --kv-cache-memory, GPU from --gpu-memory-utilization after a profile run."""

from __future__ import annotations

import torch

from fastdeploy import platforms
from fastdeploy.config import EngineConfig

GIB = 1 << 30


def test_cpu_budget_is_the_configured_memory():
    config = EngineConfig.from_kwargs(kv_cache_memory=0.5)
    assert platforms.kv_cache_budget_bytes(config, torch.device("cpu")) == GIB // 2


def test_gpu_budget_subtracts_other_processes_and_the_profiled_peak(monkeypatch):
    """80 GiB card, 10 GiB free; this process reserves 60 GiB, so 10 GiB belong to others (and the
    CUDA context); weights plus the profile run peaked at 20 GiB. At 0.9: 72 - 10 - 20 = 42 GiB."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 * GIB)
    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.9)
    budget = platforms.kv_cache_budget_bytes(config, torch.device("cuda"), peak_torch_bytes=20 * GIB)
    assert budget == int(80 * GIB * 0.9 - 10 * GIB - 20 * GIB)
    lower = EngineConfig.from_kwargs(gpu_memory_utilization=0.5)
    assert platforms.kv_cache_budget_bytes(lower, torch.device("cuda"), 20 * GIB) == int(40 * GIB - 30 * GIB)
