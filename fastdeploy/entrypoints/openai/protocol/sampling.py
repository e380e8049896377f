"""Request fields shared by completions and chat completions, their translation to engine terms,
and the output-length limit.

Every field of the OpenAI request schemas is declared. Those the engine uses
are translated to ``SamplingParams``; those it cannot apply (``user``, ``store``,
``service_tier``, ...) are accepted and ignored with a warning logged once per
field name (:attr:`SamplingRequest.IGNORED_FIELDS`). Fields whose meaning the
engine does not implement yet and that cannot be ignored without changing the
answer (``functions``, ...) accept only their "off" value and
are a 400 that says so otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import field_validator

from fastdeploy.core.sampling_params import ALL_LOGPROBS, SamplingParams, SamplingParamsError
from fastdeploy.entrypoints.openai.errors import BadRequestError, encodable
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, _check_token_ids, warn_once
from fastdeploy.entrypoints.openai.protocol.structured import StructuredOutputsRequest

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128
"""Most choices one request may ask for (OpenAI's own limit). Each choice is an engine
request, so an unbounded ``n`` would let one request flood the engine."""


class StreamOptions(OpenAIModel):
    """``stream_options``: OpenAI's ``include_usage`` and ``include_obfuscation`` (ignored), and vLLM's
    ``continuous_usage_stats`` (with ``include_usage``: the usage so far in every chunk)."""

    include_usage: bool | None = False
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = False


# OpenAI fields the engine does not implement yet, with the values that mean "off".
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
}


def _is_off(value: Any, off_values: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of the "off" values (``False`` is not ``0``, and vice versa)."""
    if value is None or isinstance(value, bool):
        return any(value is off for off in off_values)
    return any(off is not None and not isinstance(off, bool) and off == value for off in off_values)


def check_truncate_prompt_tokens(value: int | None) -> int | None:
    """``truncate_prompt_tokens``: at least 1, or -1 (the model's maximum context length)."""
    if value is not None and value < 1 and value != -1:
        raise ValueError("must be at least 1, or -1 for the model's maximum context length")
    return value


_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


def check_logit_bias_keys(bias: Mapping[Any, Any] | None, param: str = "logit_bias") -> None:
    """A 400 naming every ``logit_bias`` key that is not a token id written in ASCII digits (Python's
    ``int`` also reads `` 1``, ``1_0`` or ``１``, which OpenAI refuses), in the engine's words.
    Negative ids are left to the engine's check, which names them."""
    bad = [key for key in bias or {} if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key))]
    if bad:
        named = ", ".join(repr(encodable(str(key)[:100])) for key in bad)
        raise BadRequestError(
            f"logit_bias key{'s' if len(bad) > 1 else ''} {named}: not a token id", param=param
        )


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ValueError("must be a string or a list of strings")


class SamplingControls(OpenAIModel):
    """The sampling fields beyond temperature and top_p: OpenAI's ``seed``, ``stop`` and penalties
    and vLLM's extensions (sent with the openai client's ``extra_body``). Completions and chat take
    them (:class:`SamplingRequest`), and ``/v1/responses`` takes them as extensions and hands them to
    the chat request it becomes."""

    seed: int | None = None
    stop: Any = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a JSON string key) → bias in [-100, 100]."""
    top_k: int | None = None
    """-1 or 0: off."""
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    """SGLang's name of ``include_stop_str_in_output`` (keep the matched stop string in the text);
    ``include_stop_str_in_output`` wins where both are given."""
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    repetition_penalty: float | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: each token of the logprobs written ``token_id:N`` instead of its text."""

    @field_validator("stop")
    @classmethod
    def _validate_stop(cls, v: Any) -> Any:
        return _check_stop(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: Any) -> Any:
        return v if v is None else _check_token_ids(v)

    @field_validator("seed", "top_k")
    @classmethod
    def _check_int64(cls, v: int | None) -> int | None:
        # (the engine's IPC and tensors hold 64-bit integers: a larger one would fail there, a 500)
        if v is not None and not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError("must fit in a signed 64-bit integer")
        return v

    def keeps_stop_str(self) -> bool | None:
        """Whether the matched stop string stays in the text (``include_stop_str_in_output``, else
        SGLang's ``no_stop_trim``); None: neither was given."""
        if self.include_stop_str_in_output is not None:
            return self.include_stop_str_in_output
        return self.no_stop_trim


