"""One precomputed multimodal feature item, and the checks a feature must pass.

A request may carry the output of a Qwen2-VL style vision tower instead of pixels:
for each image or video, a 2-D float tensor of ``t*h*w / spatial_merge_size**2``
rows (one per merged patch) and ``hidden_size`` columns (the language model's
width), plus the item's ``grid_thw``. Everything wrong with such an item is a
:class:`MultimodalInputError` naming the item, which the server answers with a
400; nothing here may crash a worker.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Modality = Literal["image", "video"]
MODALITIES: tuple[str, ...] = ("image", "video")
FEATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes features may have (float8 and others cannot be sent to the engine)."""


class MultimodalInputError(ValueError):
    """A multimodal item of a request is unusable (bad URL, bad file, wrong shape).

    The message names the item (its URL, or where it came inline) so the client can
    tell which part of the request to fix; ``param`` is that request field where it
    is known (e.g. ``messages[0].content[1]``), for the error body.
    """

    param: str | None = None


class FeatureFetchError(MultimodalInputError):
    """A feature URL could not be fetched (refused scheme or path, HTTP error, timeout, too large)."""

    def __init__(self, url: str, reason: str):
        shown = url if len(url) <= 256 else f"{url[:256]}... ({len(url)} characters)"
        super().__init__(f"cannot fetch multimodal feature {shown}: {reason}")
        self.url = url
        self.reason = reason


@dataclass(frozen=True)
class FeatureItem:
    """One image or video of a request given as precomputed vision features.

    An item is built with ``url`` (fetched later by :func:`fastdeploy.multimodal.fetch_features`)
    or with ``features`` (an inline tensor, e.g. a decoded ``image_embeds`` part);
    fetching returns a copy with ``features`` and ``mm_hash`` filled in.
    """

    modality: Modality
    """``"image"`` or ``"video"``."""
    grid_thw: tuple[int, int, int]
    """Patch grid (temporal, height, width) before spatial merging, as Qwen2-VL reports it."""
    url: str | None = None
    """Where the features live: ``file://``, ``http(s)://`` or ``bos://bucket/key``."""
    features: torch.Tensor | None = None
    """The ``[rows, hidden_size]`` float tensor, once loaded (or given inline)."""
    mm_hash: str | None = None
    """Content hash (see :func:`fastdeploy.multimodal.hashing.mm_hash`), once known."""
    index: int = 0
    """Position of the item among the request's multimodal items (for error messages)."""
    location: str | None = None
    """The request field that carried the item (e.g. ``messages[0].content[1]``), where known."""

    def __post_init__(self) -> None:
        if self.modality not in MODALITIES:
            raise MultimodalInputError(
                f"multimodal item {self.index}: modality must be one of {MODALITIES}, got {self.modality!r}"
            )
        if self.url is None and self.features is None:
            raise MultimodalInputError(f"multimodal item {self.index}: give a feature URL or inline features")
        object.__setattr__(self, "grid_thw", parse_grid_thw(self.grid_thw, self.label))

    @property
    def label(self) -> str:
        """How error messages name this item: its URL, else where it came, else ``<modality> item <index>``."""
        if self.url is not None:
            return self.url
        return self.location if self.location is not None else f"{self.modality} item {self.index}"

    def located(self, exc: MultimodalInputError) -> MultimodalInputError:
        """``exc`` naming this item's request field as its ``param`` (where it names none yet)."""
        if exc.param is None:
            exc.param = self.location
        return exc

    def with_features(self, features: torch.Tensor, mm_hash: str) -> FeatureItem:
        """A copy of this item carrying its loaded features and content hash."""
        return dataclasses.replace(self, features=features, mm_hash=mm_hash)


def parse_grid_thw(grid_thw: Sequence[int], label: str) -> tuple[int, int, int]:
    """Check that ``grid_thw`` is three positive integers and return it as a tuple of ints."""
    ok = isinstance(grid_thw, (list, tuple)) and len(grid_thw) == 3
    ok = ok and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in grid_thw)
    if not ok:
        raise MultimodalInputError(
            f"{label}: grid_thw must be three positive integers [t, h, w], got {grid_thw!r}"
        )
    t, h, w = (int(v) for v in grid_thw)
    return t, h, w


def expected_rows(grid_thw: Sequence[int], spatial_merge_size: int, label: str = "multimodal item") -> int:
    """Feature rows of an item: ``t * h * w / spatial_merge_size**2``.

    ``h`` and ``w`` must be multiples of ``spatial_merge_size``, as the vision
    tower merges ``spatial_merge_size x spatial_merge_size`` patches into one row.
    """
    t, h, w = parse_grid_thw(grid_thw, label)
    if spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1, got {spatial_merge_size}")
    if h % spatial_merge_size or w % spatial_merge_size:
        raise MultimodalInputError(
            f"{label}: grid_thw {[t, h, w]} has h and w that are not multiples of the "
            f"spatial merge size {spatial_merge_size}"
        )
    return t * h * w // (spatial_merge_size * spatial_merge_size)


def validate_features(
    features: torch.Tensor,
    grid_thw: Sequence[int],
    hidden_size: int,
    spatial_merge_size: int,
    label: str,
) -> None:
    """Raise :class:`MultimodalInputError` unless ``features`` is a float ``[rows, hidden_size]`` tensor.

    ``rows`` is :func:`expected_rows` of ``grid_thw``; the message names ``label``
    and gives the expected and actual shapes.
    """
    rows = expected_rows(grid_thw, spatial_merge_size, label)
    expected = [rows, hidden_size]
    actual = list(features.shape)
    if features.dim() != 2:
        raise MultimodalInputError(f"{label}: features must be 2-D {expected}, got shape {actual}")
    if features.dtype not in FEATURE_DTYPES:
        raise MultimodalInputError(
            f"{label}: features must be float16, bfloat16, float32 or float64, got dtype {features.dtype}"
        )
    if actual != expected:
        what = "row count" if actual[0] != rows else "width (the model's hidden size)"
        raise MultimodalInputError(
            f"{label}: wrong {what}: expected shape {expected} for grid_thw {list(grid_thw)} "
            f"(spatial merge size {spatial_merge_size}, hidden size {hidden_size}), got {actual}"
        )
    if not bool(torch.isfinite(features).all()):
        raise MultimodalInputError(f"{label}: features contain NaN or infinite values")
