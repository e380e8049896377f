"""Per-device hooks: which device, which attention backend, how much KV cache.

Platforms differ only in these small hooks; the runner is shared.
"""

from __future__ import annotations

import os

import torch

from fastdeploy.config import EngineConfig
from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec
from fastdeploy.model_executor.attention.registry import choose_attention_backend


def device_name(choice: str) -> str:
    """``--device`` with ``auto`` resolved: cuda when available, else cpu."""
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def resolve_device(config: EngineConfig) -> torch.device:
    """``cpu`` / ``cuda`` from ``--device`` (``auto``: cuda when available)."""
    name = device_name(config.device.device)
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return torch.device(name)


def configure_threads(config: EngineConfig, device: torch.device) -> None:
    """CPU matmul threads: ``--num-threads``, else the cores shared out over the worker processes."""
    if device.type == "cpu":
        workers = config.parallel.tensor_parallel_size * config.parallel.data_parallel_size
        torch.set_num_threads(config.device.num_threads or max(1, (os.cpu_count() or 1) // workers))


def get_attention_backend(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    num_heads: int = 1,
    num_kv_heads: int = 1,
    kv_cache_dtype: str = "auto",
    needs_mask_offsets: bool = False,
) -> AttentionBackend:
    """The attention backend for ``--attention-backend`` on this device, dtype and head size.

    The choice itself is the registry's (:func:`choose_attention_backend`): a named backend
    when it can serve the model here (else one error saying why), under ``auto`` the
    available backend of highest priority for the device. Today that is, on CUDA:
    flashinfer (paired with triton for decode steps), else triton, else torch; on a CPU: torch.
    """
    spec = AttentionSpec(
        device=device,
        dtype=dtype,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        kv_cache_dtype=kv_cache_dtype,
        needs_mask_offsets=needs_mask_offsets,
    )
    return choose_attention_backend(config.device.attention_backend, spec)


LARGE_GPU_BYTES = 70 * (1 << 30)
"""A GPU with at least this much memory (H100, H200, MI300) gets the larger default token budget."""
SERVING_LARGE_GPU_BUDGET = 4096
"""The default token budget of a served engine on a large GPU."""
OFFLINE_LARGE_GPU_BUDGET = 16384
"""... and of the offline ``LLM`` class there."""
OFFLINE_GPU_BUDGET = 8192
"""The offline ``LLM`` class's on a smaller GPU."""
SMALL_BUDGET = 2048
"""A served engine's on a smaller GPU, and every engine's on a CPU."""


def default_max_num_batched_tokens(device: torch.device, offline: bool = False) -> int:
    """The step token budget when ``--max-num-batched-tokens`` is not given: on a large GPU 4096
    for serving and 16,384 ``offline`` (the :class:`~fastdeploy.LLM` class), on a smaller GPU 2048
    and 8192 offline (vLLM's offline and server defaults there), on a CPU 2048.

    Serving: a step's prefill tokens set the longest inter-token gap of the requests decoding
    beside them; on a large GPU 4096-token steps already run the dense GEMMs at full rate, so 8192
    (vLLM's server choice) only doubles that gap (docs/benchmarks.md). Offline nobody waits
    between tokens, and a mixture-of-experts model's prefill steps read every expert's weights
    once per step, so more tokens a step is more throughput; vLLM's ``LLM`` class takes 16,384
    there too.

    Reads the card's total memory only (``get_device_properties``, no allocation)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        if torch.cuda.get_device_properties(index).total_memory >= LARGE_GPU_BYTES:
            return OFFLINE_LARGE_GPU_BUDGET if offline else SERVING_LARGE_GPU_BUDGET
        return OFFLINE_GPU_BUDGET if offline else SMALL_BUDGET
    return SMALL_BUDGET


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device, peak_torch_bytes: int = 0) -> int:
    """Bytes the KV cache may take. CPU: ``--kv-cache-memory`` GiB. GPU: the
    ``--gpu-memory-utilization`` share of the card, less what other processes and the CUDA
    context hold and less this process's peak (weights plus a profile run's activations)."""
    if device.type == "cpu":
        return int(config.cache.kv_cache_memory * (1 << 30))
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    return int(total * config.cache.gpu_memory_utilization - outside_torch - peak_torch_bytes)
