"""Prompts with precomputed image / video features, for the chat server and the offline ``LLM``.

Two ways in:

- chat messages whose ``content`` lists feature parts (``image_feature_url``,
  ``video_feature_url``, ``image_embeds``; see :mod:`fastdeploy.multimodal.parts`):
  :meth:`MultimodalPromptBuilder.split_chat` replaces each part by the text the
  Qwen2-VL chat template renders for it (``<|vision_start|><|image_pad|><|vision_end|>``)
  and collects the items;
- token ids plus vLLM-style ``multi_modal_data`` (:func:`items_from_mm_data`),
  whose placeholders the caller wrote into the prompt.

Then :meth:`MultimodalPromptBuilder.place` fetches and checks the items
(:func:`fetch_features`, blocking: call it through ``asyncio.to_thread`` from
async code) and expands each placeholder to one token per feature row.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fastdeploy.core.mm_item import MMItem
from fastdeploy.multimodal.encoder_cache import EncoderCacheManager
from fastdeploy.multimodal.fetch import fetch_features
from fastdeploy.multimodal.inputs import FeatureItem, MultimodalInputError
from fastdeploy.multimodal.items import expand_placeholders, placeholder_text
from fastdeploy.multimodal.parts import is_feature_part, item_from_content_part
from fastdeploy.multimodal.url_policy import MediaUrlPolicy
from fastdeploy.transformers_utils.config import ModelArchConfig

_EMBEDS_KEYS = ("image_embeds", "video_embeds", "embeds", "features")
_GRID_KEYS = ("image_grid_thw", "video_grid_thw", "grid_thw")


def _as_tensor(value: Any, label: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise MultimodalInputError(
        f"{label}: features must be a torch.Tensor or numpy array, got {type(value).__name__}"
    )


def _as_grid(value: Any) -> Any:
    """A grid given as a tensor / array (e.g. ``image_grid_thw[i]``) as a plain list."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return [int(v) for v in value.reshape(-1).tolist()]
    return value


def items_from_mm_data(multi_modal_data: Mapping[str, Any]) -> list[FeatureItem]:
    """The items of a ``multi_modal_data`` dict: ``{"image": [...], "video": [...]}``.

    Each entry (or a single one instead of a list) is a :class:`FeatureItem`, or
    ``{"image_embeds": tensor, "image_grid_thw": [t, h, w]}`` (``video_embeds`` /
    ``video_grid_thw`` for videos; ``grid_thw`` works for both), or
    ``{"url": "file:///...", "grid_thw": [t, h, w]}``. Items are numbered in the
    order given, images first.
    """
    unknown = set(multi_modal_data) - {"image", "video"}
    if unknown:
        raise MultimodalInputError(f"multi_modal_data accepts 'image' and 'video', got {sorted(unknown)}")
    items: list[FeatureItem] = []
    for modality in ("image", "video"):
        entries = multi_modal_data.get(modality) or []
        if isinstance(entries, (Mapping, FeatureItem)):
            entries = [entries]
        for entry in entries:
            index = len(items)
            if isinstance(entry, FeatureItem):
                items.append(entry)
                continue
            if not isinstance(entry, Mapping):
                raise MultimodalInputError(
                    f"{modality} item {index}: expected a dict, got {type(entry).__name__}"
                )
            grid = next((entry[k] for k in _GRID_KEYS if k in entry), None)
            if "url" in entry:
                items.append(FeatureItem(modality, _as_grid(grid), url=entry["url"], index=index))  # type: ignore[arg-type]
                continue
            embeds = next((entry[k] for k in _EMBEDS_KEYS if k in entry), None)
            if embeds is None:
                raise MultimodalInputError(f"{modality} item {index}: give '{modality}_embeds' or 'url'")
            features = _as_tensor(embeds, f"{modality} item {index}")
            items.append(FeatureItem(modality, _as_grid(grid), features=features, index=index))  # type: ignore[arg-type]
    return items


