"""``--generation-config``: a model's generation_config.json sets the sampling defaults of requests
that leave them unset (as vLLM does), offline and through the API; ``none`` keeps OpenAI's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from fastdeploy.model_executor.model_loader import load_generation_defaults
from fastdeploy.transformers_utils.config import read_generation_defaults

QWEN3_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": [1, 2]}


def folder_with(tmp_path, data: dict) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    return str(tmp_path)


def test_read_generation_defaults(tmp_path):
    folder = folder_with(
        tmp_path, {**QWEN3_LIKE, "max_new_tokens": 64, "min_p": "x", "repetition_penalty": True}
    )
    assert read_generation_defaults("auto", folder) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "max_new_tokens": 64,
    }
    assert read_generation_defaults("none", folder) == read_generation_defaults("vllm", folder) == {}
    assert read_generation_defaults(folder, "/elsewhere")["top_k"] == 20  # another folder's file
    assert read_generation_defaults("auto", str(tmp_path / "empty")) == {}
    (tmp_path / "off").mkdir()
    off = folder_with(tmp_path / "off", {"top_k": 0})  # transformers' "off" is the engine's -1
    assert read_generation_defaults("auto", off) == {"top_k": -1}
    with pytest.raises(FileNotFoundError, match="--generation-config"):
        read_generation_defaults(str(tmp_path / "missing"), folder)


def test_a_gguf_has_no_generation_config_to_read(tmp_path):
    folder = folder_with(tmp_path, QWEN3_LIKE)
    hf = SimpleNamespace(is_gguf=False, folder=folder)
    gguf = SimpleNamespace(is_gguf=True, folder=folder)
    assert load_generation_defaults(ModelConfig(), hf)["temperature"] == 0.6
    assert load_generation_defaults(ModelConfig(), gguf) == {}
    assert load_generation_defaults(ModelConfig(generation_config="none"), hf) == {}


@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_unset_request_fields_take_the_models_defaults(cls):
    body = (
        {"messages": [{"role": "user", "content": "hi"}]}
        if cls is ChatCompletionRequest
        else {"prompt": "hi"}
    )
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
    params = parse_request(cls, body).to_sampling_params(defaults)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    given = parse_request(cls, {**body, "temperature": 0, "top_p": 1.0, "top_k": 0}).to_sampling_params(
        defaults
    )
    assert (given.temperature, given.top_p, given.top_k) == (0, 1.0, -1)  # what the request says wins
    plain = parse_request(cls, body).to_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, -1, 1.0)


def test_the_api_handlers_and_the_offline_llm_read_the_engines_defaults():
    from fastdeploy.entrypoints.llm import LLM
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    engine = SimpleNamespace(generation_defaults={"temperature": 0.7, "max_new_tokens": 32, "top_k": 20})
    assert OpenAIServingChat(engine, ["m"]).sampling_defaults == engine.generation_defaults
    llm = LLM.__new__(LLM)  # (only its engine's defaults are read)
    llm.engine = engine
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.top_k) == (0.7, 32, 20)
    llm.engine = SimpleNamespace(generation_defaults={})
    assert llm.get_default_sampling_params().temperature == 1.0
