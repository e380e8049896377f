"""Rotary position embedding (rotate-half / NeoX layout, and the interleaved-pairs / GPT-J layout
of Ernie-4.5) with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from fastdeploy.ops.layer_ops import rotary_embedding_


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k given each token's absolute position."""

    SUPPORTED_SCALING = ("default", "linear", "llama3")

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        scaling = scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in self.SUPPORTED_SCALING:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (supported: {self.SUPPORTED_SCALING})"
            )
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "linear":
            positions = positions / scaling["factor"]
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads * head_dim]`` in place."""
        rotary_embedding_(positions, x, self.cos_cache, self.sin_cache, num_heads, self.head_dim)


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over interleaved pairs ``(x[2i], x[2i+1])`` of each head (GPT-J layout, Ernie-4.5).

    Frequencies are those of :class:`RotaryEmbedding`; only the pairing of features differs. The
    rotation is computed in float32 and cast back, as ``transformers`` does. The fused GPU rotary
    kernels assume the halves layout, so the model takes its unfused path for this class.
    """

    def forward(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads * head_dim]`` in place."""
        heads = x[:, : num_heads * self.head_dim].view(x.shape[0], num_heads, self.head_dim // 2, 2)
        c = self.cos_cache[positions].unsqueeze(1)  # [T, 1, head_dim / 2], float32
        s = self.sin_cache[positions].unsqueeze(1)
        x1, x2 = heads[..., 0].float(), heads[..., 1].float()
        heads.copy_(torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
