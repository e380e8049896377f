"""RMS normalisation, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.ops.layer_ops import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; with ``residual`` given, adds it first and returns both.

    With a residual the fused op may update ``x`` and ``residual`` in place.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
