"""Shared pieces of the OpenAI protocol: model bases, parsing, ids, error bodies, usage and prompt logprobs.

Request models derive from :class:`OpenAIModel` (strict types, unknown fields
refused by the model); :func:`parse_request` drops fields outside the protocol
with a logged warning unless the server runs with ``--strict-request-fields``.
Response models derive from :class:`ResponseModel` (lenient: the server builds
them itself).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_serializer

from fastdeploy.entrypoints.openai.errors import _clean_loc, encodable, from_pydantic

logger = logging.getLogger(__name__)

_warned: set[str] = set()
_MAX_WARNED = 1024
"""Most distinct keys :func:`warn_once` remembers: clients inventing field names can neither grow
the set without bound nor flood the log."""


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process.

    Ignored request fields are reported this way: once per field name is enough
    for an operator, and a busy server's log is not flooded.
    """
    if key in _warned:
        return
    if len(_warned) >= _MAX_WARNED:
        if "" not in _warned:
            _warned.add("")
            logger.warning("More ignored request fields were sent; they are no longer logged")
        return
    _warned.add(key)
    logger.warning(message)


class OpenAIModel(BaseModel):
    """Base of request models: strict types, unknown fields refused, floats finite (no NaN/Infinity)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    def refuse_extensions(self) -> None:
        """Under ``--strict-request-fields``: a ``BadRequestError`` for what the request carries
        beyond OpenAI's protocol other than unknown top-level fields (which the model refuses
        itself), e.g. a chat message's custom role. Nothing by default."""


class ResponseModel(BaseModel):
    """Base of response models (lenient; we build them ourselves)."""

    model_config = ConfigDict(extra="allow")


def parse_request(cls: type[OpenAIModel], data: Any, *, strict_fields: bool = False) -> Any:
    """Validate ``data`` (a decoded JSON value) as ``cls``; a ``BadRequestError`` on failure.

    A field that no model declares (outside the OpenAI protocol and the
    supported extensions) is dropped with a warning, logged once per field name,
    as vLLM does; with ``strict_fields`` (``--strict-request-fields``) it is a
    400 (``Unrecognized request argument supplied: NAME``), and so are the
    extensions :meth:`OpenAIModel.refuse_extensions` names. A chat message's own
    fields are the message's (handed to the chat template, as vLLM does).
    """
    try:
        request = cls.model_validate(data)
    except ValidationError as exc:
        if strict_fields:
            raise from_pydantic(exc) from None
        cleaned = _drop_unknown_fields(data, exc)
        if cleaned is None:
            raise from_pydantic(exc) from None
        try:
            request = cls.model_validate(cleaned)
        except ValidationError as exc:
            raise from_pydantic(exc) from None
    if strict_fields:
        request.refuse_extensions()
    return request


_NEVER_DROPPED = frozenset({"messages"})
"""Top-level fields inside which an unknown field stays a 400: dropping part of a chat message
would change the prompt the model sees."""


def _drop_unknown_fields(data: Any, exc: ValidationError) -> Any | None:
    """``data`` without the fields ``exc`` reports as unknown (a warning for each), or None if there are none.

    Only the containers on the way to a dropped field are copied; the caller's
    ``data`` is left as it was.
    """
    dropped = False
    for error in exc.errors(include_url=False):
        if error["type"] != "extra_forbidden":
            continue
        loc = _clean_loc(tuple(error["loc"]))
        if loc and (len(loc) == 1 or loc[0] not in _NEVER_DROPPED) and _has_path(data, loc):
            data = _without(data, loc)
            dropped = True
            name = encodable("".join("[]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")[:200])
            warn_once(
                f"unknown:{name}",
                f"Ignoring the request field '{name}': it is not part of the OpenAI API nor a supported "
                "extension (start the server with --strict-request-fields to refuse such requests)",
            )
    return data if dropped else None


def _has_path(data: Any, loc: tuple[Any, ...]) -> bool:
    for part in loc:
        if isinstance(part, str) and isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(part, int) and isinstance(data, list) and 0 <= part < len(data):
            data = data[part]
        else:
            return False
    return True


def _without(data: Any, loc: tuple[Any, ...]) -> Any:
    """A copy of ``data`` with the item at ``loc`` removed (``loc`` exists and ends in a dict key)."""
    head, rest = loc[0], loc[1:]
    copy = dict(data) if isinstance(data, dict) else list(data)
    if rest:
        copy[head] = _without(data[head], rest)
    else:
        del copy[head]
    return copy


def random_id(prefix: str) -> str:
    """A request id such as ``cmpl-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _check_token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError("must be a list of integers")
    negative = next((t for t in value if t < 0), None)
    if negative is not None:
        raise ValueError(f"token ids must be non-negative, got {negative}")
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
    def build(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        reasoning_tokens: int | None = None,
    ) -> UsageInfo:
        """The usage; with ``reasoning_tokens`` (a reasoning parser's count) also
        ``completion_tokens_details: {"reasoning_tokens": N}``, as OpenAI reports it for reasoning
        models (left out otherwise)."""
        details = (
            {}
            if reasoning_tokens is None
            else {"completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            **details,
        )


# --------------------------------------------------------------------------- prompt logprobs


class PromptLogprob(ResponseModel):
    """One entry of vLLM's ``prompt_logprobs``: a token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Aligned with the prompt tokens: null for the first, then token id (as a string) → entry."""


class WithExtensions(ResponseModel):
    """A response part with extension fields (vLLM's) that are left out of the JSON when null.

    A client that did not ask for them sees OpenAI's shapes unchanged.
    """

    OMIT_IF_NULL: ClassVar[tuple[str, ...]] = ()
    """The extension fields, in the order they end the JSON object (where vLLM has them)."""

    @model_serializer(mode="wrap")
    def _omit_null_extensions(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self.OMIT_IF_NULL:
            if key in data:
                value = data.pop(key)
                if value is not None:
                    data[key] = value
        return data


def matched_stop(
    finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int]
) -> int | str | None:
    """SGLang's ``matched_stop`` of a finished choice: the stop string or stop token id that ended
    it (``stop_reason``), the end-of-sequence token id when that did (the last token), else None."""
    if finish_reason != "stop":
        return None
    if stop_reason is not None:
        return stop_reason
    return token_ids[-1] if token_ids else None


class WithPromptLogprobs(WithExtensions):
    """A response part that may carry ``prompt_logprobs`` (and ``prompt_token_ids``); left out when
    null (the non-streamed responses keep a null ``prompt_logprobs``, as vLLM's do)."""

    OMIT_IF_NULL = ("prompt_logprobs", "prompt_token_ids")

    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids, with ``return_token_ids`` (vLLM's extension)."""