class MultimodalPromptBuilder:
    """Turns feature parts / ``multi_modal_data`` into a prompt with placed :class:`MMItem` s."""

    def __init__(
        self,
        arch: ModelArchConfig,
        allowed_local_media_path: str | None = None,
        cache: EncoderCacheManager | None = None,
        observe_latency: Callable[[float], None] | None = None,
        max_inline_bytes: int | None = None,
        url_policy: MediaUrlPolicy | None = None,
        limit_per_prompt: Mapping[str, int] | None = None,
    ):
        self.limit_per_prompt = check_limit_per_prompt(limit_per_prompt or {})
        """Most items of a modality one prompt may carry (``--limit-mm-per-prompt``; absent: no bound)."""
        self.arch = arch
        self.allowed_local_media_path = allowed_local_media_path
        self.url_policy = url_policy if url_policy is not None else MediaUrlPolicy()
        """Which http(s):// feature URLs may be fetched (from ``--allowed-media-domains`` and
        ``--allow-private-media-urls``)."""
        self.cache = cache
        """Fetch cache: a URL or content seen before is not downloaded or kept twice."""
        self.observe_latency = observe_latency
        self.max_inline_bytes = max_inline_bytes

    def check_supported(self) -> None:
        """MultimodalInputError unless the model takes image / video features."""
        if self.arch.mm is None:
            raise MultimodalInputError(
                f"this model ({self.arch.architecture}) does not accept image or video inputs"
            )

    def split_chat(
        self, conversation: Sequence[Mapping[str, Any]], tokenizer: Any
    ) -> tuple[list[dict[str, Any]], list[FeatureItem]]:
        """Messages with string contents (feature parts → vision placeholder text) and the items, in order.

        Text parts of a list content are joined with newlines, as for text-only
        requests; a placeholder joins its neighbours directly.
        """
        out: list[dict[str, Any]] = []
        items: list[FeatureItem] = []
        for m, message in enumerate(conversation):
            content = message.get("content")
            if not isinstance(content, list):
                out.append(dict(message))
                continue
            pieces: list[str] = []
            last_was_text = False
            for j, part in enumerate(content):
                if is_feature_part(part):
                    self.check_supported()
                    assert self.arch.mm is not None
                    location = f"messages[{m}].content[{j}]"
                    item = item_from_content_part(part, len(items), self.max_inline_bytes, location)
                    items.append(item)
                    pieces.append(placeholder_text(item.modality, tokenizer, self.arch.mm))
                    last_was_text = False
                else:
                    text = part.get("text", "") if isinstance(part, Mapping) else str(part)
                    pieces.append(("\n" if last_was_text else "") + text)
                    last_was_text = True
            out.append({**message, "content": "".join(pieces)})
        return out, items

    def place(
        self, token_ids: Sequence[int], items: Sequence[FeatureItem], cancel: threading.Event | None = None
    ) -> tuple[list[int], list[MMItem]]:
        """Fetch and check ``items``, then give each placeholder one token per feature row (blocking;
        setting ``cancel`` stops the downloads)."""
        if not items:
            return list(token_ids), []
        self.check_supported()
        counts = Counter(item.modality for item in items)
        for modality, count in counts.items():
            limit = self.limit_per_prompt.get(modality)
            if limit is not None and count > limit:
                raise MultimodalInputError(
                    f"At most {limit} {modality}(s) may be provided in one prompt, got {count} "
                    "(the server's --limit-mm-per-prompt)"
                )
        mm = self.arch.mm
        assert mm is not None
        fetched = fetch_features(
            items,
            hidden_size=self.arch.hidden_size,
            spatial_merge_size=mm.spatial_merge_size,
            allowed_local_media_path=self.allowed_local_media_path,
            url_policy=self.url_policy,
            cache=self.cache,
            observe_latency=self.observe_latency,
            cancel=cancel,
        )
        return expand_placeholders(token_ids, fetched, mm)


MODALITIES = ("image", "video")
"""The modalities a prompt's items may have (``--limit-mm-per-prompt``'s keys)."""


def check_limit_per_prompt(limits: Mapping[str, Any]) -> dict[str, int]:
    """``limits`` checked (known modalities, counts of at least 0); ValueError naming the bad entry."""
    for modality, limit in limits.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt: unknown modality {modality!r} (known: {', '.join(MODALITIES)})"
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt: {modality} must be a count of at least 0, got {limit!r}")
    return dict(limits)
