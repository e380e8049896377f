"""The fast SSE chunk encoders give the same bytes as the pydantic response models they stand in for."""

from __future__ import annotations

import itertools

import pytest

from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from fastdeploy.entrypoints.openai.stream_chunks import chat_content_chunk, completion_text_chunk

TEXTS = ["Hello", "", ' "quoted" \\ back\nslash', "héllo 世界 🎉", "\u0000\u001f ctl"]
ENDS = [(None, None), ("length", None), ("stop", 2), ("stop", "END")]
IDS = [None, [], [5, 49151]]


def sse(model, usage_null: bool) -> bytes:
    return f"data: {model.model_dump_json(exclude=None if usage_null else {'usage'})}\n\n".encode()


@pytest.mark.parametrize(
    "text, end, ids, usage_null", list(itertools.product(TEXTS, ENDS, IDS, [False, True]))
)
def test_completion_chunk_bytes(text, end, ids, usage_null):
    choice = CompletionStreamChoice(index=3, text=text, logprobs=None, finish_reason=end[0], stop_reason=end[1],
                                      token_ids=ids)  # fmt: skip
    model = CompletionStreamResponse(
        id="cmpl-1", created=1700000000, model="m/x", choices=[choice], usage=None
    )
    fast = completion_text_chunk("cmpl-1", 1700000000, "m/x", 3, text, end[0], end[1], ids, usage_null)
    assert fast == sse(model, usage_null)


@pytest.mark.parametrize(
    "text, end, ids, usage_null", list(itertools.product(TEXTS, ENDS, IDS, [False, True]))
)
def test_chat_chunk_bytes(text, end, ids, usage_null):
    content = text or None
    choice = ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content=content), logprobs=None,
                                        finish_reason=end[0], stop_reason=end[1], token_ids=ids)  # fmt: skip
    model = ChatCompletionStreamResponse(id="chatcmpl-1", created=1700000000, model="m", choices=[choice],
                                         prompt_logprobs=None, prompt_token_ids=None, usage=None)  # fmt: skip
    fast = chat_content_chunk("chatcmpl-1", 1700000000, "m", 1, content, end[0], end[1], ids, usage_null)
    assert fast == sse(model, usage_null)
