"""A request's structured-output constraint as an xgrammar grammar: the one mapping, used by the API
server to validate a request (a 400 before it is submitted) and by the engine core to compile it."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from fastdeploy import envs
from fastdeploy.core.sampling_params import SamplingParamsError, StructuredOutputsParams
from fastdeploy.structured_output.repetition import MAX_UNROLLED, unroll_bounded_repetitions

logger = logging.getLogger(__name__)

JSON_OBJECT_SCHEMA = {"type": "object"}
"""``response_format: {"type": "json_object"}``: any JSON object (not any JSON value)."""

_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
"""xgrammar's error messages start with ``[time] /path/file.cc:line:``; clients need only the rest."""


def constraint_key(params: StructuredOutputsParams) -> tuple[str, str, str]:
    """``(kind, canonical text, reasoning prefix or "")``: equal for equal constraints, so the engine
    compiles each once."""
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        # keys keep their order: a schema's properties come out in the order it lists them
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        text = json.dumps(list(value), ensure_ascii=False)
    else:
        text = value
    return kind, text, params.reasoning_prefix or ""


def reasoning_prefix_ebnf(start_tag: str, end_tag: str, starts_inside: bool) -> str:
    """The EBNF of a reasoning block before an answer: any text up to the first ``end_tag`` and the
    whitespace after it when the output ``starts_inside`` the reasoning (the prompt opened it), else
    an optional ``start_tag`` … ``end_tag`` block (a model that may answer at once).

    "Any text without ``end_tag``" is the star of: a character other than the tag's first, or a
    proper prefix of the tag followed by a character that does not continue it."""
    alternatives = [f"[^{_char_class(end_tag[0])}]"]
    for i in range(1, len(end_tag)):
        alternatives.append(f"{json.dumps(end_tag[:i])} [^{_char_class(end_tag[i])}]")
    body = f"({' | '.join(alternatives)})*"
    block = f"{body} {json.dumps(end_tag)} [ \\n\\t\\r]*"
    if starts_inside:
        return f"root ::= {block}"
    return f"root ::= ({json.dumps(start_tag)} {block})?"


def _char_class(char: str) -> str:
    """``char`` escaped for an EBNF character class."""
    return "\\" + char if char in "\\]^-" else char


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def prime_compiler(compiler: Any, length: int) -> None:
    """Fill ``compiler``'s rule cache with the unrolled chain of a plain JSON string of at most
    ``length`` characters (at most :data:`~.repetition.MAX_UNROLLED`: a longer ``maxLength`` is not
    unrolled, by :mod:`.repetition`, and so shares nothing with the chain): the chain's
    rules of every shorter ``maxLength`` are the same rules, so a schema with such strings then
    compiles in milliseconds instead of tens to hundreds (the token masks of each rule in the chain
    are computed once here). A one-off cost of ~1 s of one thread for 128 characters on the CI CPU
    (docs/benchmarks.md, twentieth session)."""
    length = min(length, MAX_UNROLLED)
    if length <= 0:
        return
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": length}},
        "required": ["s"],
    }
    try:
        compiler.compile_grammar(build_grammar("json", json.dumps(schema)))
    except Exception as exc:  # only an optimization: the requests' compiles go on without it
        logger.warning("priming the grammar compiler failed: %s", exc)


def build_grammar(kind: str, text: str, reasoning_prefix: str = "", unroll: bool = True) -> Any:
    """The ``xgrammar.Grammar`` of a constraint key; ``ValueError`` saying what is wrong if invalid.

    ``reasoning_prefix``: the EBNF of a reasoning block the constraint follows
    (:func:`reasoning_prefix_ebnf`). ``unroll``: with bounded repetitions unrolled (:func:`unrolled`;
    ~1 ms a schema): what the engine compiles, and not needed where the grammar is only checked."""
    import xgrammar as xgr

    grammar = _build_constraint(kind, text, unroll)
    if not reasoning_prefix:
        return grammar
    return xgr.Grammar.concat(xgr.Grammar.from_ebnf(reasoning_prefix), grammar)


