"""``POST /v1/completions``: the legacy completions request and its (streamed) responses."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, WithJsonSchema, field_validator

from fastdeploy.core.sampling_params import ALL_LOGPROBS
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.common import ResponseModel, UsageInfo, WithPromptLogprobs, _now
from fastdeploy.entrypoints.openai.protocol.sampling import SamplingRequest

# --------------------------------------------------------------------------- request

PROMPT_FORMS_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
        },
    ]
}
"""The JSON schema of the OpenAI prompt forms (completions' ``prompt``, embeddings' ``input``)."""


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is normalised to a list of prompts, each a string or a list of
    token ids (the OpenAI forms: string, list of strings, token ids, list of
    token-id lists).
    """

    DEFAULT_MAX_TOKENS: ClassVar[int] = 16
    """OpenAI's default ``max_tokens`` for the legacy completions endpoint."""

    prompt: Annotated[list[str | list[int]], WithJsonSchema(PROMPT_FORMS_SCHEMA)]
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    logprobs: int | None = None
    """Legacy form: how many top logprobs per token (0 still returns the sampled token's)."""
    echo: bool | None = None
    """Start each choice's text with its prompt (and, with ``logprobs``, its logprobs with the prompt's)."""
    best_of: int | None = None
    """Not implemented: only equal to ``n`` (an int, strictly: ``true`` or ``1.0`` is a 400)."""
    suffix: str | None = None
    """Not implemented: only null or ``""``."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalize_prompt(cls, value: Any) -> list[str | list[int]]:
        return normalize_prompts(value)

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _num_prompt_logprobs(self) -> int | None:
        k = super()._num_prompt_logprobs()
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs come from them
            if ALL_LOGPROBS in (k, self.logprobs):
                return ALL_LOGPROBS
            return max(k or 0, self.logprobs)
        return k

    ECHO_ALLOWS_ZERO_MAX_TOKENS: ClassVar[bool] = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise BadRequestError("'best_of' is not supported by this server yet", param="best_of")


# --------------------------------------------------------------------------- responses


class CompletionLogProbs(ResponseModel):
    """The legacy completions ``logprobs`` object."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(WithPromptLogprobs):
    """One choice. vLLM's extensions: ``prompt_logprobs`` (null when not asked, as in vLLM, whose
    clients read it); only when asked, ``prompt_token_ids`` and ``token_ids``."""

    OMIT_IF_NULL = ("token_ids", "prompt_token_ids")

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None
    """SGLang's: what ended the choice (:func:`~.common.matched_stop`)."""
    token_ids: list[int] | None = None


class CompletionStreamChoice(CompletionResponseChoice):
    """One choice of a streamed chunk: ``prompt_logprobs`` and ``prompt_token_ids`` only in the
    choice's first chunk when asked, ``token_ids`` the chunk's when asked (no ``matched_stop``)."""

    OMIT_IF_NULL = ("token_ids", "prompt_logprobs", "prompt_token_ids", "matched_stop")


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    """One SSE chunk of a streamed completion: one choice, or none in the final usage chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


def normalize_prompts(value: Any) -> list[str | list[int]]:
    """The OpenAI prompt forms (a string, a list of strings, token ids, a list of token-id lists) as
    a list of prompts; ValueError for anything else, an empty prompt or a negative id."""

    def is_token(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(is_token(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = value
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(p, list) and all(is_token(t) for t in p) for p in value)
    ):
        prompts = value
    elif isinstance(value, list) and not value:
        raise ValueError("must not be empty")
    else:
        raise ValueError(
            "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    for p in prompts:
        if len(p) == 0:
            raise ValueError("must not be empty")
        negative = next((t for t in p if t < 0), None) if isinstance(p, list) else None
        if negative is not None:
            raise ValueError(f"token ids must be non-negative, got {negative}")
    return prompts
