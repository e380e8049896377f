"""FP8 (e4m3) weights with dynamic activation scales: ``--quantization fp8`` and FP8 checkpoints.

Two weight layouts, both with float32 *dequantization* scales (``w ≈ w_fp8 * scale``):

- **block-scaled** (``weight_block_size = (bn, bk)``, default (128, 128)): one scale per
  ``bn × bk`` tile, the checkpoint tensor ``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` of
  DeepSeek-V3 and Qwen3-*-FP8; activations get one dynamic scale per token and ``bk`` columns.
- **per output channel** (``weight_block_size = None``): ``weight_scale [N]``; activations one
  dynamic scale per token. A checkpoint of this kind (``quant_method: fp8`` without
  ``weight_block_size``, as AutoFP8 writes it) holds one scalar ``weight_scale`` per projection,
  spread over that projection's rows here.

``--quantization fp8`` quantizes a bf16/fp32 checkpoint in 128 x 128 blocks, ``--quantization
ptpc_fp8`` (per token, per channel; vLLM's name for it) per output channel. Online quantization loads the weights as
usual and quantizes each layer's shard in :meth:`Fp8LinearMethod.process_weights_after_loading`.
FP8 checkpoints are loaded as they are: the fp8 weight and its scales go through the layer's
shard loaders (block scales split with their weight blocks under tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from fastdeploy.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from fastdeploy.model_executor.layers.weight_loading import (
    ShardId,
    checkpoint_shapes,
    copy_rows,
    set_weight_loader,
)

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.linear import Linear
    from fastdeploy.ops.fp8_linear import Fp8LinearBackend

DEFAULT_WEIGHT_BLOCK = (128, 128)
"""Block size of ``--quantization fp8`` (the checkpoints' block; see docs/models.md for why)."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with e4m3 tensor cores (Ada, Hopper and newer)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 weights of a model: their scale layout and whether the checkpoint already holds them."""

    name: ClassVar[str] = "fp8"
    min_capability: ClassVar[tuple[int, int]] = FP8_MIN_CAPABILITY

    weight_block_size: tuple[int, int] | None = DEFAULT_WEIGHT_BLOCK
    """``(rows, columns)`` of one weight scale's tile; None: one scale per output channel."""
    activation_scheme: str = "dynamic"
    """Activation scales: only ``dynamic`` (computed per token, or per 1 × block columns)."""
    is_checkpoint_fp8: bool = False
    """The checkpoint holds fp8 weights and scales (else they are quantized at load)."""

    def __post_init__(self) -> None:
        if self.activation_scheme != "dynamic":
            raise ValueError(
                f"FP8 activation_scheme {self.activation_scheme!r} is not supported; only 'dynamic' "
                "(static input_scale checkpoints are not)"
            )
        block = self.weight_block_size
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"FP8 weight_block_size must be two positive ints, got {block!r}")

    @classmethod
    def from_flag(cls) -> Fp8Config:
        """``--quantization fp8``: quantize at load, in :data:`DEFAULT_WEIGHT_BLOCK` blocks."""
        return cls()

    @classmethod
    def from_checkpoint(cls, quantization_config: dict[str, Any]) -> Fp8Config:
        """A config.json ``quantization_config`` with ``quant_method: fp8`` (e4m3, dynamic activations)."""
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"FP8 checkpoint format (quantization_config.fmt) {fmt!r} is not supported; only e4m3"
            )
        block = quantization_config.get("weight_block_size")
        return cls(
            weight_block_size=None if block is None else tuple(int(b) for b in block),
            activation_scheme=quantization_config.get("activation_scheme", "dynamic"),
            is_checkpoint_fp8=True,
        )

    def linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self)

    def online(self) -> Fp8Config:
        return Fp8Config(self.weight_block_size, self.activation_scheme, is_checkpoint_fp8=False)


