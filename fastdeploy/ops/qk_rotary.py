"""The q / k norm and rotary embedding a decode attention kernel may apply itself (a typed hand-off
from the model to the attention layer and its backend; no Triton here, so any install imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QKRotary:
    """What the decode kernel needs to norm and rotate raw q / k itself and write the new keys.

    ``positions [T]`` (int), ``cos`` / ``sin`` float32 ``[max_position, head_dim / 2]`` (NeoX
    layout), the per-head RMSNorm weights ``q_norm_weight`` / ``k_norm_weight`` ``[head_dim]`` of
    the activations' dtype (both None: rotary only, as Llama), ``eps`` the norms' epsilon.
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0

    def usable_with(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel takes this for heads of ``dtype`` and ``head_dim`` (else the caller
        runs the norms, the rotary embedding and the cache write apart)."""
        weights = [w for w in (self.q_norm_weight, self.k_norm_weight) if w is not None]
        return (
            self.cos.dtype == self.sin.dtype == torch.float32
            and self.cos.is_contiguous()
            and self.sin.is_contiguous()
            and self.cos.shape[-1] * 2 == head_dim
            and len(weights) in (0, 2)
            and all(w.dtype == dtype and w.numel() == head_dim for w in weights)
        )
