"""Pydantic models of the OpenAI HTTP protocol, and their translation to engine terms.

Requests are validated strictly (``"max_tokens": "10"`` is a 400, not silently
coerced) and unknown fields are rejected, so a client never believes the server
honoured a parameter it ignored. OpenAI fields that the engine does not
implement yet are declared so that their "off" value is accepted and any other
value is a 400 that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer

from fastdeploy.engine.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from fastdeploy.entrypoints.openai.errors import BadRequestError, from_pydantic
from fastdeploy.multimodal.parts import is_feature_part

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
"""Most choices one request may ask for (OpenAI's own limit). Each choice is an engine
request, so an unbounded ``n`` would let one request flood the engine."""


class OpenAIModel(BaseModel):
    """Base of request models: strict types, unknown fields rejected."""

    model_config = ConfigDict(strict=True, extra="forbid")


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


# --------------------------------------------------------------------------- errors


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    """The body of every error response: ``{"error": {...}}``."""

    error: ErrorInfo


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    """``stream_options``: only ``include_usage`` is defined."""

    include_usage: bool | None = False


# OpenAI fields the engine does not implement yet, with the values that mean "off".
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "store": (None, False),
}


def _is_off(value: Any, off_values: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the "off" values (``False`` is not ``0``, and vice versa)."""
    if value is None or isinstance(value, bool):
        return any(value is off for off in off_values)
    return any(off is not None and not isinstance(off, bool) and off == value for off in off_values)


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


def _check_token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("must be a list of integers")
    if any(t < 0 for t in value):
        raise ValueError("token ids must not be negative")
    return value


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions (vLLM-compatible names), sent with the openai client's ``extra_body``.
    top_k: int | None = None
    """-1 or 0: off."""
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a JSON string key) → bias in [-100, 100]."""
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    """Logprobs of the prompt tokens plus this many top alternatives each (vLLM's field)."""

    @field_validator("stop")
    @classmethod
    def _validate_stop(cls, v: Any) -> Any:
        return _check_stop(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: Any) -> Any:
        return v if v is None else _check_token_ids(v)

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_N:
            raise ValueError(f"must be at most {MAX_N}, got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        if v is not None and not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError("must fit in a signed 64-bit integer")
        return v

    @property
    def include_usage(self) -> bool:
        """Whether a streaming response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise a 400 if a not-yet-implemented OpenAI field has a non-default value."""
        for name, off_values in _UNSUPPORTED_DEFAULTS.items():
            if name in type(self).model_fields and not _is_off(getattr(self, name), off_values):
                raise BadRequestError(f"'{name}' is not supported by this server yet", param=name)

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output limit and the name of the field it came from."""
        return self.max_tokens, "max_tokens"

    def _num_logprobs(self) -> int | None:
        """Top logprobs per token the request asks for (None: no logprobs)."""
        return None

    def _num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the engine must compute (None: none)."""
        k = self.prompt_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise BadRequestError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs"
            )
        return k

    def _allows_zero_max_tokens(self) -> bool:
        """Whether ``max_tokens: 0`` makes sense (only for completions with ``echo``: scoring a prompt)."""
        return False

    def to_sampling_params(self) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (a 400 if a value is invalid).

        ``max_tokens`` is left as requested (possibly None); the server fixes it
        with :func:`resolve_max_tokens` once the prompt length is known.
        """
        self.check_supported()
        max_tokens, max_tokens_field = self._requested_max_tokens()
        least = 0 if self._allows_zero_max_tokens() else 1
        if max_tokens is not None and max_tokens < least:
            hint = (
                " (0 is allowed only with echo)"
                if max_tokens == 0 and "echo" in type(self).model_fields
                else ""
            )
            raise BadRequestError(
                f"{max_tokens_field} must be at least {least}, got {max_tokens}{hint}", param=max_tokens_field
            )
        top_k = self.top_k
        kwargs: dict[str, Any] = {
            "n": 1 if self.n is None else self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if top_k is None or top_k == 0 else top_k,
            "min_p": 0.0 if self.min_p is None else self.min_p,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": 0 if self.min_tokens is None else self.min_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "frequency_penalty": 0.0 if self.frequency_penalty is None else self.frequency_penalty,
            "presence_penalty": 0.0 if self.presence_penalty is None else self.presence_penalty,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "bad_words": list(self.bad_words or []),
            "logprobs": self._num_logprobs(),
            "prompt_logprobs": self._num_prompt_logprobs(),
        }
        for flag in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if getattr(self, flag) is not None:
                kwargs[flag] = getattr(self, flag)
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            param = max_tokens_field if exc.param == "max_tokens" else exc.param
            message = str(exc).replace("max_tokens", max_tokens_field, 1) if param != exc.param else str(exc)
            raise BadRequestError(message, param=param) from None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``.

    ``prompt`` is normalised to a list of prompts, each a string or a list of
    token ids (the OpenAI forms: string, list of strings, token ids, list of
    token-id lists).
    """

    DEFAULT_MAX_TOKENS: ClassVar[int] = 16
    """OpenAI's default ``max_tokens`` for the legacy completions endpoint."""

    prompt: list[str | list[int]]
    logprobs: int | None = None
    """Legacy form: how many top logprobs per token (0 still returns the sampled token's)."""
    echo: bool | None = None
    """Start each choice's text with its prompt (and, with ``logprobs``, its logprobs with the prompt's)."""
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _normalize_prompt(cls, value: Any) -> list[str | list[int]]:
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
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError("token ids must not be negative")
        return prompts

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def _num_prompt_logprobs(self) -> int | None:
        k = super()._num_prompt_logprobs()
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs come from them
            return max(k or 0, self.logprobs)
        return k

    def _allows_zero_max_tokens(self) -> bool:
        return bool(self.echo)

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise BadRequestError("'best_of' is not supported by this server yet", param="best_of")


class TextContentPart(OpenAIModel):
    """A ``{"type": "text", "text": ...}`` content part."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """One message of a chat. ``content`` is a string or a list of content parts.

    Text parts are joined into a string. Parts carrying precomputed image / video
    features (``image_feature_url``, ``video_feature_url``, ``image_embeds``; see
    docs/multimodal.md) keep the content a list of parts, in order.
    """

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if is_feature_part(part):
                parts.append(part)
                continue
            if kind != "text":
                raise ValueError(
                    f"content part {i}: type {kind!r} is not supported (only 'text' and the feature "
                    "parts 'image_feature_url', 'video_feature_url', 'image_embeds')"
                    if kind
                    else f"content part {i} must be an object with a 'type'"
                )
            try:
                parts.append({"type": "text", "text": TextContentPart.model_validate(part).text})
            except ValidationError as exc:
                raise ValueError(f"content part {i}: {exc.errors()[0]['msg']}") from None
        if any(p["type"] != "text" for p in parts):
            return parts
        return "\n".join(p["text"] for p in parts)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (``developer`` is shown as ``system``); ``content``
        stays a list of parts when it carries image / video features."""
        msg: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.content or "",
        }
        if self.name is not None:
            msg["name"] = self.name
        return msg


