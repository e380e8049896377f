"""Per-request sampling and output controls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """An out-of-range sampling field; ``param`` names the field for the 400 body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    ``temperature == 0`` means greedy. Validation happens in ``__post_init__`` so
    that a bad value fails where it is created, with the field's name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        self._check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        self._check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self._check(
            self.top_k == -1 or self.top_k >= 1, "top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k}"
        )
        self._check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        self._check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        self._check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        self._check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        self._check(all(s for s in self.stop), "stop", "stop strings must not be empty")

    @staticmethod
    def _check(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token every step."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> SamplingParams:
        """A copy with some fields changed (used to fan out ``n`` choices)."""
        return dataclasses.replace(self, **changes)
