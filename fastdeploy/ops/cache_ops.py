"""Writing new keys and values into the paged KV cache.

:func:`reshape_and_cache_flash` runs the CUDA kernel of ``fastdeploy_ops``
when it is loaded and the tensors are on a CUDA device, and the torch
implementation :func:`reshape_and_cache_flash_torch` otherwise (any device).

``kv_cache_dtype="fp8_e4m3"`` (alias ``"fp8"``) stores every (token, head)
vector of ``head_dim`` values in float8 e4m3 with its own dynamic scale::

    scale = max(absmax(x) / 448, 1e-12)        # float32, exact IEEE division
    cache = e4m3(clamp(x / scale, -448, 448))  # round to nearest even
    k_scale[block, offset, head] = scale       # [num_blocks, block_size, heads] float32

and dequantisation is ``cache.float() * scale[..., None]``. The floor keeps an
all-zero vector finite (its scale is 1e-12, its values 0). The CUDA kernel
(custom_ops/gpu/cache_kernels.cu) implements the same definition.
"""

from __future__ import annotations

import torch

from fastdeploy.ops._ext import cuda_op, has_cuda_ops
from fastdeploy.ops.cpu_ops import load_cpu_ops

FP8_E4M3_MAX = 448.0
FP8_SCALE_FLOOR = 1e-12
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8")
_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32)
_FP8_CACHES = (torch.float8_e4m3fn, torch.uint8)
FP8_MIN_CAPABILITY = (8, 9)


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` of shape ``[T, H, D]`` into NHD caches ``[num_blocks, block_size, H, D]``.

    Token ``t`` goes to flat slot ``slot_mapping[t]`` (``block * block_size +
    offset``; int64 or int32); a negative slot means "skip this token"
    (padding). Only the first ``len(slot_mapping)`` rows of ``key``/``value``
    are read; they may be strided views with unit stride in ``head_dim``.
    ``"auto"`` copies (cache dtype == input dtype, fp16/bf16/fp32); for
    ``"fp8_e4m3"`` the caches are float8_e4m3fn (or uint8) and ``k_scale`` /
    ``v_scale`` ``[num_blocks, block_size, H]`` float32 receive the per-head
    scales (see the module docstring). Slots must be below
    ``num_blocks * block_size``; the kernel does not check that on the device.
    """
    if key.is_cuda and has_cuda_ops():
        # checked here, not only in C++: an exception thrown inside the extension crashed the
        # process on the H200 image (torch 2.11 / CUDA 13), so bad input must never reach it
        _validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
        cuda_op("reshape_and_cache_flash")(
            key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
        )
        return
    cpu_kernels = _cpu_copy_kernels(key, key_cache, slot_mapping, kv_cache_dtype)
    if cpu_kernels is not None:  # checks shapes and slot bounds itself
        cpu_kernels.write_cache(key, key_cache, slot_mapping)
        cpu_kernels.write_cache(value, value_cache, slot_mapping)
        return
    reshape_and_cache_flash_torch(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def _cpu_copy_kernels(
    key: torch.Tensor, key_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str
):
    """The C++ CPU kernels when they can do this plain copy, else None."""
    if (
        kv_cache_dtype != "auto"
        or key.device.type != "cpu"
        or key.dtype not in (torch.float32, torch.bfloat16)
        or key_cache.dtype != key.dtype
        or slot_mapping.dtype != torch.int64
    ):
        return None
    return load_cpu_ops()


def reshape_and_cache_flash_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The pure-torch :func:`reshape_and_cache_flash` (CPU or GPU): the fallback and the reference."""
    fp8 = _validate(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    num_heads, head_dim = key_cache.shape[-2:]
    if not fp8:
        key_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, key)
        value_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, value)
        return
    for x, cache, scales in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        quantized, scale = quantize_fp8_e4m3_per_head(x)
        cache.view(torch.uint8).view(-1, num_heads, head_dim).index_copy_(
            0, slots, quantized.view(torch.uint8)
        )
        scales.view(-1, num_heads).index_copy_(0, slots, scale)


def quantize_fp8_e4m3_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` → (float8_e4m3fn values ``[..., D]``, float32 scales ``[...]``), one scale per vector.

    The single definition of the fp8 KV-cache quantisation (see the module
    docstring). Both divisions are tensor/tensor so that every device rounds
    them as IEEE divisions (a division by a Python scalar may become a
    multiplication by its reciprocal).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.clamp_min(amax / torch.full_like(amax, FP8_E4M3_MAX), FP8_SCALE_FLOOR)
    quantized = (xf / scale.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def dequantize_fp8_e4m3_per_head(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``cache.float() * scale[..., None]`` for float8_e4m3fn or uint8-viewed caches (float32 result)."""
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    return cache.float() * scale.unsqueeze(-1)


def normalize_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """``"auto"`` or ``"fp8_e4m3"`` (for ``"fp8"`` too); ValueError for anything else."""
    if kv_cache_dtype == "auto":
        return "auto"
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return "fp8_e4m3"
    raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected 'auto', 'fp8_e4m3' or 'fp8'")


def check_fp8_supported(device: torch.device) -> None:
    """Refuse fp8 KV caches on CUDA GPUs older than compute capability 8.9 (no e4m3 hardware)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise RuntimeError(
            f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer; "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )


def _validate(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Check the arguments like the kernel does; True for an fp8 cache."""
    fp8 = normalize_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3"
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key and value must both be [tokens, heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, heads, head_dim]; "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's {tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"slot_mapping must be 1-D with at most {key.shape[0]} entries; got {tuple(slot_mapping.shape)}"
        )
    if (
        key.stride(-1) != 1
        or value.stride(-1) != 1
        or key_cache.stride(-1) != 1
        or value_cache.stride(-1) != 1
    ):
        raise ValueError("key, value and the caches need unit stride in head_dim")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if key.dtype != value.dtype or key.dtype not in _FLOAT_INPUTS:
        raise TypeError(
            f"key and value must share one of float16/bfloat16/float32; got {key.dtype} and {value.dtype}"
        )
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    if not fp8:
        if key_cache.dtype != key.dtype or value_cache.dtype != key.dtype:
            raise TypeError(
                f"with kv_cache_dtype auto the caches must have the input dtype {key.dtype}; "
                f"got {key_cache.dtype} and {value_cache.dtype}"
            )
        return False
    check_fp8_supported(key.device)
    if key_cache.dtype not in _FP8_CACHES or value_cache.dtype not in _FP8_CACHES:
        raise TypeError(
            f"fp8_e4m3 caches must be float8_e4m3fn or uint8, got {key_cache.dtype} and {value_cache.dtype}"
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        expected = tuple(key_cache.shape[:3])
        if scale is None:
            raise ValueError(
                f"kv_cache_dtype fp8_e4m3 needs {name} of shape [num_blocks, block_size, heads] = {expected} (float32)"
            )
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {scale.dtype}")
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, heads] = {expected}, got {tuple(scale.shape)}"
            )
        if scale.device != key_cache.device:
            raise ValueError(f"{name} is on {scale.device} but the cache is on {key_cache.device}")
    return True
