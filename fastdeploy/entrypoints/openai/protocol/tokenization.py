"""``POST /tokenize`` and ``POST /detokenize``: their requests and responses.

(Not named ``tokenize`` so that it never shadows the standard library's module.)
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.chat_messages import (
    ChatMessage,
    check_messages,
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
    """``POST /tokenize`` with chat messages, rendered as a chat completion renders them (the chat
    template with ``tools``, ``chat_template_kwargs``, ``add_generation_prompt`` /
    ``continue_final_message``; vLLM's fields)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """Refused (400) as a chat completion's is."""
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request body whose prompt this request tokenizes."""
        body = self.model_dump(
            include={
                "messages",
                "continue_final_message",
                "chat_template_kwargs",
                "chat_template",
                "tools",
                "tool_choice",
            },
            exclude_none=True,
            by_alias=True,
        )
        body["messages"] = [m.model_dump(exclude_none=True) for m in self.messages]
        if self.add_generation_prompt is not None:
            body["add_generation_prompt"] = self.add_generation_prompt
        return body

    @field_validator("messages")
    @classmethod
    def _validate_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return check_messages(v)

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
    :func:`parse_request`); both ``prompt`` and ``messages``, or neither, is a 400."""
    if isinstance(data, dict) and "messages" in data:
        if "prompt" in data:
            raise BadRequestError("give either prompt or messages, not both", param="prompt")
        return parse_request(TokenizeChatRequest, data, strict_fields=strict_fields)
    if isinstance(data, dict) and "prompt" not in data:
        raise BadRequestError("Missing required parameter: prompt (or messages)", param="prompt")
    return parse_request(TokenizeCompletionRequest, data, strict_fields=strict_fields)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