def _check_messages(value: list[ChatMessage]) -> list[ChatMessage]:
    if not value:
        raise ValueError("must not be empty")
    for i, msg in enumerate(value):
        if msg.content is None and msg.role != "assistant":
            raise ValueError(f"message {i} ({msg.role}) has no content")
    return value


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    store: Any = None

    @field_validator("messages")
    @classmethod
    def _validate_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return _check_messages(v)

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise BadRequestError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
            )
        if not self.logprobs:
            if self.top_logprobs:
                raise BadRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as a list of dicts for ``tokenizer.apply_chat_template``."""
        return [m.to_template_dict() for m in self.messages]


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


class DetokenizeRequest(OpenAIModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, v: list[int]) -> list[int]:
        return _check_token_ids(v)


def parse_tokenize_request(data: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Pick the tokenize request form by whether ``messages`` is present."""
    if isinstance(data, dict) and "messages" in data:
        return parse_request(TokenizeChatRequest, data)
    return parse_request(TokenizeCompletionRequest, data)


# --------------------------------------------------------------------------- limits


def resolve_max_tokens(
    num_prompt_tokens: int,
    requested: int | None,
    max_model_len: int,
    *,
    default: int | None = None,
    prompt_kind: str = "prompt",
) -> int:
    """The output limit of a request, or a 400 if it cannot fit the context window.

    ``requested`` is what the client asked for (None: not given). A given value
    must fit: ``prompt + max_tokens <= max_model_len``. Without one the request
    gets ``default`` (None: all the room left), capped at the room left, which
    must be at least one token. ``prompt_kind`` ("prompt" or "messages") names
    the input in the message.
    """
    limit = f"This model's maximum context length is {max_model_len} tokens."
    if requested is None:
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise BadRequestError(
                f"{limit} However, your {prompt_kind} resulted in {num_prompt_tokens} tokens, which "
                f"leaves no room for the completion (at least 1 token). "
                f"Please reduce the length of the {prompt_kind}.",
                param=prompt_kind,
                code="context_length_exceeded",
            )
        return room if default is None else min(default, room)
    total = num_prompt_tokens + requested
    if total > max_model_len:
        raise BadRequestError(
            f"{limit} However, you requested {total} tokens ({num_prompt_tokens} in the {prompt_kind}, "
            f"{requested} in the completion). Please reduce the length of the {prompt_kind} or completion.",
            param=prompt_kind,
            code="context_length_exceeded",
        )
    return requested


# --------------------------------------------------------------------------- responses


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


def _now() -> int:
    return int(time.time())


class CompletionLogProbs(ResponseModel):
    """The legacy completions ``logprobs`` object."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionLogProb(ResponseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


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


class CompletionResponseChoice(WithPromptLogprobs):
    """One choice; ``prompt_logprobs`` (vLLM's extension) only when asked, in the first chunk when streaming."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(ResponseModel):
    """One SSE chunk of a streamed completion (``choices`` empty in the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(WithPromptLogprobs):
    """A chat answer; ``prompt_logprobs`` (vLLM's extension, at this level as in vLLM) only when asked."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    """A streamed piece of the assistant message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(WithPromptLogprobs):
    """One SSE chunk of a streamed chat completion (``choices`` empty in the usage chunk).

    ``prompt_logprobs``, when asked, come once, in the first chunk after the role chunks.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fastdeploy"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
