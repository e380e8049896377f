"""Multimodal rotary embedding (M-RoPE) of Qwen2-VL / Qwen2.5-VL, NeoX layout.

Each token has three position rows (temporal, height, width). The rotary
frequencies are split into ``mrope_section = [s_t, s_h, s_w]`` bands: the first
``s_t`` frequencies rotate by the temporal position, the next ``s_h`` by the
height position, the rest by the width position (as ``transformers``'
``Qwen2VLRotaryEmbedding``). Text tokens have three equal rows, which makes
M-RoPE the plain 1-D rotary, so text-only requests take the same path.

The per-token cos/sin tables are built once per forward pass (every layer gets
the same ``positions`` tensor) and applied by the ordinary
:func:`~fastdeploy.ops.layer_ops.rotary_embedding_` op with positions
``0..T-1``, so the fused CPU / Triton kernels serve M-RoPE too.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.ops.layer_ops import rotary_embedding_


class MRotaryEmbedding(nn.Module):
    """Rotates q and k by 3-row positions ``[3, T]`` (or 1-D ``[T]``: all rows equal)."""

    def __init__(self, head_dim: int, base: float, mrope_section: list[int]):
        super().__init__()
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must be 3 numbers summing to head_dim / 2 = {head_dim // 2}"
            )
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        row_of_freq = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("row_of_freq", row_of_freq, persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[T, head_dim / 2]`` cos and sin of every token's angles."""
        rows = positions if positions.dim() == 2 else positions.unsqueeze(0).expand(3, -1)
        freqs = rows[self.row_of_freq].t().float() * self.inv_freq  # [T, head_dim / 2]
        return freqs.cos().contiguous(), freqs.sin().contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rotate the first ``num_heads`` heads of each row of ``x`` ``[T, >= num_heads * head_dim]`` in place."""
        if positions is not self._positions or self._cos_sin is None:
            cos, sin = self.cos_sin(positions)
            index = torch.arange(cos.shape[0], dtype=torch.int64, device=cos.device)
            self._positions, self._cos_sin = positions, (index, cos, sin)
        index, cos, sin = self._cos_sin
        rotary_embedding_(index, x, cos, sin, num_heads, self.head_dim)
