"""What a pooling (embedding) request asks of the worker: how to pool its prompt's hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POOLING_TYPES = ("last", "mean")


@dataclass
class PoolingParams:
    """How one embedding request turns its prompt's final hidden states (after the final norm)
    into one vector; sent with the request instead of sampling it.

    A pooling request computes its prompt (prefill only), is never sampled and finishes when its
    prefill does, with the vector as its output.
    """

    pooling_type: Literal["last", "mean"] = "last"
    """``last``: the last prompt token's hidden state; ``mean``: the mean over every prompt token
    (needs every position computed, so such a request reads nothing from the prefix cache)."""
    normalize: bool = True
    """L2-normalise the pooled vector."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, not {self.pooling_type!r}"
            )

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (not only the last)."""
        return self.pooling_type == "mean"