@dataclass(frozen=True)
class PtpcFp8Config(Fp8Config):
    """``--quantization ptpc_fp8``: weights quantized at load with one scale per output channel,
    activations one dynamic scale per token. Coarser than 128 x 128 blocks, but every FP8 GEMM
    then accumulates whole rows before scaling once (row-wise ``torch._scaled_mm`` for the dense
    layers, a plain fp8 K loop in the fused-MoE kernel), the faster kernels at large batches."""

    name: ClassVar[str] = "ptpc_fp8"

    weight_block_size: tuple[int, int] | None = None

    @classmethod
    def from_checkpoint(cls, quantization_config: dict[str, Any]) -> Fp8Config:
        """No checkpoint format has this name: an FP8 checkpoint's ``quant_method`` is ``fp8``."""
        raise ValueError(
            "ptpc_fp8 quantizes a bf16/fp32 checkpoint at load; a quant_method: ptpc_fp8 checkpoint "
            "is not a known format (FP8 checkpoints say quant_method: fp8)"
        )


def replace_parameter(layer: nn.Module, name: str, data: torch.Tensor) -> nn.Parameter:
    """Set ``layer.<name>`` to a frozen parameter of ``data``, keeping the old one's loader attributes."""
    old = getattr(layer, name, None)
    param = nn.Parameter(data, requires_grad=False)
    for attr in ("weight_loader", "checkpoint_shapes"):
        if hasattr(old, attr):
            setattr(param, attr, getattr(old, attr))
    setattr(layer, name, param)
    return param


