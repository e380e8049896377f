"""The model architecture description the engine needs, parsed from config.json or GGUF.

We read the checkpoint's ``config.json`` keys ourselves instead of instantiating
a ``transformers`` config, so the engine's model code depends on nothing but
this dataclass.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

QWEN2_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    *QWEN2_VL_ARCHITECTURES,
)
HEADLESS_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""Bare decoders (``*Model``: no LM head, tensor names without the ``model.`` prefix), as embedding
models are saved → the causal-LM architecture whose decoder they are. Served by the pooling runner."""


@dataclass
class MultimodalArchConfig:
    """What a Qwen2-VL style language model needs to place precomputed vision features.

    Features replace the embeddings of placeholder tokens (``image_token_id`` /
    ``video_token_id``); rotary positions are 3 rows (t, h, w) per token (M-RoPE),
    whose frequency bands are split by ``mrope_section``.
    """

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    """The vision tower merges ``spatial_merge_size x spatial_merge_size`` patches into one feature row."""
    mrope_section: list[int]
    """Rotary frequencies driven by the t, h and w position rows (sums to head_dim / 2)."""
    tokens_per_second: float | None = None
    """Qwen2.5-VL: temporal position step of a video per second of it (None: step 1, Qwen2-VL)."""

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], rope: dict[str, Any], arch: str) -> MultimodalArchConfig:
        """Read the token ids, merge size and M-RoPE sections of a (flattened) Qwen2-VL config."""
        vision = cfg.get("vision_config") or {}
        return cls(
            image_token_id=cfg.get("image_token_id", 151655),
            video_token_id=cfg.get("video_token_id", 151656),
            vision_start_token_id=cfg.get("vision_start_token_id", 151652),
            vision_end_token_id=cfg.get("vision_end_token_id", 151653),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            mrope_section=list(rope.get("mrope_section") or [16, 24, 24]),
            tokens_per_second=(
                vision.get("tokens_per_second", 2) if arch == "Qwen2_5_VLForConditionalGeneration" else None
            ),
        )


