"""Precomputed multimodal features: content parts, fetching, checks and content hashes.

The integrator's path for a chat request: :func:`item_from_content_part` for each
feature part, then :func:`fetch_features` (parallel, ordered, cached) to get
every item's ``features`` and ``mm_hash``; a :class:`MultimodalInputError` from
either is a 400 naming the item. See docs/multimodal.md.
"""

from fastdeploy.multimodal.fetch import fetch_features
from fastdeploy.multimodal.hashing import mm_hash
from fastdeploy.multimodal.inputs import (
    FeatureFetchError,
    FeatureItem,
    MultimodalInputError,
    expected_rows,
    validate_features,
)
from fastdeploy.multimodal.loaders import decode_image_embeds, encode_features, load_feature_bytes
from fastdeploy.multimodal.parts import is_feature_part, item_from_content_part

__all__ = [
    "FeatureFetchError",
    "FeatureItem",
    "MultimodalInputError",
    "decode_image_embeds",
    "encode_features",
    "expected_rows",
    "fetch_features",
    "is_feature_part",
    "item_from_content_part",
    "load_feature_bytes",
    "mm_hash",
    "validate_features",
]
