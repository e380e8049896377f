"""Per-device hooks: which device, which attention backend, how much KV cache.

Platforms differ only in these small hooks; the runner is shared.
"""

from __future__ import annotations

import os

import torch

from fastdeploy.config import EngineConfig


def resolve_device(config: EngineConfig) -> torch.device:
    """``cpu`` / ``cuda`` from ``--device`` (``auto``: cuda when available)."""
    name = config.device.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def configure_threads(config: EngineConfig, device: torch.device) -> None:
    """Use every core (or ``--num-threads``) for CPU matmuls."""
    if device.type == "cpu":
        torch.set_num_threads(config.device.num_threads or os.cpu_count() or 1)


def get_attention_backend(config: EngineConfig, device: torch.device, dtype: torch.dtype, head_dim: int):
    """The attention backend for ``--attention-backend`` on this device, dtype and head size."""
    from fastdeploy.model_executor.attention.torch_backend import TorchAttentionBackend
    from fastdeploy.ops.cpu_ops import load_cpu_ops

    name = config.device.attention_backend
    if name in ("auto", "torch"):
        kernel_fits = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0
        return TorchAttentionBackend(load_cpu_ops() if kernel_fits else None)
    raise ValueError(f"attention backend {name!r} is not available on {device.type}; available: torch")


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes the KV cache may take (CPU: ``--kv-cache-memory`` GiB)."""
    if device.type == "cpu":
        return int(config.cache.kv_cache_memory * (1 << 30))
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free
    return int(total * config.cache.gpu_memory_utilization - used_by_others)
