"""Element-wise ops of the decoder layer: RMSNorm, rotary embedding, SiLU-and-multiply.

Each op runs the C++ CPU kernel (:mod:`fastdeploy.ops.cpu_ops`) for float32 / bfloat16
CPU tensors when it is built, the Triton kernel (:mod:`fastdeploy.ops.triton_layer_ops`)
for CUDA tensors when Triton imports, and the torch implementation here otherwise. All
round at the same points, so they agree to float32 accumulation order.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from fastdeploy import envs
from fastdeploy.ops.cache_ops import reshape_and_cache_flash
from fastdeploy.ops.cpu_ops import load_cpu_ops

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_kernels(x: torch.Tensor):
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES or x.stride(-1) != 1:
        return None
    return load_cpu_ops()


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """The Triton kernel module ``fastdeploy.ops.<name>``, or None where triton does not import
    (callers then take their torch path)."""
    try:
        return importlib.import_module(f"fastdeploy.ops.{name}")
    except ImportError:
        return None


def load_triton_ops() -> ModuleType | None:
    """The Triton layer kernels (:mod:`fastdeploy.ops.triton_layer_ops`), or None without triton."""
    return triton_module("triton_layer_ops")


def _triton_kernels(x: torch.Tensor):
    """The Triton layer ops for 2-D CUDA tensors with unit stride in the last dimension, else None."""
    if not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1 or envs.FD_DISABLE_CUSTOM_OPS:
        return None
    return load_triton_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension of a 2-D ``x``, in float32."""
    kernels = _cpu_kernels(x)
    if kernels is not None and x.dim() == 2 and weight.dtype == x.dtype:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        kernels.rms_norm(out, x, weight, eps)
        return out
    if (gpu := _triton_kernels(x)) is not None and weight.dtype == x.dtype:
        return gpu.rms_norm(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; x = rms_norm(residual)``; returns ``(x, residual)``.

    The CPU kernel updates both tensors in place and returns them; callers must not
    rely on the inputs keeping their values.
    """
    kernels = _cpu_kernels(x)
    if (
        kernels is not None
        and x.dim() == 2
        and residual.stride(-1) == 1
        and x.dtype == residual.dtype == weight.dtype
    ):
        kernels.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    gpu = _triton_kernels(x)
    if gpu is not None and residual.stride(-1) == 1 and x.dtype == residual.dtype == weight.dtype:
        return gpu.fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return _rms_norm_torch(residual, weight, eps), residual


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary_embedding_(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    """Rotate the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads * head_dim]``
    in place (NeoX rotate-half layout); ``cos``/``sin`` are float32 ``[max_position, head_dim / 2]``.
    """
    kernels = _cpu_kernels(x)
    if kernels is not None and x.dim() == 2 and positions.dtype == torch.int64:
        kernels.rotary_embedding(positions.contiguous(), x, cos, sin, num_heads, head_dim)
        return
    if (gpu := _triton_kernels(x)) is not None and cos.dtype == torch.float32 and cos.is_contiguous():
        gpu.rotary_embedding_(positions, x, cos, sin, num_heads, head_dim)
        return
    heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = heads.chunk(2, dim=-1)
    heads.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def qk_norm_rotary_(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Qwen3's attention input in place: RMSNorm over each q head (``q_weight [head_dim]``) and
    each k head (``k_weight``) of ``qkv [T, (num_heads + 2 * num_kv_heads) * head_dim]``, then
    the rotary embedding of those heads (NeoX layout; ``cos``/``sin`` as :func:`rotary_embedding_`);
    with ``cache`` = (key cache, value cache, slot mapping) of ``qkv``'s dtype, then the keys and
    values into the cache (as ``reshape_and_cache_flash``). One Triton kernel on a GPU; elsewhere
    the norms, :func:`rotary_embedding_` and the cache write."""
    gpu = _triton_kernels(qkv)
    if (
        gpu is not None
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and q_weight.dtype == k_weight.dtype == qkv.dtype
        and (cache is None or cache[0].dtype == cache[1].dtype == qkv.dtype)
    ):
        gpu.qk_norm_rotary_(
            positions, qkv, q_weight, k_weight, eps, cos, sin, num_heads, num_kv_heads, head_dim, cache
        )
        return
    num_tokens, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    qkv[:, :q_size] = _rms_norm_torch(q, q_weight, eps).reshape(num_tokens, q_size)
    qkv[:, q_size : q_size + kv_size] = _rms_norm_torch(k, k_weight, eps).reshape(num_tokens, kv_size)
    rotary_embedding_(positions, qkv, cos, sin, num_heads + num_kv_heads, head_dim)
    if cache is not None:
        key_cache, value_cache, slots = cache
        k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].reshape(num_tokens, num_kv_heads, head_dim)
        reshape_and_cache_flash(k, v, key_cache, value_cache, slots, "auto")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    half = gate_up.shape[-1] // 2
    kernels = _cpu_kernels(gate_up)
    if kernels is not None and gate_up.dim() == 2:
        out = torch.empty((gate_up.shape[0], half), dtype=gate_up.dtype, device=gate_up.device)
        kernels.silu_and_mul(out, gate_up)
        return out
    if (gpu := _triton_kernels(gate_up)) is not None:
        return gpu.silu_and_mul(gate_up)
    gate, up = gate_up.split(half, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of 2-D logits (int64, first index on ties), into ``out`` when given.

    On a GPU two Triton kernels split each row across many programs, where torch
    reduces a row in one block (28 µs for a 128k vocabulary on an H200, at batch 1).
    Their launches cost more host time than torch's, so the decode CUDA graphs use it
    (:mod:`fastdeploy.worker.cuda_graph`), eager sampling keeps ``torch.argmax``.
    """
    if _triton_kernels(x) is not None and (argmax := triton_module("triton_argmax")) is not None:
        return argmax.argmax_rows(x, out)
    return torch.argmax(x, dim=-1, out=out) if out is not None else x.argmax(dim=-1)
