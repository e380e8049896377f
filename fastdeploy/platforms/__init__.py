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
):
    """The attention backend for ``--attention-backend`` on this device, dtype and head size.

    ``auto`` on CUDA: flashinfer when the package imports and can serve the model (bf16/fp16,
    head size 64/128/256, no fp8 cache, no bidirectional multimodal masks), else triton (when
    triton imports and the head size is a power of two >= 16), else torch; on a CPU: torch.
    An explicitly named backend that cannot run here fails with a clear error (``triton`` on
    a CPU only under ``TRITON_INTERPRET=1``, for tests).
    """
    from fastdeploy.model_executor.attention.flashinfer_backend import (
        flashinfer_importable,
        flashinfer_unsupported_reason,
    )
    from fastdeploy.model_executor.attention.torch_backend import TorchAttentionBackend
    from fastdeploy.ops.cpu_ops import load_cpu_ops

    name = config.device.attention_backend
    flashinfer_installed = device.type == "cuda" and flashinfer_importable()
    if name == "flashinfer" or (name == "auto" and flashinfer_installed):
        reason = flashinfer_unsupported_reason(dtype, head_dim, kv_cache_dtype)
        if reason is None and needs_mask_offsets:
            reason = "it has no attention-mask offsets (--mm-bidirectional-attention)"
        if reason is None and device.type != "cuda":
            reason = "it runs on CUDA devices only"
        if reason is None and not flashinfer_installed:
            reason = "the flashinfer package is not installed (pip install flashinfer-python)"
        if reason is None:
            from fastdeploy.model_executor.attention.flashinfer_backend import FlashInferAttentionBackend

            return FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, device)
        if name == "flashinfer":
            raise ValueError(f"--attention-backend flashinfer is not available: {reason}")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from fastdeploy.model_executor.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:
            if name == "triton":
                raise RuntimeError(f"--attention-backend triton needs the triton package: {exc}") from exc
        else:
            from fastdeploy.ops.triton_attention import triton_interpreting

            power_of_two = head_dim >= 16 and head_dim & (head_dim - 1) == 0
            if name == "triton" and not power_of_two:
                raise ValueError(
                    f"the triton attention backend needs a power-of-two head_dim >= 16, got {head_dim}"
                )
            if name == "triton" and device.type != "cuda" and not triton_interpreting():
                raise ValueError(
                    "the triton attention backend runs on CUDA (on CPU only under TRITON_INTERPRET=1)"
                )
            if power_of_two:
                return TritonAttentionBackend()
    if name in ("auto", "torch"):
        kernel_fits = (
            device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim in (64, 128, 256)
        )
        return TorchAttentionBackend(load_cpu_ops() if kernel_fits else None)
    raise ValueError(
        f"attention backend {name!r} is not available on {device.type}; "
        "available: auto, torch, triton, flashinfer"
    )


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device, peak_torch_bytes: int = 0) -> int:
    """Bytes the KV cache may take. CPU: ``--kv-cache-memory`` GiB. GPU: the
    ``--gpu-memory-utilization`` share of the card, less what other processes and the CUDA
    context hold and less this process's peak (weights plus a profile run's activations)."""
    if device.type == "cpu":
        return int(config.cache.kv_cache_memory * (1 << 30))
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    return int(total * config.cache.gpu_memory_utilization - outside_torch - peak_torch_bytes)
