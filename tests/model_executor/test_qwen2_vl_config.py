"""Qwen2-VL / Qwen2.5-VL configs in both layouts, and checkpoint names old and new."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from fastdeploy.model_executor.models import MODEL_REGISTRY
from fastdeploy.transformers_utils.config import ModelArchConfig

TEXT = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
)  # fmt: skip


def test_flat_config_of_the_original_checkpoints():
    """Qwen2-VL-2B-Instruct's layout: text keys at the top, ``rope_scaling.type = mrope``."""
    cfg = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        **TEXT,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vision_config": {"spatial_merge_size": 2, "hidden_size": 64},
        "image_token_id": 290,
        "video_token_id": 291,
        "vision_start_token_id": 292,
        "vision_end_token_id": 293,
        "tie_word_embeddings": True,
    }
    arch = ModelArchConfig.from_dict(cfg)
    assert arch.rope_scaling is None and arch.rope_theta == 1e6 and arch.attention_bias
    assert arch.mm.mrope_section == [2, 3, 3] and arch.mm.image_token_id == 290
    assert arch.mm.tokens_per_second is None and arch.tie_word_embeddings


def test_nested_text_config_of_newer_transformers():
    cfg = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "text_config": {**TEXT, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2]}},
        "vision_config": {"spatial_merge_size": 2, "tokens_per_second": 2},
        "image_token_id": 151655,
    }
    arch = ModelArchConfig.from_dict(cfg)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.max_position_embeddings) == (64, 2, 4096)
    assert arch.mm.mrope_section == [4, 2, 2] and arch.mm.tokens_per_second == 2
    assert arch.mm.video_token_id == 151656  # Qwen2-VL's default when the config leaves it out


def test_language_model_names_old_and_new_load_the_same_weights(qwen2_vl_dummy, caplog):
    folder, _ = qwen2_vl_dummy
    from fastdeploy.transformers_utils.config import read_config_json

    arch = ModelArchConfig.from_dict(read_config_json(str(folder)))
    saved = load_file(str(folder / "model.safetensors"))
    num_vision = sum(name.startswith("visual.") for name in saved)
    assert num_vision > 0
    renamed = {
        name.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): t
        for name, t in saved.items()
    }
    models = []
    for weights in (saved, renamed):
        model = MODEL_REGISTRY[arch.architecture](arch)
        with caplog.at_level(logging.INFO):
            model.load_weights(weights.items())
        models.append(model.state_dict())
    assert caplog.text.count(f"skipped {num_vision} vision tower tensors") == 2
    for name, tensor in models[0].items():
        assert torch.equal(tensor, models[1][name]), name
    embed = saved["model.embed_tokens.weight"]
    assert torch.equal(models[0]["model.embed_tokens.weight"], embed)


def test_a_model_without_a_multimodal_config_is_refused():
    from fastdeploy.model_executor.models.qwen2_vl import Qwen2VLForConditionalGeneration

    arch = ModelArchConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], **TEXT})
    with pytest.raises(ValueError, match="needs the multimodal part"):
        Qwen2VLForConditionalGeneration(arch)
