"""Chat content parts that carry precomputed features, turned into :class:`FeatureItem` s.

Accepted parts (see docs/multimodal.md)::

    {"type": "image_feature_url", "image_feature_url": {"url": "...", "grid_thw": [t, h, w]}}
    {"type": "video_feature_url", "video_feature_url": {"url": "...", "grid_thw": [t, h, w]}}
    {"type": "image_embeds", "image_embeds": "<base64 of .npy/.safetensors>", "grid_thw": [t, h, w]}
    {"type": "image_embeds", "image_embeds": {"image_embeds": "<base64>", "image_grid_thw": [t, h, w]}}

The chat front end walks a message's content, calls :func:`item_from_content_part`
for each part where :func:`is_feature_part` holds (numbering them 0, 1, ...),
and hands the items to :func:`fastdeploy.multimodal.fetch.fetch_features`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastdeploy.multimodal.inputs import FeatureItem, MultimodalInputError
from fastdeploy.multimodal.loaders import decode_image_embeds

URL_PART_TYPES: dict[str, str] = {"image_feature_url": "image", "video_feature_url": "video"}
"""Content part type → modality, for parts that point at a feature file."""
EMBEDS_PART_TYPE = "image_embeds"


def is_feature_part(part: Any) -> bool:
    """Whether a content part carries precomputed features (a URL part or ``image_embeds``)."""
    return isinstance(part, Mapping) and (
        part.get("type") in URL_PART_TYPES or part.get("type") == EMBEDS_PART_TYPE
    )


def item_from_content_part(
    part: Mapping[str, Any], index: int, max_bytes: int | None = None, location: str | None = None
) -> FeatureItem:
    """The :class:`FeatureItem` of one content part; ``index`` numbers the request's items,
    ``location`` is the part's request field (``messages[i].content[j]``), which errors name.

    URL parts are not fetched here. ``image_embeds`` payloads are decoded now
    (at most ``max_bytes``). Malformed parts raise :class:`MultimodalInputError`.
    """
    try:
        return _item(part, index, max_bytes, location)
    except MultimodalInputError as exc:
        if exc.param is None:
            exc.param = location
        raise


def _item(part: Mapping[str, Any], index: int, max_bytes: int | None, location: str | None) -> FeatureItem:
    where = location or f"content part {index}"
    kind = part.get("type")
    if kind in URL_PART_TYPES:
        body = part.get(kind)
        if not isinstance(body, Mapping):
            raise MultimodalInputError(f"{where} ({kind}): expected an object with 'url' and 'grid_thw'")
        url = body.get("url")
        if not isinstance(url, str) or not url:
            raise MultimodalInputError(f"{where} ({kind}): 'url' must be a non-empty string")
        return FeatureItem(
            URL_PART_TYPES[kind], body.get("grid_thw"), url=url, index=index, location=location
        )  # type: ignore[arg-type]
    if kind == EMBEDS_PART_TYPE:
        body = part.get(kind)
        if isinstance(body, Mapping):
            payload, grid_thw = body.get("image_embeds"), body.get("image_grid_thw", body.get("grid_thw"))
        else:
            payload, grid_thw = body, part.get("grid_thw")
        try:
            features = decode_image_embeds(payload, max_bytes)  # type: ignore[arg-type]
        except MultimodalInputError as exc:
            raise MultimodalInputError(f"{where} (image_embeds): {exc}") from None
        return FeatureItem("image", grid_thw, features=features, index=index, location=location)  # type: ignore[arg-type]
    raise MultimodalInputError(f"{where}: type {kind!r} carries no multimodal features")
