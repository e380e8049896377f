"""What SGLang's server tests (test_request_length_validation.py, the OpenAI routes' ``no_stop_trim``)
expect of the request checks, without a server: the words of the context-length errors, which
must also keep OpenAI's and vLLM's, and SGLang's name for keeping the stop string."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing

USER = [{"role": "user", "content": "Hello"}]
OPENAI_WORDS = "This model's maximum context length is 1000 tokens."
SGLANG_PROMPT_WORDS = "is longer than the model's context length"
SGLANG_OUTPUT_WORDS = (
    "Requested token count exceeds the model's maximum context",
    "max_completion_tokens is too large",
)


def length_error(*args, **kwargs) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        resolve_max_tokens(*args, **kwargs)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    return info.value


@pytest.mark.parametrize("requested", [None, 1, 16, 500])
@pytest.mark.parametrize("prompt_len", [1000, 1231])
def test_a_prompt_without_room_is_longer_than_the_context_whatever_was_requested(prompt_len, requested):
    """SGLang's test_input_length_* match ``is longer than the model's context length``, with or
    without a ``max_tokens`` (SGLang checks the input first)."""
    err = length_error(prompt_len, requested, 1000, prompt_kind="messages")
    assert SGLANG_PROMPT_WORDS in err.message
    assert err.message.startswith(OPENAI_WORDS)
    assert (
        f"{prompt_len} tokens" in err.message
        if requested is None
        else f"({prompt_len} in the messages" in err.message
    )
    assert err.param == "messages"


def test_max_tokens_zero_with_echo_needs_no_room():
    assert resolve_max_tokens(1000, 0, 1000) == 0
    assert SGLANG_PROMPT_WORDS in length_error(1001, 0, 1000).message


@pytest.mark.parametrize("requested", [969, 1200])
def test_an_output_limit_beyond_the_context_uses_sglangs_words(requested):
    """SGLang's test_max_tokens_validation matches ``Requested token count exceeds the model's maximum
    context`` (older) or ``max_completion_tokens is too large`` (newer) for a chat's ``max_tokens``."""
    err = length_error(32, requested, 1000, prompt_kind="messages")
    for words in SGLANG_OUTPUT_WORDS:
        assert words in err.message
    assert err.message.startswith(f"{OPENAI_WORDS} However, you requested {32 + requested} tokens")
    assert f"({requested} > 1000 - 32)" in err.message
    assert resolve_max_tokens(32, 968, 1000, prompt_kind="messages") == 968


def test_the_completions_error_names_max_tokens():
    err = length_error(1, 1200, 1000, prompt_kind="prompt")
    assert "max_tokens is too large" in err.message and "max_completion_tokens" not in err.message
    assert SGLANG_OUTPUT_WORDS[0] in err.message


@pytest.mark.parametrize(
    "request_type, base", [(CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": USER})]
)
def test_no_stop_trim_keeps_the_stop_string(request_type, base):
    """SGLang's ``no_stop_trim`` is ``include_stop_str_in_output``; that field wins when both are given."""

    def keeps(**fields) -> bool:
        request = parse_request(request_type, {"model": "m", **base, "stop": ["x"], **fields})
        return request.to_sampling_params().include_stop_str_in_output

    assert keeps(no_stop_trim=True)
    assert not keeps(no_stop_trim=False)
    assert not keeps()
    assert not keeps(no_stop_trim=True, include_stop_str_in_output=False)
    assert keeps(no_stop_trim=False, include_stop_str_in_output=True)


def test_a_text_too_long_to_tokenize_is_longer_than_the_context():
    """The check before tokenizing (no token holds more than ``max_token_chars`` characters) speaks
    as the check after it does."""
    serving = SimpleNamespace(engine=SimpleNamespace(max_model_len=1000), max_token_chars=16)
    OpenAIServing.check_text_length(serving, 16_000, "messages")
    with pytest.raises(BadRequestError) as info:
        OpenAIServing.check_text_length(serving, 16_001, "messages")
    assert info.value.message.startswith(OPENAI_WORDS)
    assert SGLANG_PROMPT_WORDS in info.value.message
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
