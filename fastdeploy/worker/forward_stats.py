"""How the runner's forward passes ran: replayed decode graphs, replayed mixed-step graphs, or
eagerly, with their step and token counts, logged every ``FD_FORWARD_STATS_LOG_S`` seconds (a
minute by default) while they change.

It answers, from a server's log, which path a workload's steps took (a Poisson load of
512-token prompts beside ~100 running requests should replay no mixed-step graph: every step
with a prompt has more than 512 tokens), at the cost of a counter add per step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PATHS = ("decode_graph", "mixed_graph", "eager")
"""The forward paths of :meth:`fastdeploy.worker.model_runner.ModelRunner._forward`."""


@dataclass
class ForwardStats:
    """Steps and tokens per forward path since start-up (:data:`PATHS`)."""

    log_every_s: float = 60.0
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))
    _last_log: float = field(default_factory=lambda: time.monotonic())
    _logged_steps: int = 0

    def note(self, path: str, num_tokens: int) -> None:
        """Count one forward of ``num_tokens`` tokens on ``path``; log the totals when ``log_every_s``
        have passed since the last line and steps ran meanwhile."""
        self.steps[path] += 1
        self.tokens[path] += num_tokens
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            total = sum(self.steps.values())
            if total != self._logged_steps:
                self._logged_steps = total
                logger.info("forward passes since start: %s", self.summary())

    def summary(self) -> str:
        """``path steps (tokens)`` for every path, e.g. ``decode_graph 812 (70,311), ...``."""
        return ", ".join(f"{path} {self.steps[path]:,} ({self.tokens[path]:,} tokens)" for path in PATHS)
