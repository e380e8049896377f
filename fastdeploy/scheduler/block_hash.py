"""Chained content hashes of full KV cache blocks, for prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"fastdeploy-root"


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: :data:`ROOT_HASH`, or one of its salt's (``cache_salt``),
    so that salted requests share cached blocks only with requests of the same salt."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"\x00salt\x00" + cache_salt.encode()).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> bytes:
    """``hash(parent_hash, token_ids, extra_keys)`` as a 32-byte SHA-256 digest.

    Chaining through the parent makes a block's hash identify the whole prefix
    ending in it; ``extra_keys`` (content hashes of multimodal items that overlap
    the block) keep equal token ids with different images apart.
    """
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00")
        h.update(key.encode())
    return h.digest()


def block_extra_keys(start: int, end: int, mm_items: Sequence[tuple[int, int, str]]) -> tuple[str, ...]:
    """Hashes of the multimodal items (``(start, end, mm_hash)``) overlapping ``[start, end)``."""
    return tuple(h for s, e, h in mm_items if s < end and e > start)


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    mm_items: Sequence[tuple[int, int, str]] = (),
    root: bytes = ROOT_HASH,
) -> None:
    """Append the hashes of blocks that became full since the last call (in place); ``root`` is the
    first block's parent (:func:`root_hash`)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[-1] if hashes else root
        hashes.append(hash_block(parent, token_ids[start:end], block_extra_keys(start, end, mm_items)))
