"""FP8 (e4m3) expert weights of a :class:`~fastdeploy.model_executor.layers.fused_moe.FusedMoE` layer.

The stacked ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` become float8_e4m3fn with
float32 dequantization scales (``w ≈ fp8 * scale``), in one of the two layouts the fused-MoE
kernel (:mod:`fastdeploy.ops.triton_fused_moe`) takes:

* **block-scaled** (``weight_block_size``, 128 x 128 by default; ``--quantization fp8``):
  ``gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(H/bk)]`` and
  ``down_proj_scale_inv [E, ceil(H/bn), ceil(I/bk)]``; activations get dynamic 1 x ``bk`` scales.
* **per output channel** (no ``weight_block_size``; ``--quantization ptpc_fp8``):
  ``gate_up_proj_scale [E, 2I]`` and ``down_proj_scale [E, H]``; activations get one dynamic
  scale per token.

Two sources:

* Online (``--quantization fp8`` / ``ptpc_fp8`` on a bf16/fp32 checkpoint): the weights load as
  usual and :meth:`Fp8MoEMethod.process_weights_after_loading` quantizes each expert's shard.
* An FP8 checkpoint: the fp8 weights go through the usual per-expert loaders and the scales
  through :meth:`Fp8MoEMethod.scale_loader` (shard ids ``"{e}.{proj}"``, as the weights').
  Block-scaled (Qwen3-*-FP8, DeepSeek style: ``experts.{e}.gate_proj.weight_scale_inv``): the
  stacked gate_up scale rows are gate's then up's, so this rank's intermediate slice must be
  whole blocks (``I / tp % bn == 0``; and ``% bk`` for down's columns under tensor parallelism):
  ValueError otherwise. Per-tensor or per-channel (AutoFP8 style: ``weight_scale``, a scalar per
  projection, or one per output row): spread over, or copied into, the projection's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastdeploy.model_executor.layers.linear import rows_invariant
from fastdeploy.model_executor.layers.quantization.base import QuantizationConfig
from fastdeploy.model_executor.layers.quantization.fp8 import Fp8Config, replace_parameter
from fastdeploy.model_executor.layers.weight_loading import ShardId, copy_rows, set_weight_loader
from fastdeploy.ops.fp8_linear import fp8_linear_torch
from fastdeploy.ops.fp8_quant import FP8_DTYPE, quantize_weight_block, quantize_weight_per_channel

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.fused_moe import FusedMoE

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""Checkpoint names of an expert's three projections (``...experts.{e}.{name}.weight``)."""
BLOCK_SCALE_SUFFIX = "_scale_inv"
"""``<weight parameter><suffix>`` names a stacked weight's block-scale parameter (``gate_up_proj_scale_inv``)."""
CHANNEL_SCALE_SUFFIX = "_scale"
"""... and its per-channel scale parameter (``gate_up_proj_scale``)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None
) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T`` in ``x``'s dtype, for one expert on the torch path.

    With a ``scale`` (FP8 ``weight``) it computes what the FP8 kernel computes: ``x`` quantized per
    token and ``block[1]`` columns (per token when ``block`` is None: per-channel ``scale [N]``),
    both operands dequantized, multiplied in float32.
    """
    if scale is None:  # (row by row the same bits whatever the expert's row count: rows_invariant)
        return rows_invariant(x, lambda rows: torch.mm(rows, weight.t()))
    return rows_invariant(x, lambda rows: fp8_linear_torch(rows, weight, scale, block))