class SamplingRequest(StructuredOutputsRequest, SamplingControls):
    """Fields shared by completions and chat completions (the structured-output ones and
    :class:`SamplingControls` included)."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """Accepted and ignored (an end-user id; nothing here uses it)."""
    # Extensions (vLLM-compatible names), sent with the openai client's ``extra_body``.
    prompt_logprobs: int | None = None
    """Logprobs of the prompt tokens plus this many top alternatives each (vLLM's field)."""
    return_token_ids: bool | None = None
    """vLLM's: the prompt's token ids (``prompt_token_ids``) and each choice's (``token_ids``) in the response."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep only the last N prompt tokens (-1: the last ``max_model_len``)."""
    cache_salt: str | None = None
    """vLLM's: prefix-cache isolation; requests share cached prompt blocks only with the same salt."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: which end ``truncate_prompt_tokens`` cuts (left, the default: the first tokens go)."""

    IGNORED_FIELDS: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        "user": ("end-user ids are not used by this server", (None,)),
    }
    """OpenAI fields accepted and ignored: name → (why, the values that need no warning)."""

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, v: int | None) -> int | None:
        return check_truncate_prompt_tokens(v)

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int | None) -> int | None:
        if v is not None and v > MAX_N:
            raise ValueError(f"must be at most {MAX_N}, got {v}")
        return v

    def usage_in_stream(self, forced: bool = False) -> tuple[bool, bool]:
        """Whether a streaming response ends with a usage chunk, and whether every chunk carries the
        usage so far (vLLM's ``continuous_usage_stats``, which needs the first, as in vLLM).
        ``forced``: the server's ``--enable-force-include-usage`` (the usage chunk as if asked for)."""
        if not self.stream:
            return False, False
        options = self.stream_options
        include = forced or bool(options and options.include_usage)
        return include, include and bool(options and options.continuous_usage_stats)

    def check_supported(self) -> None:
        """Raise a 400 if a not-yet-implemented OpenAI field has a non-default value, and log (once
        per field name) the fields that are accepted but ignored."""
        for name, off_values in _UNSUPPORTED_DEFAULTS.items():
            if name in type(self).model_fields and not _is_off(getattr(self, name), off_values):
                raise BadRequestError(f"'{name}' is not supported by this server yet", param=name)
        for name, (why, quiet_values) in self.IGNORED_FIELDS.items():
            if not _is_off(getattr(self, name), quiet_values):
                warn_once(f"ignored:{name}", f"The request field '{name}' is accepted but ignored: {why}")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options: only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            warn_once(
                "ignored:stream_options.include_obfuscation",
                "The request field 'stream_options.include_obfuscation' is accepted but ignored: "
                "stream chunks are not padded",
            )

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested output limit and the name of the field it came from."""
        return self.max_tokens, "max_tokens"

    def _num_logprobs(self) -> int | None:
        """Top logprobs per token the request asks for (None: no logprobs)."""
        return None

    def _num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token the engine must compute (None: none)."""
        k = self.prompt_logprobs
        if k is not None and k < ALL_LOGPROBS:
            raise BadRequestError(
                f"prompt_logprobs must be at least 0 (or -1: the whole vocabulary), got {k}",
                param="prompt_logprobs",
            )
        return k

    ECHO_ALLOWS_ZERO_MAX_TOKENS: ClassVar[bool] = False
    """Whether ``echo`` lets ``max_tokens`` be 0 (completions: scoring a prompt; chat has an echo
    too, but never takes 0)."""

    def _allows_zero_max_tokens(self) -> bool:
        """Whether ``max_tokens: 0`` makes sense (only for completions with ``echo``: scoring a prompt)."""
        return self.ECHO_ALLOWS_ZERO_MAX_TOKENS and bool(getattr(self, "echo", False))

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's ``SamplingParams`` for this request (a 400 if a value is invalid).

        ``defaults``: the model's values (``--generation-config``) of temperature, top_p, top_k,
        min_p and repetition_penalty, for the fields the request leaves unset (else OpenAI's).
        ``max_tokens`` is left as requested (possibly None); the server fixes it
        with :func:`resolve_max_tokens` once the prompt length is known.
        """
        model = defaults or {}

        def unset_or(value: Any, name: str, fallback: Any) -> Any:
            return model.get(name, fallback) if value is None else value

        self.check_supported()
        max_tokens, max_tokens_field = self._requested_max_tokens()
        least = 0 if self._allows_zero_max_tokens() else 1
        if max_tokens is not None and max_tokens < least:
            hint = (
                " (0 is allowed only with echo)"
                if max_tokens == 0 and self.ECHO_ALLOWS_ZERO_MAX_TOKENS
                else ""
            )
            raise BadRequestError(
                f"{max_tokens_field} must be at least {least}, got {max_tokens}{hint}", param=max_tokens_field
            )
        top_k = unset_or(self.top_k, "top_k", -1)
        kwargs: dict[str, Any] = {
            "n": 1 if self.n is None else self.n,
            "temperature": unset_or(self.temperature, "temperature", 1.0),
            "top_p": unset_or(self.top_p, "top_p", 1.0),
            "top_k": -1 if top_k == 0 else top_k,
            "min_p": unset_or(self.min_p, "min_p", 0.0),
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": 0 if self.min_tokens is None else self.min_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "frequency_penalty": 0.0 if self.frequency_penalty is None else self.frequency_penalty,
            "presence_penalty": 0.0 if self.presence_penalty is None else self.presence_penalty,
            "repetition_penalty": unset_or(self.repetition_penalty, "repetition_penalty", 1.0),
            "logit_bias": self.logit_bias,
            "bad_words": list(self.bad_words or []),
            "logprobs": self._num_logprobs(),
            "prompt_logprobs": self._num_prompt_logprobs(),
            "structured_outputs": self.structured_output_params(),
            "cache_salt": self.cache_salt,
        }
        flags = {
            "include_stop_str_in_output": self.keeps_stop_str(),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs.update({flag: value for flag, value in flags.items() if value is not None})
        check_logit_bias_keys(self.logit_bias)
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as exc:
            param = max_tokens_field if exc.param == "max_tokens" else exc.param
            message = str(exc).replace("max_tokens", max_tokens_field, 1) if param != exc.param else str(exc)
            raise BadRequestError(message, param=param) from None


# --------------------------------------------------------------------------- limits


_OUTPUT_LIMIT_FIELDS = {"messages": "max_completion_tokens", "prompt": "max_tokens"}
"""The output-limit field named in a length error, by the input it is about (chat: OpenAI's
current name, which SGLang's message uses too; completions: ``max_tokens``)."""


def _prompt_too_long(num_prompt_tokens: int, max_model_len: int, prompt_kind: str) -> BadRequestError:
    """The 400 for a prompt that leaves no room for one output token. Its words are OpenAI's
    (``This model's maximum context length is``) and SGLang's (``is longer than the model's
    context length``), which clients and both servers' tests match."""
    return BadRequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_kind} "
        f"resulted in {num_prompt_tokens} tokens, which is longer than the model's context length allows: "
        f"it leaves no room for the completion (at least 1 token). Please reduce the length of the {prompt_kind}.",
        param=prompt_kind,
        code="context_length_exceeded",
    )


