"""What the engine and its grammar processes send each other (structured_output/grammar_processes.py):
dataclasses pickled by ``multiprocessing.connection`` (both ends are this engine's own processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

LIVE, REFUSED, ENDED = 0, 1, 2
"""A remote row's state after its step: the grammar goes on (its row filled), refused a token
(the row's mask is lifted), or took a stop token (only stop tokens may follow)."""

READY = "ready"
"""What a grammar process sends on its control pipe once it has started."""


@dataclass
class CompileRequest:
    """Compile a constraint (its :func:`~fastdeploy.structured_output.grammar.constraint_key`)."""

    key_id: int
    kind: str
    text: str
    reasoning_prefix: str


@dataclass
class CompileReply:
    """A compile's outcome: ``error`` is xgrammar's message for an invalid constraint, else None."""

    key_id: int
    error: str | None


@dataclass
class NewMatcher:
    """Make the matcher ``handle`` of one request from compiled constraint ``key_id``."""

    handle: int
    key_id: int
    stop_token_ids: list[int]


@dataclass
class MaskRow:
    """One row of a step's mask: the matcher ``handle`` fills row ``row``."""

    row: int
    handle: int
    tokens: list[int]
    """Output tokens to advance past before the row is filled (one a step; more after a resume)."""


@dataclass
class MaskWork:
    """One step's work for one process: its rows of mask buffer ``buffer``."""

    buffer: int
    rows: list[MaskRow]
    new: list[NewMatcher] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)


@dataclass
class MaskReply:
    """A process's answer to :class:`MaskWork` (``error``: it failed as a whole)."""

    states: list[int]
    """Per row of the work: :data:`LIVE`, :data:`REFUSED` or :data:`ENDED`."""
    error: str | None = None
    matchers: int = 0
    """Matchers the process holds after the step (those of requests still running)."""
