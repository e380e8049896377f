"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3), written once.

Differences between the family members are flags of ``ModelArchConfig``:
``attention_bias`` (Qwen2), ``qk_norm`` (Qwen3), ``tie_word_embeddings``, rope
scaling, and ``proj_bias`` with ``rope_interleaved`` (Ernie-4.5 dense: biases on every
projection, rotary over interleaved pairs). Inputs are flattened tokens of the whole
batch; attention goes through the paged-cache ``Attention`` layer.

Tensor parallelism: the layers are the parallel ones of
:mod:`~fastdeploy.model_executor.layers.parallel_linear` and
:mod:`~fastdeploy.model_executor.layers.vocab_parallel_embedding`, built for the group
that :func:`fastdeploy.distributed.init_tensor_parallel` set up before the model; each
rank holds its attention heads, its slice of the MLP and of the vocabulary, and loads its
own shards from the full checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fastdeploy.model_executor.attention import Attention
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import load_triton_norm_gemv, small_m_context
from fastdeploy.model_executor.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.model_executor.layers.rotary_embedding import InterleavedRotaryEmbedding, RotaryEmbedding
from fastdeploy.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.model_executor.layers.weight_loading import ShardId, checkpoint_shapes, weight_loader
from fastdeploy.ops.layer_ops import qk_norm_rotary_
from fastdeploy.transformers_utils.config import ModelArchConfig


