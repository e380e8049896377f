"""Bounded repetitions of an xgrammar grammar unrolled into chains of rules, so that their token
masks are computed when the grammar is compiled instead of at every step.

xgrammar keeps a bounded repetition ``x{m, n}`` (a JSON string's ``maxLength``, an array's
``maxItems``, a regex ``{m,n}``) as one counted element. Inside it, every token that spans more
than one ``x`` is left undecided at compile time and checked one by one when a step's bitmask is
filled: several milliseconds per row and step for a 128k vocabulary (docs/benchmarks.md), which
was most of a structured-output step. The same language written as a chain of rules,
``c_k ::= rest | x c_{k-1}`` (``rest``: what follows the repetition in its rule), lets the
compiler decide those tokens up front, and the fill drops to microseconds.

Only the simple shape xgrammar's printer gives these rules is rewritten (alternatives that are
flat sequences of literals, character classes and rule names); any other rule is kept as it is.
"""

from __future__ import annotations

import re

MAX_UNROLLED = 128
"""Repetitions with a larger upper bound are kept (each step of the chain is a rule to compile)."""

_ELEMENT = re.compile(
    r'"(?:[^"\\]|\\.)*"[*+?]?'  # a string literal
    r"|\[(?:[^\]\\]|\\.)*\][*+?]?"  # a character class
    r"|[A-Za-z_][A-Za-z0-9_]*(?:\{\d+, -?\d+\}|[*+?])?"  # a rule name, maybe repeated
)
_REPEAT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (\d+)\}$")
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_MAY_REPEAT = re.compile(r"\{\d+, \d+\}")
"""A cheap first test of a line: most rules have no bounded repetition to parse for."""


def unroll_bounded_repetitions(ebnf: str) -> str | None:
    """``ebnf`` (as xgrammar prints a grammar) with its bounded repetitions unrolled; None if none
    could be (then the grammar is best used as it is)."""
    lines, changed = [], False
    for line in ebnf.splitlines():
        rounds = 0  # one repetition per sequence a round
        while _MAY_REPEAT.search(line) and (rewritten := _rewrite_rule(line, rounds)) is not None:
            line, chains = rewritten
            lines.extend(chains)
            rounds += 1
        changed |= rounds > 0
        lines.append(line)
    return "\n".join(lines) + "\n" if changed else None


def _rewrite_rule(line: str, round_: int) -> tuple[str, list[str]] | None:
    """The rule on ``line`` with the last bounded repetition of each sequence unrolled, and the
    chain rules it now refers to; None when it has nothing to unroll."""
    match = _RULE.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    body, lookahead = _split_lookahead(rest)
    alternatives = _alternatives(body)
    if alternatives is None:
        return None
    out_alternatives, chains = [], []
    for index, seq in enumerate(alternatives):
        found = [i for i, element in enumerate(seq or []) if _unrollable(element)]
        if not found or found[-1] == len(seq) - 1:
            out_alternatives.append(seq)
            continue
        at = found[-1]
        repeated, low, high = _REPEAT.match(seq[at]).groups()
        low, high = int(low), int(high)
        tail = seq[at + 1 :]
        chain = f"{name}__unrolled{round_}_{index}_"
        out_alternatives.append(seq[:at] + [repeated] * low + [f"{chain}{high - low}"])
        suffix = f" {lookahead}" if lookahead else ""
        for k in range(high - low, 0, -1):
            chains.append(f"{chain}{k} ::= (({' '.join(tail)}) | ({repeated} {chain}{k - 1})){suffix}")
        chains.append(f"{chain}0 ::= (({' '.join(tail)})){suffix}")
    if not chains:
        return None
    joined = " | ".join('""' if seq is None else f"({' '.join(seq)})" for seq in out_alternatives)
    head = f"{name} ::= ({joined})" + (f" {lookahead}" if lookahead else "")
    return head, chains


def _unrollable(element: str) -> bool:
    """Whether ``element`` is ``name{m, n}`` with ``0 <= m <= n <= MAX_UNROLLED``, ``n > 0``."""
    match = _REPEAT.match(element)
    return (
        match is not None
        and 0 < int(match.group(3)) <= MAX_UNROLLED
        and int(match.group(2)) <= int(match.group(3))
    )


def _split_lookahead(rest: str) -> tuple[str, str]:
    """``(body, lookahead)`` of a rule's right-hand side (lookahead: ``(=(...))`` or '')."""
    depth, in_string, in_class, escaped = 0, False, False, False
    for i, ch in enumerate(rest):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_string:
            in_string = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            in_string = True
        elif ch == "[":
            in_class = True
        elif ch == "(":
            if depth == 0 and rest.startswith("(=", i):
                return rest[:i].rstrip(), rest[i:]
            depth += 1
        elif ch == ")":
            depth -= 1
    return rest, ""


def _alternatives(body: str) -> list[list[str] | None] | None:
    """The flat alternatives of ``((a b) | (c) | "")``: element lists (None for the empty one);
    None when the body has another shape."""
    if not (body.startswith("(") and body.endswith(")")):
        return None
    out: list[list[str] | None] = []
    for part in _split_top_level(body[1:-1]):
        if part == '""':
            out.append(None)
            continue
        if not (part.startswith("(") and part.endswith(")")):
            return None
        elements = _ELEMENT.findall(part[1:-1])
        if " ".join(elements) != part[1:-1]:
            return None  # nested groups or anything else not understood here
        out.append(elements)
    return out


def _split_top_level(text: str) -> list[str]:
    """``text`` split at its ``|`` outside parentheses, literals and classes."""
    parts, start, depth, in_string, in_class, escaped = [], 0, 0, False, False, False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_string:
            in_string = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            in_string = True
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts
