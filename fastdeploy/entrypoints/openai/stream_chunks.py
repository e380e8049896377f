"""The common SSE chunks of a stream, encoded without pydantic: a dict in the models' key order and orjson.

Most chunks of most streams carry nothing but a piece of text (and, when asked, its token
ids): no logprobs, no echo, no reasoning or tool-call split, no running usage. Building the
pydantic response models and dumping them costs ~20-30 µs per chunk; this costs ~1-2 µs, and
one event loop writes a chunk per token per request. Every other chunk still goes through
the models (``protocol/``); ``tests/entrypoints/test_stream_chunks.py`` checks that both
encodings give the same bytes.
"""

from __future__ import annotations

import orjson


def completion_text_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    usage_null: bool,
) -> bytes:
    """``data: {CompletionStreamResponse}`` of one choice with text only (``token_ids``: the
    chunk's ids with ``return_token_ids``, else None; ``usage_null``: end with ``"usage": null``,
    as a stream with ``include_usage`` does)."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return _sse_chunk(request_id, "text_completion", created, model, choice, token_ids, usage_null)


def chat_content_chunk(
    request_id: str,
    created: int,
    model: str,
    index: int,
    content: str | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: list[int] | None,
    usage_null: bool,
) -> bytes:
    """``data: {ChatCompletionStreamResponse}`` of one choice whose delta is only ``content``
    (None: an empty delta, e.g. the finish chunk); the other arguments as in
    :func:`completion_text_chunk`."""
    choice = {
        "index": index,
        "delta": {} if content is None else {"content": content},
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return _sse_chunk(request_id, "chat.completion.chunk", created, model, choice, token_ids, usage_null)


def _sse_chunk(
    request_id: str,
    obj: str,
    created: int,
    model: str,
    choice: dict,
    token_ids: list[int] | None,
    usage_null: bool,
) -> bytes:
    """``data: {...}`` of a one-choice stream response (the key order of the pydantic models)."""
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage_null:
        body["usage"] = None
    return b"data: " + orjson.dumps(body) + b"\n\n"
