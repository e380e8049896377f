"""Hands the current step's attention metadata to every attention layer.

Model code stays free of attention plumbing: the runner sets the context around
the forward pass and each ``Attention`` layer reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_current: Any = None


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[None]:
    """Make ``attn_metadata`` visible to attention layers during one forward pass."""
    global _current
    previous, _current = _current, attn_metadata
    try:
        yield
    finally:
        _current = previous


def get_attn_metadata() -> Any:
    """The metadata of the forward pass in progress (None during profiling or warm-up)."""
    return _current
