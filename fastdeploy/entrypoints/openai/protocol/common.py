"""Shared pieces of the OpenAI protocol: model bases, parsing, ids, error bodies, usage and prompt logprobs.

Request models derive from :class:`OpenAIModel` (strict types, unknown fields
rejected); response models derive from :class:`ResponseModel` (lenient: the
server builds them itself).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from fastdeploy.entrypoints.openai.errors import from_pydantic


class OpenAIModel(BaseModel):
    """Base of request models: strict types, unknown fields rejected, floats finite (no NaN/Infinity)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ResponseModel(BaseModel):
    """Base of response models (lenient; we build them ourselves)."""

    model_config = ConfigDict(extra="allow")


def parse_request(cls: type[OpenAIModel], data: Any) -> Any:
    """Validate ``data`` (a decoded JSON value) as ``cls``; a ``BadRequestError`` on failure."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def random_id(prefix: str) -> str:
    """A request id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _check_token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("must be a list of integers")
    if any(t < 0 for t in value):
        raise ValueError("token ids must not be negative")
    return value


# --------------------------------------------------------------------------- errors


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """The body of every error response: ``{"error": {...}}``."""

    error: ErrorInfo


# --------------------------------------------------------------------------- usage


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    """Token counts of a request; ``cached_tokens`` are prompt tokens served from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def build(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# --------------------------------------------------------------------------- prompt logprobs


class PromptLogprob(ResponseModel):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Aligned with the prompt tokens: null for the first, then token id (as a string) → entry."""


class WithPromptLogprobs(ResponseModel):
    """A response part that may carry ``prompt_logprobs``; the key is left out when it is null."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _omit_null_prompt_logprobs(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if "prompt_logprobs" in data:
            value = data.pop("prompt_logprobs")  # re-added last, where vLLM has it
            if value is not None:
                data["prompt_logprobs"] = value
        return data
