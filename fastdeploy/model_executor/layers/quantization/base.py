"""What a quantization method is: a config (from a flag or a checkpoint) that hands each layer its method.

A :class:`QuantizationConfig` is built once per model (``--quantization NAME`` or the
checkpoint's ``quantization_config``) and passed to the model's layers. A linear layer asks it
for a :class:`LinearMethod`, which creates the layer's weights (the dtype the checkpoint holds,
and any scales), turns them into their serving form once all weights are loaded
(:meth:`LinearMethod.process_weights_after_loading`, called by the model loader) and runs the
layer's matmul. Fused-MoE layers ask for their own method (``moe_method``), defined next to them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.linear import Linear


class LinearMethod(ABC):
    """How one (parallel) linear layer stores its weight and computes ``x @ W^T + b``."""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Replace or add the layer's parameters as the checkpoint holds them (with their loaders)."""

    @abstractmethod
    def process_weights_after_loading(self, layer: Linear) -> None:
        """Bring the loaded parameters into the form :meth:`apply` takes (e.g. quantize them)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T + bias`` for this rank's shard of the weight."""

    def apply_normed(
        self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``layer(norm(x + residual))`` and the new residual (``x`` when ``residual`` is None) where
        the method fuses the norm into its matmul for these operands; None: the caller runs the
        norm, then the layer."""
        return None

    def apply_silu_mul(self, layer: Linear, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`apply` of ``silu_and_mul(gate_up)`` (down_proj); a method may fuse the two."""
        from fastdeploy.ops.layer_ops import silu_and_mul

        return self.apply(layer, silu_and_mul(gate_up), bias)


class QuantizationConfig(ABC):
    """One quantization method's settings for a whole model (registered by :attr:`name`)."""

    name: ClassVar[str]
    """The ``--quantization`` value and the checkpoint's ``quant_method``."""
    min_capability: ClassVar[tuple[int, int]] = (0, 0)
    """Oldest CUDA compute capability that runs it."""

    @classmethod
    @abstractmethod
    def from_flag(cls) -> QuantizationConfig:
        """The config for ``--quantization NAME`` on an unquantized checkpoint (quantized at load)."""

    @classmethod
    @abstractmethod
    def from_checkpoint(cls, quantization_config: dict[str, Any]) -> QuantizationConfig:
        """The config of a checkpoint whose config.json carries this ``quantization_config``."""

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """The method of a dense linear layer built with this config."""

    def online(self) -> QuantizationConfig:
        """This config for weights that arrive unquantized (dummy weights drawn for a quantized
        checkpoint's shapes): quantized at load instead of read quantized."""
        return self
