"""How the served model pools: ``--runner``, bare decoder checkpoints, sentence-transformers
folders, ``--pooler-config`` and Matryoshka dimensions (``transformers_utils/pooling.py``)."""

from __future__ import annotations

import json

import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.transformers_utils.config import ModelArchConfig
from fastdeploy.transformers_utils.pooling import PoolerConfigError, resolve_pooler

CONFIG = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def arch(name: str, **extra) -> ModelArchConfig:
    return ModelArchConfig.from_dict({"architectures": [name], **CONFIG, **extra})


def sentence_transformers(folder, flag: str, normalize: bool) -> None:
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({flag: True, "pooling_mode_cls_token": False})
    )


def test_bare_decoder_is_an_embedding_model(tmp_path):
    qwen3 = arch("Qwen3Model")
    assert qwen3.headless and qwen3.architecture == "Qwen3ForCausalLM" and qwen3.qk_norm
    assert qwen3.tie_word_embeddings  # no LM head in the checkpoint
    pooler = resolve_pooler(ModelConfig(), str(tmp_path), qwen3)
    assert (pooler.pooling_type, pooler.normalize, pooler.is_matryoshka) == ("last", True, False)
    assert resolve_pooler(ModelConfig(runner="generate"), str(tmp_path), qwen3) is None
    assert resolve_pooler(ModelConfig(), str(tmp_path), arch("Qwen3ForCausalLM")) is None


def test_sentence_transformers_folder(tmp_path):
    causal = arch("Qwen3ForCausalLM")  # as Qwen3-Embedding ships
    sentence_transformers(tmp_path, "pooling_mode_lasttoken", normalize=True)
    pooler = resolve_pooler(ModelConfig(), str(tmp_path), causal)
    assert (pooler.pooling_type, pooler.normalize) == ("last", True)
    override = ModelConfig(pooler_config={"pooling_type": "MEAN", "normalize": False})
    pooler = resolve_pooler(override, str(tmp_path), causal)
    assert (pooler.pooling_type, pooler.normalize) == ("mean", False)


def test_mean_without_normalize_module(tmp_path):
    sentence_transformers(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    pooler = resolve_pooler(ModelConfig(), str(tmp_path), arch("LlamaModel"))
    assert (pooler.pooling_type, pooler.normalize) == ("mean", False)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (ModelConfig(pooler_config={"pooling_type": "CLS"}), "not implemented"),
        (ModelConfig(pooler_config={"pooling": "MEAN"}), "unknown pooler_config keys"),
        (ModelConfig(pooler_config={"normalize": "yes"}), "true or false"),
        (ModelConfig(runner="generate", pooler_config={"normalize": False}), "runner pooling"),
    ],
)
def test_bad_settings_are_refused(tmp_path, model, message):
    with pytest.raises(PoolerConfigError, match=message):
        resolve_pooler(model, str(tmp_path), arch("Qwen3Model"))


def test_unsupported_sentence_transformers_mode(tmp_path):
    sentence_transformers(tmp_path, "pooling_mode_max_tokens", normalize=False)
    with pytest.raises(PoolerConfigError, match="not implemented"):
        resolve_pooler(ModelConfig(), str(tmp_path), arch("Qwen3Model"))


def test_matryoshka_dimensions(tmp_path):
    listed = resolve_pooler(ModelConfig(), str(tmp_path), arch("Qwen3Model", matryoshka_dimensions=[16, 32]))
    assert listed.dimensions_error(32, 64) is None
    assert "16, 32" in listed.dimensions_error(20, 64)
    anything = resolve_pooler(ModelConfig(), str(tmp_path), arch("Qwen3Model", is_matryoshka=True))
    assert anything.dimensions_error(20, 64) is None
    assert "from 1 to" in anything.dimensions_error(65, 64)
    plain = resolve_pooler(ModelConfig(), str(tmp_path), arch("Qwen3Model"))
    assert "matryoshka" in plain.dimensions_error(16, 64)
