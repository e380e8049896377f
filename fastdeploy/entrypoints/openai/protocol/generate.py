"""SGLang's native ``POST /generate`` request: prompts as text or token ids (one or a batch), SGLang's
``sampling_params`` keys, its logprob options; and the engine ``SamplingParams`` they mean.

SGLang's test suites and its clients (``sglang.RuntimeEndpoint``, RL frameworks driving rollouts
token-in / token-out) speak this API rather than OpenAI's. Unknown top-level fields are dropped
with a warning, as SGLang ignores them; an unknown ``sampling_params`` key is a 400 naming it.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from fastdeploy.core.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, _check_token_ids
from fastdeploy.entrypoints.openai.protocol.sampling import MAX_N, check_logit_bias_keys

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's ``max_new_tokens`` when a request leaves it out."""

_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
"""SGLang's ``sampling_params`` keys whose engine field has another name."""
_SAME = (
    "n", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "logit_bias",
)  # fmt: skip
"""SGLang's keys that are the engine's own."""
_CONSTRAINTS = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}
"""SGLang's output constraints (at most one) and the ``StructuredOutputsParams`` field of each."""
_NUMBER, _INT, _BOOL = (int, float), (int,), (bool,)
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "max_new_tokens": (_INT, "an integer"),
    "min_new_tokens": (_INT, "an integer"),
    "n": (_INT, "an integer"),
    "top_k": (_INT, "an integer"),
    "sampling_seed": (_INT, "an integer"),
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "min_p": (_NUMBER, "a number"),
    "frequency_penalty": (_NUMBER, "a number"),
    "presence_penalty": (_NUMBER, "a number"),
    "repetition_penalty": (_NUMBER, "a number"),
    "ignore_eos": (_BOOL, "true or false"),
    "skip_special_tokens": (_BOOL, "true or false"),
    "no_stop_trim": (_BOOL, "true or false"),
    "logit_bias": ((dict,), "an object"),
    "json_schema": ((str, dict), "a JSON schema (as a string)"),
    "regex": ((str,), "a string"),
    "ebnf": ((str,), "a string"),
    "structural_tag": ((str,), "a string"),
}
"""The JSON type each key takes (checked before the engine sees it)."""
_ACCEPTED = ("spaces_between_special_tokens", "stream_interval", "custom_params")
"""Keys taken and left without effect here (detokenization spacing, the stream's step interval:
every step is streamed; custom logit processors are not run)."""


