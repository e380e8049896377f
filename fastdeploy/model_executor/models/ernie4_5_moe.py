"""Ernie-4.5-MoE (``Ernie4_5_MoeForCausalLM``): the Ernie-4.5 decoder with sparse mixture-of-experts MLPs.

Attention is llama.py's with Ernie's flags (interleaved rotary, ``use_bias`` on every
projection). Layer i has a sparse block when ``moe_layer_start_index <= i <=
moe_layer_end_index`` and ``(i + 1) % moe_layer_interval == 0`` (as ``transformers``
defines them), else the dense MLP of ``intermediate_size``. A sparse block is a router
(``mlp.gate``, replicated), routed experts (:class:`FusedMoE`, chosen by softmax + the
checkpoint's ``e_score_correction_bias`` but weighted by the plain softmax, renormalised),
and shared experts: one ungated MLP of ``moe_num_shared_experts x moe_intermediate_size``
added to every token's output.
"""

from __future__ import annotations

import torch
from torch import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import Linear
from fastdeploy.model_executor.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.model_executor.layers.weight_loading import ShardId
from fastdeploy.model_executor.models.llama import LlamaMLP
from fastdeploy.model_executor.models.qwen_moe import Qwen3MoeForCausalLM
from fastdeploy.transformers_utils.config import ModelArchConfig


def is_ernie_sparse_layer(cfg: ModelArchConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has a mixture-of-experts block (``transformers``' Ernie rule)."""
    end = cfg.num_hidden_layers - 1 if cfg.moe_layer_end_index == -1 else cfg.moe_layer_end_index
    return (
        cfg.num_experts > 0
        and (layer_idx + 1) % cfg.moe_layer_interval == 0
        and cfg.moe_layer_start_index <= layer_idx <= end
    )


class ErnieMoeSparseBlock(nn.Module):
    """Router (+ its score-correction bias) + routed experts + shared experts.

    Called like :class:`LlamaMLP`: ``(x, residual, norm)`` → (output, new residual).
    """

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        """``quant_config`` goes to the routed and shared experts; the router stays unquantized."""
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.moe_statics = nn.Module()
        self.moe_statics.e_score_correction_bias = nn.Parameter(
            torch.zeros(1, cfg.num_experts), requires_grad=False
        )
        self.experts = FusedMoE(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize=True,
            quant_config=quant_config,
        )
        self.shared_experts = None
        if cfg.moe_num_shared_experts > 0:
            shared_size = cfg.moe_intermediate_size * cfg.moe_num_shared_experts
            self.shared_experts = nn.Module()
            self.shared_experts.gate_up_proj = MergedColumnParallelLinear(
                cfg.hidden_size, [shared_size] * 2, bias=cfg.proj_bias, quant_config=quant_config
            )
            self.shared_experts.down_proj = RowParallelLinear(
                shared_size, cfg.hidden_size, bias=cfg.proj_bias, quant_config=quant_config
            )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x + residual)`` → the block's output, and the new residual."""
        hidden, residual, quantized, logits = self.experts.norm_and_router_logits(
            x, residual, norm, self.gate
        )
        shared = (lambda: self.shared_experts_output(hidden)) if self.shared_experts is not None else None
        bias = self.moe_statics.e_score_correction_bias
        return self.experts(hidden, logits, shared, bias, quantized), residual

    def shared_experts_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's partial output of the shared experts (the bias, held whole, added on rank 0
        only), reduced with the routed experts' output."""
        down = self.shared_experts.down_proj
        out = down.matmul_silu_mul(self.shared_experts.gate_up_proj(hidden), None)
        if down.bias is not None and down.tp_rank == 0:
            out = out + down.bias
        return out


class Ernie4_5_MoeForCausalLM(Qwen3MoeForCausalLM):
    """Ernie-4.5-MoE: llama.py with Ernie's flags and :class:`ErnieMoeSparseBlock` on its sparse layers
    (checkpoint expert names as Qwen MoE's, so the weight mapping is inherited). With ``use_bias``
    the LM head has a bias too (``lm_head.bias``, held whole on every rank)."""

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        super().__init__(cfg, quant_config)
        self.lm_head_bias = (
            nn.Parameter(torch.zeros(cfg.vocab_size), requires_grad=False) if cfg.proj_bias else None
        )

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's float32 logits ``[N, vocab]`` plus its bias (with ``use_bias``)."""
        logits = super().compute_logits(hidden, out)
        return logits if self.lm_head_bias is None else logits.add_(self.lm_head_bias)

    def parameter_of(self, name: str) -> tuple[str, ShardId]:
        """``lm_head.bias`` → ``lm_head_bias``; the rest as Qwen MoE maps it."""
        return ("lm_head_bias", None) if name == "lm_head.bias" else super().parameter_of(name)

    def build_mlp(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        """An :class:`ErnieMoeSparseBlock` on sparse layers, the dense MLP elsewhere."""
        if is_ernie_sparse_layer(cfg, layer_idx):
            return ErnieMoeSparseBlock(cfg, self.quant_config)
        return LlamaMLP(cfg, self.quant_config)