class WeightLoadError(ValueError):
    """A checkpoint tensor does not fit the model (wrong shape, missing, unknown)."""


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (``num_heads`` / ``num_kv_heads`` are the local counts);
    o_proj sums the ranks' outputs."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.attention_bias,
            quant_config=quant_config,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=cfg.proj_bias,
            input_shard=(self.qkv_proj.heads.head_start * self.head_dim, self.q_size),
            quant_config=quant_config,
        )
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        rotary_cls = InterleavedRotaryEmbedding if cfg.rope_interleaved else RotaryEmbedding
        self.rotary_emb = rotary_cls(
            self.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, layer_idx
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(hidden + residual)`` → attention output, and the new residual."""
        rotary = self._fused_rotary_cache(positions, hidden, residual)
        if rotary is not None:  # GPU small-M decode: norm, qkv, rotary and cache write in one kernel
            qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm, rotary)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.o_proj(self.attn(q, k, v, cache_written=True)), residual
        qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
        num_tokens = qkv.shape[0]
        if self.qk_norm and type(self.rotary_emb) is RotaryEmbedding:  # one kernel on a GPU
            rope = self.rotary_emb
            # on a GPU the same kernel writes the keys and values to the cache
            cache = self.attn.cache_target(num_tokens) if self.attn.fuses_rotary(qkv) else None
            qk_norm_rotary_(
                positions, qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                rope.cos_cache, rope.sin_cache, self.num_heads, self.num_kv_heads, self.head_dim, cache,
            )  # fmt: skip
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.o_proj(self.attn(q, k, v, cache_written=cache is not None)), residual
        elif self.qk_norm:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim)).reshape(num_tokens, -1)
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, -1)
            self.rotary_emb(positions, q, self.num_heads)
            self.rotary_emb(positions, k, self.num_kv_heads)
        elif type(self.rotary_emb) is RotaryEmbedding and self.attn.fuses_rotary(qkv):
            # GPU: the rotary embedding and the KV-cache write in one kernel
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.o_proj(self.attn(q, k, v, rotary=(positions, self.rotary_emb))), residual
        else:  # q and k heads lead each row of qkv: rotate them in place in one call
            self.rotary_emb(positions, qkv, self.num_heads + self.num_kv_heads)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v)), residual

    def _fused_rotary_cache(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> object | None:
        """The qkv kernel's rotary + cache-write epilogue (a ``RotaryCache``), where it can run."""
        if self.qk_norm or type(self.rotary_emb) is not RotaryEmbedding or not small_m_context(hidden):
            return None
        fused = load_triton_norm_gemv()
        target = self.attn.cache_target(hidden.shape[0]) if fused is not None else None
        if target is None:
            return None
        key_cache, value_cache, slot_mapping = target
        rope = self.rotary_emb
        rotary = fused.RotaryCache(
            positions, rope.cos_cache, rope.sin_cache, slot_mapping, key_cache, value_cache,
            self.num_heads, self.num_kv_heads, self.head_dim,
        )  # fmt: skip
        return rotary if self.qkv_proj.fuses_norm(hidden, residual, rotary) else None


class LlamaMLP(nn.Module):
    """SwiGLU MLP over this rank's slice of the intermediate features; down_proj sums the ranks'."""

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.proj_bias, quant_config=quant_config
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.proj_bias, quant_config=quant_config
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x + residual)`` → MLP output, and the new residual."""
        gate_up, residual = self.gate_up_proj.forward_normed(x, residual, norm)
        return self.down_proj.forward_silu_mul(gate_up), residual


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP; ``mlp`` replaces the dense :class:`LlamaMLP` (a mixture of experts),
    called like it: ``mlp(x, residual, norm)`` → (output, new residual)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        layer_idx: int,
        mlp: nn.Module | None = None,
        quant_config: QuantizationConfig | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, quant_config)
        self.mlp = LlamaMLP(cfg, quant_config) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        build_mlp: Callable[[ModelArchConfig, int], nn.Module] | None = None,
        quant_config: QuantizationConfig | None = None,
    ):
        """``build_mlp(cfg, layer_idx)``: each layer's MLP (default the dense :class:`LlamaMLP`);
        ``quant_config``: the quantization of the attention (and dense MLP) projections."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, None if build_mlp is None else build_mlp(cfg, i), quant_config)
            for i in range(cfg.num_hidden_layers)
        )
        shared_rotary = self.layers[0].self_attn.rotary_emb  # one cos/sin table for every layer
        for layer in self.layers[1:]:
            layer.self_attn.rotary_emb = shared_rotary
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# checkpoint name fragment → (our fused parameter fragment, shard id of its loader)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; also serves Mistral, Qwen2, Qwen3 and Ernie-4.5 (dense) checkpoints.

    ``quant_config`` (e.g. FP8) goes to every projection of the decoder layers and to their
    MLPs; the embedding, the LM head and the norms stay in the model dtype."""

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        super().__init__()
        self.config = cfg
        self.quant_config = quant_config
        self.model = LlamaModel(cfg, self.build_mlp, quant_config)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flattened tokens [T] at absolute positions [T] → final hidden states [T, hidden]."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [N, hidden] → float32 logits [N, vocab] (the full vocabulary on every
        tensor-parallel rank), written into ``out`` when given."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def build_mlp(self, cfg: ModelArchConfig, layer_idx: int) -> nn.Module:
        """The MLP of layer ``layer_idx``: dense here; mixture-of-experts models override it
        (:attr:`quant_config` is set before this is called)."""
        return LlamaMLP(cfg, self.quant_config)

    def parameter_of(self, name: str) -> tuple[str, ShardId]:
        """Our parameter name and its loader's shard id for a checkpoint tensor name."""
        return _parameter_of(name)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand each full checkpoint tensor (Hugging Face names) to its parameter's loader, which
        copies this rank's shard (into a fused parameter's region for q/k/v and gate/up).

        Raises ``WeightLoadError`` for a tensor no parameter takes, a shape mismatch (naming
        the tensor and both full shapes) and parameters the checkpoint did not provide.
        """
        params = dict(self.named_parameters())  # (a tied lm_head.weight is listed once, as the embedding)
        loaded: set[tuple[str, ShardId]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = self.parameter_of(name)
            param = params.get(target)
            shapes = checkpoint_shapes(param) if param is not None else {}
            if shard not in shapes:
                raise WeightLoadError(f"checkpoint tensor {name!r} has no matching model parameter")
            if tuple(tensor.shape) != shapes[shard]:
                raise WeightLoadError(
                    f"shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, "
                    f"model expects {shapes[shard]}"
                )
            weight_loader(param)(param, tensor, shard)
            loaded.add((target, shard))
        expected = {(pname, shard) for pname, param in params.items() for shard in checkpoint_shapes(param)}
        missing = sorted(expected - loaded, key=str)
        if missing:
            shown = ", ".join(pname if shard is None else f"{pname}:{shard}" for pname, shard in missing[:5])
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {shown}")


def _parameter_of(name: str) -> tuple[str, ShardId]:
    """Our parameter name and shard id for a checkpoint tensor name (q_proj → qkv_proj, "q"; ...)."""
    for ckpt_part, fused_part, shard_id in _STACKED:
        if f".{ckpt_part}." in name:
            return name.replace(ckpt_part, fused_part), shard_id
    return name, None