class GenerateRequest(OpenAIModel):
    """``POST /generate`` (SGLang's ``GenerateReqInput``, the fields served here)."""

    model_config = ConfigDict(strict=False)

    text: str | list[str] | None = None
    """One prompt, or a batch of them."""
    input_ids: list[int] | list[list[int]] | None = None
    """The prompt(s) as token ids (used when ``text`` is not given)."""
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    """SGLang's sampling keys; a list gives each prompt of a batch its own."""
    stream: bool = False
    """Stream the answer(s) as server-sent events, each with the text and ids so far."""
    return_logprob: bool = False
    """Report the logprobs of the output tokens (and of the prompt from ``logprob_start_len``)."""
    logprob_start_len: int = -1
    """The first prompt position whose logprob is reported (-1: the last prompt token only)."""
    top_logprobs_num: int = Field(default=0, ge=0)
    """The most likely tokens reported per position (``*_top_logprobs``)."""
    return_text_in_logprobs: bool = False
    """Each logprob entry carries its token's text (else null)."""
    rid: str | list[str] | None = None
    """The request id(s) (``meta_info.id``, and what ``/abort_request`` takes)."""

    @field_validator("input_ids")
    @classmethod
    def _non_negative_ids(cls, value: Any) -> Any:
        if value and all(isinstance(ids, list) for ids in value):
            return [_check_token_ids(ids) for ids in value]
        return value if value is None else _check_token_ids(value)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, a batch of one for a single one; a 400 without any."""
        if self.text is not None:
            prompts: list[str | list[int]] = [self.text] if isinstance(self.text, str) else list(self.text)
            param = "text"
        elif self.input_ids is not None:
            if self.input_ids and all(isinstance(t, int) for t in self.input_ids):
                return [list(self.input_ids)]  # type: ignore[arg-type]
            prompts, param = [list(ids) for ids in self.input_ids], "input_ids"  # type: ignore[union-attr]
        else:
            raise BadRequestError("Either text, input_ids or input_embeds should be provided.", param="text")
        if not prompts:  # (an empty batch)
            raise BadRequestError(f"{param} cannot be empty.", param=param)
        return prompts

    @property
    def is_single(self) -> bool:
        """One prompt given as such (the answer is then one object, unless ``n`` > 1)."""
        if self.text is not None:
            return isinstance(self.text, str)
        return bool(self.input_ids) and all(isinstance(t, int) for t in self.input_ids or [])

    def params_for(self, index: int, count: int) -> dict[str, Any]:
        """The ``sampling_params`` of prompt ``index`` of ``count``."""
        if isinstance(self.sampling_params, list):
            if len(self.sampling_params) != count:
                raise BadRequestError(
                    f"sampling_params has {len(self.sampling_params)} entries for {count} prompts",
                    param="sampling_params",
                )
            return dict(self.sampling_params[index])
        return dict(self.sampling_params or {})


def sglang_sampling_params(
    raw: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's ``SamplingParams`` for SGLang's ``sampling_params`` (its defaults where a key is
    missing or null: ``max_new_tokens`` 128 is resolved by the caller against the context); a 400
    naming the key for an unknown one or a bad value."""
    kwargs: dict[str, Any] = {"logprobs": logprobs, "prompt_logprobs": prompt_logprobs}
    constraints: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None or key in _ACCEPTED:
            continue
        _check_type(key, value)
        if key in _CONSTRAINTS:
            constraints[key] = value
        elif key in _RENAMED:
            kwargs[_RENAMED[key]] = value
        elif key in _SAME:
            kwargs[key] = value
        else:
            raise BadRequestError(f"sampling_params: unknown key {key!r}", param=f"sampling_params.{key}")
    if kwargs.get("top_k", -1) >= 1 << 30:  # SGLang's "every token"
        kwargs["top_k"] = -1
    if kwargs.get("n", 1) > MAX_N:  # (each choice is an engine request: an unbounded n floods the engine)
        raise BadRequestError(
            f"sampling_params.n must be at most {MAX_N}, got {kwargs['n']}", param="sampling_params.n"
        )
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    if len(constraints) > 1:
        raise BadRequestError(
            "Only one of json_schema, regex, ebnf or structural_tag may be set", param="sampling_params"
        )
    for key, value in constraints.items():
        constraint = StructuredOutputsParams(**{_CONSTRAINTS[key]: value})
        _check_constraint(constraint, key)
        kwargs["structured_outputs"] = constraint
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        name = next((sglang for sglang, ours in _RENAMED.items() if ours == exc.param), exc.param)
        raise BadRequestError(str(exc).replace(exc.param, name, 1), param=f"sampling_params.{name}") from None
    except TypeError as exc:  # a value of the wrong kind (e.g. a string temperature)
        raise BadRequestError(f"sampling_params: {exc}", param="sampling_params") from None


def _check_type(key: str, value: Any) -> None:
    """A 400 naming ``key`` when ``value`` is not of the JSON type it takes."""
    bad = None
    if key in _TYPES:
        types, words = _TYPES[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            bad = words
        elif isinstance(value, float) and not math.isfinite(value):  # (JSON's NaN / Infinity)
            bad = f"a finite {words.removeprefix('a ')}"
    elif key == "stop" and not (
        isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    ):
        bad = "a string or a list of strings"
    elif key == "stop_token_ids" and not (
        isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        bad = "a list of token ids"
    if bad is not None:
        raise BadRequestError(
            f"sampling_params.{key} must be {bad}, got {value!r}", param=f"sampling_params.{key}"
        )
    if key == "logit_bias":
        check_logit_bias_keys(value, param="sampling_params.logit_bias")


def _check_constraint(constraint: StructuredOutputsParams, key: str) -> None:
    """A 400 naming ``key`` when its grammar does not build (a bad schema, regex or grammar)."""
    from fastdeploy.structured_output.grammar import validate_structured_outputs

    try:
        validate_structured_outputs(constraint, f"sampling_params.{key}")
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), param=exc.param) from None