def flatten_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config with its language model's keys at the top level.

    Newer ``transformers`` nest them under ``text_config``; older checkpoints
    keep them at the top. Keys of ``text_config`` win; the rest of the top
    level (architectures, token ids, ``vision_config``) is kept.
    """
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    flat = {**cfg, **{k: v for k, v in text.items() if v is not None or k not in cfg}}
    flat.pop("text_config")
    flat["architectures"] = cfg.get("architectures") or text.get("architectures")
    return flat


@dataclass
class ModelArchConfig:
    """Shapes and numerics of a decoder-only transformer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    proj_bias: bool = False
    """o_proj and the MLP projections carry biases too (Ernie-4.5 ``use_bias``)."""
    rope_interleaved: bool = False
    """Rotary pairs are interleaved features ``(2i, 2i+1)`` (Ernie-4.5), not the two halves."""
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    num_experts: int = 0
    """Mixture-of-experts models: routed experts per sparse layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Intermediate size of one routed expert."""
    norm_topk_prob: bool = False
    """Renormalise the top-k routing weights to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP in a mixture-of-experts model."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: intermediate size of the shared expert every token goes through (0: none)."""
    moe_num_shared_experts: int = 0
    """Ernie-4.5-MoE: shared experts every token goes through, as one MLP of
    ``moe_num_shared_experts x moe_intermediate_size`` (0: none)."""
    moe_layer_start_index: int = 0
    """Ernie-4.5-MoE: layer i is sparse when ``start <= i <= end`` and ``(i + 1) % interval == 0``."""
    moe_layer_end_index: int = -1
    """Ernie-4.5-MoE: last sparse layer (-1: the last layer)."""
    moe_layer_interval: int = 1
    """Ernie-4.5-MoE: sparse layer interval."""
    mm: MultimodalArchConfig | None = None
    """Set for vision-language models (Qwen2-VL, Qwen2.5-VL): placeholder tokens and M-RoPE."""
    headless: bool = False
    """A bare decoder checkpoint (:data:`HEADLESS_ARCHITECTURES`): no LM head (the embedding is
    tied to it) and tensor names without the ``model.`` prefix; an embedding model."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The config.json dict it came from (for reference models in tests)."""

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        """Parse a Hugging Face ``config.json`` dict; raises for unknown architectures."""
        cfg = flatten_text_config(cfg)
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        headless = arch is None and any(a in HEADLESS_ARCHITECTURES for a in archs)
        if headless:
            arch = HEADLESS_ARCHITECTURES[next(a for a in archs if a in HEADLESS_ARCHITECTURES)]
        if arch is None:
            raise ArchConfigError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join([*SUPPORTED_ARCHITECTURES, *HEADLESS_ARCHITECTURES])}"
            )
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        eos = cfg.get("eos_token_id")
        mm = None
        ernie = arch in ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")
        if arch in QWEN2_VL_ARCHITECTURES:
            scaling = rope_scaling or {}
            mm = MultimodalArchConfig.from_dict(cfg, {**rope, **scaling}, arch)
            if scaling.get("rope_type", scaling.get("type", "default")) in ("mrope", "default"):
                rope_scaling = None  # M-RoPE is the model's own rotary, not a scaling
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=rope_scaling,
            tie_word_embeddings=headless or cfg.get("tie_word_embeddings", ernie),
            attention_bias=cfg.get(
                "use_bias" if ernie else "attention_bias", arch == "Qwen2ForCausalLM" or mm is not None
            ),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            proj_bias=ernie and bool(cfg.get("use_bias", False)),
            rope_interleaved=ernie,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            num_experts=cfg.get("num_experts")
            or cfg.get("num_local_experts")
            or cfg.get("moe_num_experts")
            or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or cfg.get("moe_k") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            moe_num_shared_experts=cfg.get("moe_num_shared_experts") or 0,
            moe_layer_start_index=cfg.get("moe_layer_start_index") or 0,
            moe_layer_end_index=cfg.get("moe_layer_end_index", -1),
            moe_layer_interval=cfg.get("moe_layer_interval") or 1,
            mm=mm,
            headless=headless,
            raw=cfg,
        )


class ArchConfigError(ValueError):
    """The model's config names an architecture or layout we do not implement."""


def read_config_json(folder: str) -> dict[str, Any]:
    """Load ``folder/config.json``, with a clear error when it is missing."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model folder {folder!r}")
    with open(path) as f:
        return json.load(f)


GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The keys of ``generation_config.json`` that set request defaults (vLLM's list)."""
GENERATION_CONFIG_OFF = ("none", "vllm")
"""``--generation-config`` values that read no file (OpenAI's defaults; ``vllm`` is vLLM's name)."""


def read_generation_defaults(setting: str, model_folder: str) -> dict[str, float | int]:
    """The sampling defaults ``--generation-config`` asks for: from ``model_folder`` (``auto``) or
    another folder's ``generation_config.json``, none for ``none`` / ``vllm`` or without the file.
    Only the keys of :data:`GENERATION_DEFAULT_KEYS` that hold numbers are kept; a top_k of 0
    (transformers' "off") is -1, the engine's."""
    if setting in GENERATION_CONFIG_OFF:
        return {}
    folder = model_folder if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if setting != "auto":
            raise FileNotFoundError(f"--generation-config: no generation_config.json in {folder!r}")
        return {}
    with open(path) as f:
        data = json.load(f)
    defaults = {
        key: data[key]
        for key in GENERATION_DEFAULT_KEYS
        if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool)
    }
    if defaults.get("top_k") == 0:
        defaults["top_k"] = -1
    return defaults


def read_generation_eos(folder: str) -> list[int]:
    """EOS ids from ``generation_config.json`` (often more than config.json lists)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
