"""Qwen3-MoE and Qwen2-MoE: the llama.py decoder with sparse mixture-of-experts MLPs.

Attention is llama.py's (Qwen3-MoE: qk_norm, no biases; Qwen2-MoE: q/k/v biases). Layer i
has a sparse block when ``(i + 1) % decoder_sparse_step == 0`` and i is not in
``mlp_only_layers`` (as ``transformers`` defines them), else the dense :class:`LlamaMLP` of
``intermediate_size``. A sparse block is a router (``mlp.gate``, replicated on every rank)
and :class:`~fastdeploy.model_executor.layers.fused_moe.FusedMoE`; Qwen2-MoE adds a shared
expert every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.model_executor.layers.weight_loading import ShardId
from fastdeploy.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from fastdeploy.transformers_utils.config import ModelArchConfig

_EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale)$"
)


def is_sparse_layer(cfg: ModelArchConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has a mixture-of-experts block (``transformers``' rule)."""
    return (
        layer_idx not in cfg.mlp_only_layers
        and cfg.num_experts > 0
        and (layer_idx + 1) % cfg.decoder_sparse_step == 0
    )


class QwenMoeSparseBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's gated shared expert when ``shared_expert_intermediate_size``).

    Called like :class:`LlamaMLP`: ``(x, residual, norm)`` → (output, new residual). Under
    tensor parallelism the routed and shared experts' partial outputs are added first and
    summed over the ranks by one all-reduce.
    """

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        """``quant_config`` goes to the experts and the shared expert; the routers stay unquantized."""
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedMoE(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize=cfg.norm_topk_prob,
            quant_config=quant_config,
        )
        self.has_shared_expert = cfg.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            shared_size = cfg.shared_expert_intermediate_size
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = MergedColumnParallelLinear(
                cfg.hidden_size, [shared_size] * 2, bias=False, quant_config=quant_config
            )
            self.shared_expert.down_proj = RowParallelLinear(
                shared_size, cfg.hidden_size, bias=False, quant_config=quant_config
            )
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x + residual)`` → the block's output, and the new residual."""
        hidden, residual, quantized, logits = self.experts.norm_and_router_logits(
            x, residual, norm, self.gate
        )
        shared = (lambda: self.shared_expert_output(hidden)) if self.has_shared_expert else None
        return self.experts(hidden, logits, shared, quantized=quantized), residual

    def shared_expert_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's partial output of the gated shared expert (reduced with the routed experts')."""
        out = self.shared_expert.down_proj.matmul_silu_mul(self.shared_expert.gate_up_proj(hidden), None)
        return torch.sigmoid(self.shared_expert_gate(hidden)) * out


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (and, through the config's shared expert, Qwen2-MoE): llama.py with sparse blocks."""

    def build_mlp(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        """A :class:`QwenMoeSparseBlock` on sparse layers, the dense MLP elsewhere."""
        if is_sparse_layer(cfg, layer_idx):
            return QwenMoeSparseBlock(cfg, self.quant_config)
        return LlamaMLP(cfg, self.quant_config)

    def parameter_of(self, name: str) -> tuple[str, ShardId]:
        """``...experts.{e}.{proj}.weight`` → the stacked ``...experts.{gate_up|down}_proj``
        with shard id ``"{e}.{proj}"`` (an FP8 checkpoint's ``.weight_scale_inv`` / ``.weight_scale``
        → the stacked ``..._proj_scale_inv`` / ``..._proj_scale``); every other name as llama.py maps it."""
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            return super().parameter_of(name)
        prefix, expert, proj, kind = match.groups()
        stacked = "down_proj" if proj == "down_proj" else "gate_up_proj"
        suffix = kind.removeprefix("weight")
        return f"{prefix}.{stacked}{suffix}", f"{expert}.{proj}"


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: q/k/v biases (config key ``qkv_bias``), no qk_norm, and a gated shared expert."""

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        cfg = dataclasses.replace(cfg, attention_bias=bool(cfg.raw.get("qkv_bias", True)))
        super().__init__(cfg, quant_config)
