"""``POST /tokenize`` and ``POST /detokenize``: their requests and responses.

(Not named ``tokenize`` so that it never shadows the standard library's module.)
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from fastdeploy.entrypoints.openai.protocol.chat import (
    ChatMessage,
    _check_messages,
    refuse_message_extensions,
)
from fastdeploy.entrypoints.openai.protocol.common import (
    OpenAIModel,
    ResponseModel,
    _check_token_ids,
    parse_request,
)


class TokenizeCompletionRequest(OpenAIModel):
    """``POST /tokenize`` with a plain prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    """``POST /tokenize`` with chat messages (the chat template is applied)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _validate_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return _check_messages(v)

    def refuse_extensions(self) -> None:
        refuse_message_extensions(self.messages)


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, v: list[int]) -> list[int]:
        return _check_token_ids(v)


def parse_tokenize_request(
    data: Any, *, strict_fields: bool = False
) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Pick the tokenize request form by whether ``messages`` is present (unknown fields as in
    :func:`parse_request`)."""
    if isinstance(data, dict) and "messages" in data:
        return parse_request(TokenizeChatRequest, data, strict_fields=strict_fields)
    return parse_request(TokenizeCompletionRequest, data, strict_fields=strict_fields)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
