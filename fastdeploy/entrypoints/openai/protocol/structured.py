"""Structured-output request fields: OpenAI's ``response_format``, vLLM's ``structured_outputs`` object
and its older ``guided_*`` fields, and SGLang's ``json_schema`` / ``regex`` / ``ebnf``, turned into the
one ``StructuredOutputsParams`` of a request.

At most one of them may constrain a request. The grammar is built here, in the API server, so that
an invalid schema, regex or grammar is a 400 naming the field before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from fastdeploy.core.sampling_params import SamplingParamsError, StructuredOutputsParams
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, warn_once

BACKENDS = ("xgrammar", "auto")
"""``guided_decoding_backend`` / ``structured_outputs.backend`` values accepted (xgrammar serves all)."""


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's ``structured_outputs`` object: exactly one constraint field, plus options."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    backend: str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class StructuredOutputsRequest(OpenAIModel):
    """The structured-output fields a completions or chat request may carry (a mixin)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # SGLang's names
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The request's constraint (None: free text); a 400 naming the field if it is invalid."""
        _check_backend(self.guided_decoding_backend, "guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            warn_once(
                "ignored:guided_whitespace_pattern",
                "The request field 'guided_whitespace_pattern' is accepted but ignored: JSON is generated "
                "without free whitespace",
            )
        given = [(field, params) for field, params in self._candidates() if params is not None]
        if len(given) > 1:
            names = ", ".join(f"'{field}'" for field, _ in given)
            raise BadRequestError(
                f"only one structured-output constraint may be given, got {names}", param=given[1][0]
            )
        if not given:
            return None
        field, params = given[0]
        from fastdeploy.structured_output.grammar import validate_structured_outputs

        try:
            validate_structured_outputs(params, field)
        except SamplingParamsError as exc:
            raise BadRequestError(str(exc), param=exc.param) from None
        return params

    def response_format_applies(self) -> bool:
        """Whether ``response_format`` constrains this request's answer (it shapes a text answer: a
        request whose answer is something else, a forced tool call, overrides it)."""
        return True

    def _candidates(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        """Every structured-output field with the constraint it asks for (None: not given / off)."""
        fmt = self.response_format
        fmt_field = (
            "response_format.json_schema.schema" if fmt and fmt.type == "json_schema" else "response_format"
        )
        fmt_params = _from_response_format(fmt) if self.response_format_applies() else None
        out: list[tuple[str, StructuredOutputsParams | None]] = [(fmt_field, fmt_params)]
        so = self.structured_outputs
        if so is not None:
            _check_backend(so.backend, "structured_outputs.backend")
            fields = {
                "json": so.json_,
                "json_object": so.json_object or None,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "structural_tag": so.structural_tag,
            }
            set_fields = {k: v for k, v in fields.items() if v is not None}
            if len(set_fields) != 1:
                raise BadRequestError(
                    "structured_outputs must set exactly one of json, json_object, regex, choice, grammar, "
                    f"structural_tag; got {sorted(set_fields) or 'none'}",
                    param="structured_outputs",
                )
            ((kind, value),) = set_fields.items()
            out.append((f"structured_outputs.{kind}", _params(kind, value, f"structured_outputs.{kind}")))
        for field, kind, value in (
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
            ("json_schema", "json", self.json_schema),
            ("regex", "regex", self.regex),
            ("ebnf", "grammar", self.ebnf),
        ):
            if value is not None:
                out.append((field, _params(kind, value, field)))
        return out


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise BadRequestError(
            "response_format of type 'json_schema' needs 'json_schema.schema'",
            param="response_format.json_schema",
        )
    return _params("json", fmt.json_schema.schema_, "response_format.json_schema.schema")


def _params(kind: str, value: Any, field: str) -> StructuredOutputsParams:
    if kind == "json" and isinstance(value, bool):
        value = {} if value else {"not": {}}
    if kind == "choice" and (not value or not all(value)):
        raise BadRequestError(f"'{field}' must be a non-empty list of non-empty strings", param=field)
    if kind in ("regex", "grammar", "structural_tag") and not value:
        raise BadRequestError(f"'{field}' must not be empty", param=field)
    return StructuredOutputsParams(**{kind: value})


def _check_backend(backend: str | None, field: str) -> None:
    if backend is not None and backend not in BACKENDS:
        raise BadRequestError(
            f"structured-output backend {backend!r} is not available; this server uses xgrammar "
            f"(accepted: {', '.join(BACKENDS)})",
            param=field,
        )
