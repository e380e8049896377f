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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The config.json dict it came from (for reference models in tests)."""

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        """Parse a Hugging Face ``config.json`` dict; raises for unknown architectures."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ArchConfigError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        eos = cfg.get("eos_token_id")
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
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
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


def read_generation_eos(folder: str) -> list[int]:
    """EOS ids from ``generation_config.json`` (often more than config.json lists)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
