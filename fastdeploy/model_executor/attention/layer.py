"""The attention layer used by every model."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy import envs
from fastdeploy.model_executor.attention.forward_context import get_attn_metadata
from fastdeploy.ops import reshape_and_cache_flash
from fastdeploy.ops.layer_ops import load_triton_ops


class Attention(nn.Module):
    """Writes this step's keys/values into the paged cache, then attends.

    ``kv_cache`` (key cache, value cache) is bound by the runner after the cache
    is allocated; ``backend`` is the attention implementation chosen for the
    platform. Without metadata (a profile or warm-up run) it attends causally
    over the given tokens as a single sequence.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend = None
        self.kv_cache_dtype = "auto"
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        """fp8_e4m3 caches: per-slot, per-head float32 scales of the keys and the values."""

    def fuses_rotary(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` can apply the rotary embedding together with the cache write
        (one Triton kernel on a GPU, bf16/fp16 caches) for activations like ``x``."""
        return (
            x.is_cuda
            and self.kv_cache is not None
            and self.kv_cache_dtype == "auto"
            and not envs.FD_DISABLE_CUSTOM_OPS
            and load_triton_ops() is not None
        )

    def cache_target(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(key cache, value cache, slot mapping) when this step's ``num_tokens`` keys and values
        may be written by the kernel that produces them (a bf16/fp16 cache and a step with
        metadata for every token), so that :meth:`forward` is called with ``cache_written``."""
        metadata = get_attn_metadata()
        if metadata is None or self.kv_cache is None or self.kv_cache_dtype != "auto":
            return None
        if metadata.slot_mapping.shape[0] != num_tokens:
            return None
        return (*self.kv_cache, metadata.slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, nn.Module] | None = None,
        cache_written: bool = False,
    ) -> torch.Tensor:
        """q: [T, num_heads * head_dim], k/v: [T, num_kv_heads * head_dim] → [T, num_heads * head_dim].

        ``rotary`` = (positions, rotary embedding) asks this layer to rotate q and k first
        (callers pass it only when :meth:`fuses_rotary`); otherwise they arrive rotated.
        ``cache_written``: q and k arrive rotated and k and v are already in the cache at
        :meth:`cache_target`'s slots (callers pass it only when that was not None).
        """
        num_tokens = q.shape[0]
        metadata = get_attn_metadata()
        fused = (
            rotary is not None
            and metadata is not None
            and self.kv_cache is not None
            and metadata.slot_mapping.shape[0] == num_tokens
        )
        if rotary is not None and not fused:
            positions, rope = rotary
            rope(positions, q, self.num_heads)
            rope(positions, k, self.num_kv_heads)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if cache_written:
            out = self.backend.forward(self, q, k, v, metadata)
        elif metadata is None or self.kv_cache is None:
            out = _causal_attention(q, k, v, self.scale)
        else:
            key_cache, value_cache = self.kv_cache
            if fused:
                positions, rope = rotary
                load_triton_ops().rotary_and_cache_(
                    positions,
                    q,
                    k,
                    v,
                    rope.cos_cache,
                    rope.sin_cache,
                    key_cache,
                    value_cache,
                    metadata.slot_mapping,
                )
            else:
                k_scale, v_scale = self.kv_scales if self.kv_scales is not None else (None, None)
                reshape_and_cache_flash(
                    k, v, key_cache, value_cache, metadata.slot_mapping, self.kv_cache_dtype, k_scale, v_scale
                )
            out = self.backend.forward(self, q, k, v, metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over ``k``/``v [T, H_kv, D]`` as one sequence, without a
    KV cache (the start-up profile pass, cache-less models). The KV heads are expanded to the query
    heads first: with ``enable_gqa`` SDPA takes its math kernel, whose ``[H, T, T]`` scores the
    profile pass then counted as activation memory (gigabytes at a large token budget, enough to run
    a large model out of memory); expanded, a GPU runs the flash / memory-efficient kernels in O(T)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, scale=scale,
    )  # fmt: skip
    return out.squeeze(0).transpose(0, 1)