@dataclass(frozen=True)
class Fp8MoEMethod:
    """FP8 experts: the scale parameters, their loader, and quantization at load."""

    block: tuple[int, int] | None
    """``(bn, bk)``: rows and columns of one weight scale's tile; None: one scale per output channel."""
    is_checkpoint_fp8: bool
    """The checkpoint holds fp8 experts and ``weight_scale_inv`` (else they are quantized at load)."""

    @classmethod
    def from_config(cls, quant_config: QuantizationConfig | None) -> Fp8MoEMethod | None:
        """The method of a model's quantization config (an :class:`Fp8Config`; None: unquantized).

        ValueError for another method.
        """
        if quant_config is None:
            return None
        if not isinstance(quant_config, Fp8Config):
            raise ValueError(
                f"mixture-of-experts layers support the fp8 quantization only, not {quant_config.name!r}"
            )
        block = quant_config.weight_block_size
        block = None if block is None else tuple(int(b) for b in block)
        return cls(block, bool(quant_config.is_checkpoint_fp8))

    @property
    def scale_suffix(self) -> str:
        """The scale parameters' suffix: ``_scale_inv`` (block-scaled) or ``_scale`` (per channel)."""
        return CHANNEL_SCALE_SUFFIX if self.block is None else BLOCK_SCALE_SUFFIX

    def create_weights(self, layer: FusedMoE) -> None:
        """FP8 checkpoints: make the stacked weights float8 and add their scale parameters
        (with loaders). Online quantization keeps the model-dtype weights until loading is done."""
        if not self.is_checkpoint_fp8:
            return
        if self.block is not None:
            bn, bk = self.block
            local, tp = layer.local_intermediate, layer.tp_size
            if local % bn or (tp > 1 and local % bk):
                raise ValueError(
                    f"FP8 experts: this rank's {local} intermediate features are not whole {bn}x{bk} "
                    f"blocks of the checkpoint's weight_scale_inv; use a tensor_parallel_size that "
                    f"leaves a multiple of {max(bn, bk) if tp > 1 else bn}"
                )
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(layer, name)
            replace_parameter(layer, name, torch.empty_like(weight, dtype=FP8_DTYPE))
            n, k = weight.shape[1:]
            if self.block is None:
                shapes = {shard: () for shard in weight.checkpoint_shapes}
                shape = (weight.shape[0], n)
            else:
                shapes = {
                    shard: (_cdiv(full[0], bn), _cdiv(full[1], bk))
                    for shard, full in weight.checkpoint_shapes.items()
                }
                shape = (weight.shape[0], _cdiv(n, bn), _cdiv(k, bk))
            scale = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            set_weight_loader(scale, self.scale_loader(layer), shapes)
            setattr(layer, name + self.scale_suffix, scale)

    def scale_loader(self, layer: FusedMoE):
        """The loader of a scale parameter: one expert's checkpoint scale (shard id
        ``"{expert}.{gate_proj|up_proj|down_proj}"``). Block scales: this rank's blocks of its
        ``weight_scale_inv``. Per channel: its ``weight_scale``, a scalar spread over the
        projection's rows (this rank's) or one value per row."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            index, proj = layer.local_expert(shard_id)
            if proj not in EXPERT_PROJECTIONS:
                raise ValueError(
                    f"expert scales load shards '<e>.gate_proj/up_proj/down_proj', not {shard_id!r}"
                )
            if index is None:
                return  # another expert-parallel rank's expert
            dest = param.data[index]
            local, start = layer.local_intermediate, layer.weight_tp_rank * layer.local_intermediate
            loaded = loaded.float()
            if self.block is None:
                rows = (
                    dest
                    if proj == "down_proj"
                    else dest.narrow(0, 0 if proj == "gate_proj" else local, local)
                )
                if loaded.numel() == 1:
                    rows.fill_(float(loaded.reshape(-1)[0]))
                else:  # one scale per checkpoint row: down's are all H, gate/up's this rank's slice
                    copy_rows(rows, loaded.reshape(-1), 0, 0 if proj == "down_proj" else start)
                return
            bn, bk = self.block
            if proj == "down_proj":  # [ceil(H/bn), I/bk]: this rank's column blocks
                copy_rows(dest, loaded, 1, start // bk)
            else:  # [I/bn, ceil(H/bk)]: this rank's row blocks
                blocks = local // bn
                region = dest.narrow(0, 0 if proj == "gate_proj" else blocks, blocks)
                copy_rows(region, loaded, 0, layer.weight_tp_rank * blocks)

        return load

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        """Online: quantize each expert's loaded shard in ``block`` tiles or per output channel (one
        expert at a time, so the float32 temporaries stay one expert's size). FP8 checkpoints:
        nothing to do."""
        if self.is_checkpoint_fp8:
            return
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(layer, name).data
            q = torch.empty_like(weight, dtype=FP8_DTYPE)
            n, k = weight.shape[1:]
            if self.block is None:
                shape = (weight.shape[0], n)
            else:
                shape = (weight.shape[0], _cdiv(n, self.block[0]), _cdiv(k, self.block[1]))
            scale = torch.empty(shape, dtype=torch.float32, device=weight.device)
            for e in range(weight.shape[0]):
                if self.block is None:
                    q[e], scale[e] = quantize_weight_per_channel(weight[e])
                else:
                    q[e], scale[e] = quantize_weight_block(weight[e], self.block)
            replace_parameter(layer, name, q)
            setattr(layer, name + self.scale_suffix, nn.Parameter(scale, requires_grad=False))

    def scales(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales of ``gate_up_proj`` and ``down_proj`` of a layer whose experts are FP8."""
        return getattr(layer, "gate_up_proj" + self.scale_suffix), getattr(
            layer, "down_proj" + self.scale_suffix
        )