def _output_too_long(
    num_prompt_tokens: int, requested: int, max_model_len: int, prompt_kind: str
) -> BadRequestError:
    """The 400 for an output limit the context cannot hold after the prompt: OpenAI's and vLLM's
    words (``However, you requested N tokens (P in the messages, M in the completion)``), then
    SGLang's: ``is longer than the model's context length`` when the prompt alone leaves no room,
    else ``Requested token count exceeds the model's maximum context length`` and ``... is too large``."""
    field = _OUTPUT_LIMIT_FIELDS.get(prompt_kind, "max_tokens")
    total = num_prompt_tokens + requested
    requested_words = (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} "
        f"tokens ({num_prompt_tokens} in the {prompt_kind}, {requested} in the completion)."
    )
    if num_prompt_tokens >= max_model_len:
        why = (
            f"The input is longer than the model's context length allows: it leaves no room for the "
            f"completion. Please reduce the length of the {prompt_kind}."
        )
    else:
        why = (
            f"Requested token count exceeds the model's maximum context length: {field} is too large "
            f"({requested} > {max_model_len} - {num_prompt_tokens}). Please reduce the length of the "
            f"{prompt_kind} or completion."
        )
    return BadRequestError(f"{requested_words} {why}", param=prompt_kind, code="context_length_exceeded")


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
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room < 1:
            raise _prompt_too_long(num_prompt_tokens, max_model_len, prompt_kind)
        return room if default is None else min(default, room)
    if requested > room:
        raise _output_too_long(num_prompt_tokens, requested, max_model_len, prompt_kind)
    return requested
