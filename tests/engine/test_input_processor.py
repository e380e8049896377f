"""InputProcessor's prompt checks: what the engine refuses before a request reaches the model."""

from __future__ import annotations

import pytest

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.input_processor import InputProcessor, PromptTokenError, PromptTooLongError


def processor(vocab_size: int | None = 100) -> InputProcessor:
    return InputProcessor(tokenizer=None, max_model_len=16, eos_token_ids=[2], vocab_size=vocab_size)


@pytest.mark.parametrize("bad", [100, 10**6, -1])
def test_token_id_outside_the_vocabulary_is_refused(bad):
    # a text prompt tokenized by a tokenizer larger than the model's vocabulary once reached the
    # embedding and failed there (IndexError, a 500); now it is a PromptTokenError (a 400)
    with pytest.raises(PromptTokenError, match=str(bad)):
        processor().make_core_requests("r", [1, bad, 3], SamplingParams(max_tokens=1))


def test_ids_inside_the_vocabulary_pass():
    requests = processor().make_core_requests("r", [0, 50, 99], SamplingParams(max_tokens=1))
    assert [r.prompt_token_ids for r in requests] == [[0, 50, 99]]


def test_without_a_known_vocabulary_only_the_length_is_checked():
    processor(None).validate([10**6])
    with pytest.raises(PromptTooLongError):
        processor(None).validate(list(range(16)))