def _build_constraint(kind: str, text: str, unroll: bool) -> Any:
    import xgrammar as xgr

    unrolled_if = unrolled if unroll else (lambda grammar: grammar)

    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            where = xgrammar_dropped_constraint(schema)
            if where is not None and envs.FD_STRUCTURED_OUTPUTS_BACKEND != "guidance":
                raise ValueError(
                    f"at {where}, minLength / maxLength together with pattern or format is not enforced by "
                    "the structured-output backend (xgrammar); drop one of them, or serve with "
                    "FD_STRUCTURED_OUTPUTS_BACKEND=guidance"
                )
            return unrolled_if(xgr.Grammar.from_json_schema(text, any_whitespace=False))
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(json.dumps(JSON_OBJECT_SCHEMA), any_whitespace=False)
        if kind == "regex":
            return unrolled_if(xgr.Grammar.from_regex(text))
        if kind == "choice":
            choices = json.loads(text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            return xgr.Grammar.from_ebnf(choice_ebnf(choices))
        if kind == "grammar":
            return unrolled_if(xgr.Grammar.from_ebnf(text))
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    except ValueError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (and its own error types) for bad input
        raise ValueError(clean_message(str(exc))) from None
    raise ValueError(f"unknown structured-output kind {kind!r}")


def unrolled(grammar: Any) -> Any:
    """``grammar`` with its bounded repetitions unrolled (:mod:`.repetition`: the same language,
    with masks decided at compile time), or ``grammar`` itself if it has none to unroll."""
    import xgrammar as xgr

    text = unroll_bounded_repetitions(str(grammar))
    if text is None:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception:  # a printed form xgrammar does not read back: keep the grammar as it is
        return grammar


def clean_message(message: str) -> str:
    """An xgrammar error message without its C++ source location."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line) or "invalid grammar"


_STRING_LENGTHS = ("minLength", "maxLength")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose value maps names to subschemas (the names are not keywords)."""
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = (
    "items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
    "additionalItems", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip


def xgrammar_dropped_constraint(schema: Any, path: str = "$") -> str | None:
    """Where ``schema`` has a string's ``minLength`` / ``maxLength`` beside its ``pattern`` or
    ``format``: xgrammar 0.2 compiles such a schema with a warning and enforces the pattern or format
    without the length (so answers broke the schema). The first such place as a JSON path, or None."""
    if not isinstance(schema, dict):
        return None
    if any(k in schema for k in _STRING_LENGTHS) and ("pattern" in schema or "format" in schema):
        return path
    subschemas: list[tuple[str, Any]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            subschemas += [(f"{path}.{key}.{name}", sub) for name, sub in schema[key].items()]
    for key in _SCHEMA_LISTS + _SCHEMA_ONE:
        value = schema.get(key)
        if isinstance(value, list):
            subschemas += [(f"{path}.{key}[{i}]", sub) for i, sub in enumerate(value)]
        elif isinstance(value, dict):
            subschemas.append((f"{path}.{key}", value))
    for where, sub in subschemas:
        found = xgrammar_dropped_constraint(sub, where)
        if found is not None:
            return found
    return None


def validate_structured_outputs(params: StructuredOutputsParams, field: str) -> None:
    """Build the grammar of ``params``; a :class:`SamplingParamsError` naming ``field`` if it is invalid,
    or if xgrammar would leave part of it unenforced (:func:`xgrammar_dropped_constraint`; llguidance,
    ``FD_STRUCTURED_OUTPUTS_BACKEND=guidance``, enforces those)."""
    kind, text, _ = constraint_key(params)
    try:
        build_grammar(kind, text, unroll=False)
    except ImportError:
        raise SamplingParamsError(
            field,
            "structured outputs need the xgrammar package, which is not installed here "
            "(pip install xgrammar; it needs torch, so the Paddle backend has none)",
        ) from None
    except ValueError as exc:
        what = {
            "json": "JSON schema",
            "json_object": "JSON object",
            "regex": "regex",
            "choice": "choice",
            "grammar": "grammar",
            "structural_tag": "structural tag",
        }[kind]
        raise SamplingParamsError(field, f"invalid {what} in '{field}': {exc}") from None
