"""Per-request timestamps along the serving path, for finding where a request's time goes.

Every time is ``time.monotonic()``: one clock for all processes of a host (Linux's
CLOCK_MONOTONIC), so the engine core's stamps compare with the API server's. Collecting
them costs a few clock reads per request and one per engine step; they are written out only
when ``FD_REQUEST_TIMELINE_FILE`` is set (``entrypoints/openai/timeline_log.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class RequestTimeline:
    """Where one request was when, up to its first token, and the cost of each later token.

    Fields stay None where a stage was not reached (an aborted request, a non-streaming one).
    """

    received: float | None = None
    """The HTTP handler started (body read and parsed)."""
    tokenized: float | None = None
    """The prompt is token ids (chat template rendered, tokenizer run)."""
    arrival: float | None = None
    """The engine client took the request (its ``arrival_time`` on this clock)."""
    queued: float | None = None
    """Sent to the engine core's queue."""
    scheduled: float | None = None
    """First scheduled by the engine core (arrival plus the engine's queue time)."""
    first_token_sent: float | None = None
    """The engine core sent the step output holding the first token."""
    first_token_received: float | None = None
    """The API server read that message."""
    first_token_detokenized: float | None = None
    """Its outputs were detokenized (stop strings, logprobs applied)."""
    first_chunk_written: float | None = None
    """The first SSE chunk with a token was handed to the HTTP connection."""
    token_path_s: float = 0.0
    """Sum, over the chunks after the first, of engine-core send → chunk written."""
    token_path_count: int = 0
    """Chunks in :attr:`token_path_s`."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