class Fp8LinearMethod(LinearMethod):
    """FP8 weights of one linear layer; the GEMM is :func:`fastdeploy.ops.fp8_linear.fp8_linear`.

    Parameters after loading: ``weight`` ``[N, K]`` float8_e4m3fn and either
    ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` (block-scaled) or ``weight_scale`` ``[N]``
    (per channel), float32.
    """

    def __init__(self, config: Fp8Config):
        self.config = config
        self.block = config.weight_block_size
        self.backend: Fp8LinearBackend | None = None
        """The kernels of this layer's device, set after loading (None: the device's default)."""

    @property
    def scale_name(self) -> str:
        """The scale parameter's (and checkpoint tensor's) name."""
        return "weight_scale" if self.block is None else "weight_scale_inv"

    def create_weights(self, layer: Linear) -> None:
        """FP8 checkpoints: an fp8 ``weight`` and its scale parameter, each with a shard loader.
        Online quantization keeps the model-dtype weight until :meth:`process_weights_after_loading`."""
        if not self.config.is_checkpoint_fp8:
            return
        replace_parameter(layer, "weight", torch.empty_like(layer.weight, dtype=torch.float8_e4m3fn))
        shapes = checkpoint_shapes(layer.weight)
        n, k = layer.weight.shape
        if self.block is None:
            scale = torch.empty(n, dtype=torch.float32)
            scale_shapes = {shard: () for shard in shapes}
        else:
            bn, bk = self.block
            for shard in shapes:
                self._check_block_region(layer, shard, shapes[shard])
            scale = torch.empty(_cdiv(n, bn), _cdiv(k, bk), dtype=torch.float32)
            scale_shapes = {shard: (_cdiv(s[0], bn), _cdiv(s[1], bk)) for shard, s in shapes.items()}
        param = replace_parameter(layer, self.scale_name, scale)
        set_weight_loader(param, self._scale_loader(layer), scale_shapes)

    def _check_block_region(self, layer: Linear, shard: ShardId, full: tuple[int, ...]) -> None:
        """ValueError unless this rank's part of checkpoint tensor ``shard`` is whole weight blocks."""
        dim, dest, size, start = layer.weight_region(shard)
        block = self.block[dim]
        whole = dest % block == 0 and start % block == 0 and (size % block == 0 or start + size >= full[dim])
        if not whole:
            what = "output" if dim == 0 else "input"
            raise ValueError(
                f"{type(layer).__name__} (checkpoint part {shard!r}): this rank's {size} {what} features "
                f"from {start} are not whole {self.block[0]}x{self.block[1]} blocks of the FP8 checkpoint's "
                f"weight_scale_inv; use a tensor_parallel_size whose shards are multiples of {block}"
            )

    def _scale_loader(self, layer: Linear):
        """The loader of the scale parameter: the rows/columns of the weight's region, in scale units."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            dim, dest, size, start = layer.weight_region(shard_id)
            if self.block is None:  # one scalar for the projection: fill its output rows
                rows = param.data if dim == 1 else param.data.narrow(0, dest, size)
                rows.fill_(float(loaded.reshape(-1)[0]))
                return
            block = self.block[dim]
            region = param.data.narrow(dim, dest // block, _cdiv(size, block))
            copy_rows(region, loaded.float(), dim, start // block)

        return load

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Online: quantize this rank's weight (block or per channel). Both: the weight and a
        contiguous float32 scale in the layout the kernels read them in (so that no call copies
        them), and the device's kernel choice (:class:`~fastdeploy.ops.fp8_linear.Fp8LinearBackend`)."""
        from fastdeploy.ops.fp8_linear import Fp8LinearBackend
        from fastdeploy.ops.fp8_quant import quantize_weight_block, quantize_weight_per_channel

        if not self.config.is_checkpoint_fp8:
            weight = layer.weight.data
            if self.block is None:
                q, scale = quantize_weight_per_channel(weight)
            else:
                q, scale = quantize_weight_block(weight, self.block)
            replace_parameter(layer, "weight", q)
            replace_parameter(layer, self.scale_name, scale)
        scale = getattr(layer, self.scale_name).data
        if not scale.is_contiguous() or scale.dtype != torch.float32:
            replace_parameter(layer, self.scale_name, scale.float().contiguous())
        if not layer.weight.data.is_contiguous():
            replace_parameter(layer, "weight", layer.weight.data.contiguous())
        self.backend = Fp8LinearBackend.for_device(layer.weight.device)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from fastdeploy.ops.fp8_linear import fp8_linear

        scale = getattr(layer, self.scale_name)
        return fp8_linear(x, layer.weight, scale, self.block, bias, self.backend)

    def apply_normed(
        self, layer: Linear, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An RMSNorm before a layer whose forward is its matmul, fused on a GPU: in decode one
        kernel (the GEMV's residual-add + RMSNorm prologue); with more rows and per-channel scales
        the add, norm and activation quantization in one kernel before ``_scaled_mm``. None
        otherwise (the norm runs on its own)."""
        from fastdeploy.model_executor.layers.layernorm import RMSNorm
        from fastdeploy.model_executor.layers.linear import Linear
        from fastdeploy.ops.fp8_linear import fp8_norm_fusable, fp8_norm_quant_fusable, fp8_norm_quant_linear

        if type(norm) is not RMSNorm or type(layer).forward is not Linear.forward:
            return None
        scale = getattr(layer, self.scale_name)
        if fp8_norm_fusable(x, residual, norm.weight, layer.weight, self.block, layer.bias, self.backend):
            from fastdeploy.ops.triton_fp8_gemv import fp8_norm_small_m_linear

            return fp8_norm_small_m_linear(
                x, residual, norm.weight, norm.eps, layer.weight, scale, self.block, layer.bias
            )
        if fp8_norm_quant_fusable(x, residual, norm.weight, layer.weight, self.block, self.backend):
            return fp8_norm_quant_linear(
                x, residual, norm.weight, norm.eps, layer.weight, scale, layer.bias, self.backend
            )
        return None

    def apply_silu_mul(self, layer: Linear, gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """down_proj of ``silu_and_mul(gate_up)``: one kernel in decode on a GPU (the GEMV's SiLU
        prologue, :func:`~fastdeploy.ops.fp8_linear.fp8_linear_silu_mul`)."""
        from fastdeploy.ops.fp8_linear import fp8_linear_silu_mul

        scale = getattr(layer, self.scale_name)
        return fp8_linear_silu_mul(gate_up, layer.weight, scale, self.block, bias, self.backend)
