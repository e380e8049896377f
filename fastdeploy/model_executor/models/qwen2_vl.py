"""Qwen2-VL / Qwen2.5-VL language model: the Qwen2 decoder with multimodal rotary positions.

The decoder layers are llama.py's (Qwen2 = Llama with q/k/v biases); only the
rotary embedding differs: M-RoPE (:mod:`fastdeploy.model_executor.layers.mrope`)
over 3-row positions ``[3, T]`` that the runner computes from each item's
``grid_thw`` (:mod:`fastdeploy.multimodal.positions`). Image and video features
come precomputed with the request and replace the embeddings of their
placeholder tokens (``inputs_embeds``); the vision tower is not part of this
model, and its checkpoint weights (``visual.*``) are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from fastdeploy.model_executor.layers.mrope import MRotaryEmbedding
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.model_executor.models.llama import LlamaForCausalLM
from fastdeploy.transformers_utils.config import ModelArchConfig

logger = logging.getLogger(__name__)

_VISION_PREFIXES = ("visual.", "model.visual.")
_LANGUAGE_MODEL_PREFIX = "model.language_model."


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The language model of Qwen2-VL and Qwen2.5-VL; takes ``[3, T]`` (or ``[T]``) positions."""

    uses_mrope = True
    """The runner passes 3-row M-RoPE positions (and no decode CUDA graphs are captured)."""

    def __init__(self, cfg: ModelArchConfig, quant_config: QuantizationConfig | None = None):
        if cfg.mm is None:
            raise ValueError(f"{cfg.architecture} needs the multimodal part of its config")
        super().__init__(cfg, quant_config)
        rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mm.mrope_section)
        for layer in self.model.layers:  # one table, built once per forward pass, for every layer
            layer.self_attn.rotary_emb = rotary

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]``, into which the runner scatters feature rows."""
        return self.model.embed_tokens(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the language model's tensors (``model.*`` or ``model.language_model.*``, ``lm_head``);
        the vision tower's (``visual.*``) are skipped."""
        super().load_weights(self._language_model_weights(weights))

    @staticmethod
    def _language_model_weights(
        weights: Iterable[tuple[str, torch.Tensor]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        skipped = 0
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                skipped += 1
                continue
            if name.startswith(_LANGUAGE_MODEL_PREFIX):
                name = "model." + name[len(_LANGUAGE_MODEL_PREFIX) :]
            yield name, tensor
        if skipped:
            logger.info(
                "skipped %d vision tower tensors (visual.*): this engine takes precomputed image/video "
                "features, the vision encoder is not loaded",
                skipped,
            )
