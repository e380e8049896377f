"""llguidance: the second structured-output backend, for constraints that have no compiled grammar yet.

xgrammar compiles a grammar up front (a token-mask cache over the whole vocabulary: 60-140 ms
per JSON schema with a 128k vocabulary) and then fills a row of the bitmask in a few µs.
llguidance builds a matcher in about a millisecond and computes each mask lazily (tens of µs
a row). So a request whose constraint is new starts under llguidance at once instead of waiting
for its compile, while xgrammar compiles the constraint in the background for the requests
that repeat it (:mod:`fastdeploy.structured_output.manager`, backend ``auto``).

Both write the same bitmask layout (bit ``t % 32`` of int32 word ``t // 32`` allows token t).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastdeploy.structured_output.grammar import JSON_OBJECT_SCHEMA

logger = logging.getLogger(__name__)

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON laid out as xgrammar writes it without ``any_whitespace`` (``json.dumps``' separators), so
both backends give one layout."""
SUPPORTED_KINDS = frozenset({"json", "json_object", "regex", "choice", "grammar"})
"""Constraint kinds llguidance takes here (``structural_tag`` stays with xgrammar)."""


def available() -> bool:
    """Whether the llguidance package (and its torch helpers) can be imported."""
    try:
        import llguidance.torch  # noqa: F401
    except ImportError:
        return False
    return True


def grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar of a constraint key (``ValueError`` when it cannot express it)."""
    import llguidance

    if kind == "json":
        schema = strict_objects(json.loads(text))
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(JSON_OBJECT_SCHEMA), defaults=JSON_LAYOUT
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    if kind == "grammar":
        return llguidance.grammar_from("ebnf", text)
    raise ValueError(f"llguidance does not take {kind!r} constraints here")


def strict_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say,
    as xgrammar's strict mode reads them (JSON Schema's default would let a model add keys)."""
    if isinstance(schema, list):
        return [strict_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name → schema
            out[key] = {name: strict_objects(sub) for name, sub in value.items()}
        else:
            out[key] = strict_objects(value)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class GuidanceGrammar:
    """A constraint ready for llguidance matchers (what the manager hands out instead of a compiled
    xgrammar grammar while that compile runs)."""

    def __init__(self, tokenizer: Any, text: str):
        self.tokenizer = tokenizer
        self.text = text


class GuidanceRequestGrammar:
    """One request's llguidance matcher; the scheduler's ``core.request.GrammarState`` protocol."""

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.failed = False
        """A token the grammar refused was accepted anyway (never expected: it is logged once)."""

    def accept_token(self, token_id: int) -> None:
        """Advance past an output token (a token after the grammar stopped, such as EOS, is ignored)."""
        if self.failed or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token_id):
            self.failed = True
            logger.error(
                "structured output (llguidance): token %d does not follow the grammar (%s); the mask is lifted",
                token_id,
                self.matcher.get_error(),
            )

    def fill(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (a torch int32 tensor)."""
        import llguidance.torch

        if self.failed:
            bitmask[row] = -1
        else:
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)


class GuidanceBackend:
    """The tokenizer llguidance needs (built once) and its matchers."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int], threads: int):
        import llguidance
        import llguidance.hf

        eos = [e for e in eos_token_ids if e < len(hf_tokenizer)]
        if eos_token_ids and not eos:  # llguidance could not end the sequence: the request never stops
            raise ValueError(
                "llguidance: the model's end-of-sequence ids lie outside the tokenizer's vocabulary"
            )
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos or None)
        self.executor = llguidance.LLExecutor(max(threads, 1))

    def grammar(self, kind: str, text: str) -> GuidanceGrammar:
        """The constraint as llguidance takes it (``ValueError`` if it cannot: checked by building
        one matcher, about a millisecond)."""
        import llguidance

        grammar = GuidanceGrammar(self.tokenizer, grammar_text(kind, text))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar.text)
        if matcher.is_error():
            raise ValueError(f"llguidance: {matcher.get_error()}")
        return grammar

    def new_request_grammar(self, grammar: GuidanceGrammar) -> GuidanceRequestGrammar:
        import llguidance

        return GuidanceRequestGrammar(llguidance.LLMatcher(grammar.tokenizer, grammar.text))

    def fill_rows(self, grammars: list[GuidanceRequestGrammar], rows: list[int], bitmask: Any) -> None:
        """Fill ``bitmask[rows[i]]`` for ``grammars[i]``, in the executor's threads (GIL released)."""
        import llguidance.torch

        pairs = [(g.matcher, row) for g, row in zip(grammars, rows, strict=True)]
        if pairs:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
