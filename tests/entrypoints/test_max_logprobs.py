"""``--max-logprobs``: the most log probabilities a request may ask for per token, and a request's
-1 (the whole vocabulary), as vLLM bounds them (its default 20 is also OpenAI's top_logprobs bound)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastdeploy.core.sampling_params import SamplingParams, SamplingParamsError, resolve_logprobs
from fastdeploy.engine.input_processor import InputProcessor
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing

VOCAB = 1000


def serving(max_logprobs: int | None) -> OpenAIServing:
    engine = SimpleNamespace(vocab_size=VOCAB, generation_defaults={})
    if max_logprobs is not None:
        engine.max_logprobs = max_logprobs
    return OpenAIServing(engine, ["m"])


def test_the_default_bound_is_20_and_names_the_requests_field():
    ok = CompletionRequest(model="m", prompt="x", logprobs=20).to_sampling_params()
    assert serving(None).check_params(ok).logprobs == 20
    chat = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21
    ).to_sampling_params()
    with pytest.raises(BadRequestError) as info:
        serving(None).check_params(chat, "top_logprobs")
    assert info.value.param == "top_logprobs" and "at most 20" in info.value.message
    over = CompletionRequest(model="m", prompt="x", prompt_logprobs=21).to_sampling_params()
    with pytest.raises(BadRequestError) as info:
        serving(20).check_params(over)
    assert info.value.param == "prompt_logprobs" and "--max-logprobs" in info.value.message


def test_minus_one_is_the_whole_vocabulary_where_the_bound_allows_it():
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=4)
    for bound in (-1, VOCAB):
        resolved = serving(bound).check_params(params)
        assert (resolved.logprobs, resolved.prompt_logprobs) == (VOCAB, VOCAB)
    assert params.logprobs == -1  # the caller's object is left as it was
    with pytest.raises(BadRequestError) as info:
        serving(20).check_params(SamplingParams(logprobs=-1))
    assert info.value.param == "logprobs" and "-1 (the whole vocabulary)" in info.value.message


def test_a_count_past_the_vocabulary_is_refused_even_without_a_bound():
    with pytest.raises(SamplingParamsError) as info:
        resolve_logprobs(SamplingParams(logprobs=VOCAB + 1), -1, VOCAB)
    assert info.value.param == "logprobs"
    assert resolve_logprobs(SamplingParams(logprobs=50), -1, VOCAB).logprobs == 50
    with pytest.raises(SamplingParamsError):
        SamplingParams(logprobs=-2)


def test_the_engine_checks_the_same_bound():
    """The offline LLM's requests (no API server) meet the bound in the engine's input processor."""
    processor = InputProcessor(None, 128, [0], vocab_size=VOCAB, max_logprobs=5)
    assert processor.prepare_params(SamplingParams(logprobs=5)).logprobs == 5
    with pytest.raises(SamplingParamsError):
        processor.prepare_params(SamplingParams(logprobs=6))
    unbounded = InputProcessor(None, 128, [0], vocab_size=VOCAB, max_logprobs=-1)
    assert unbounded.prepare_params(SamplingParams(prompt_logprobs=-1)).prompt_logprobs == VOCAB
    with pytest.raises(ValueError, match="max_logprobs"):
        InputProcessor(None, 128, [0], vocab_size=VOCAB, max_logprobs=-2)
