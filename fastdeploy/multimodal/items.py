"""Laying out multimodal items in a prompt: placeholder runs, their expansion, their text.

A fetched :class:`~fastdeploy.multimodal.inputs.FeatureItem` becomes an
:class:`~fastdeploy.core.mm_item.MMItem` once its placeholder tokens are laid out in the
prompt by :func:`expand_placeholders`: one placeholder token per feature row, at
``offset .. offset + length``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastdeploy.core.mm_item import MMItem
from fastdeploy.multimodal.inputs import FeatureItem, MultimodalInputError
from fastdeploy.transformers_utils.config import MultimodalArchConfig


def placeholder_runs(token_ids: Sequence[int], mm: MultimodalArchConfig) -> list[tuple[int, int, str]]:
    """``(start, length, modality)`` of every maximal run of image / video placeholder tokens."""
    modality_of = {mm.image_token_id: "image", mm.video_token_id: "video"}
    runs: list[tuple[int, int, str]] = []
    i, n = 0, len(token_ids)
    while i < n:
        modality = modality_of.get(token_ids[i])
        if modality is None:
            i += 1
            continue
        start = i
        while i < n and token_ids[i] == token_ids[start]:
            i += 1
        runs.append((start, i - start, modality))
    return runs


def expand_placeholders(
    token_ids: Sequence[int], items: Sequence[FeatureItem], mm: MultimodalArchConfig
) -> tuple[list[int], list[MMItem]]:
    """Give each item as many placeholder tokens as it has feature rows; return the new prompt and items.

    Each maximal run of ``image_token_id`` (``video_token_id``) tokens is one
    image (video) placeholder; the k-th image run belongs to the k-th image item
    of ``items`` (videos likewise). A run of one token is expanded to the item's
    row count; a run that already has that many tokens is kept. ``items`` must be
    fetched (features and ``mm_hash`` set). A mismatch is a :class:`MultimodalInputError`.
    """
    queues: dict[str, list[FeatureItem]] = {"image": [], "video": []}
    for item in items:
        if item.features is None or item.mm_hash is None:
            raise ValueError(f"{item.label}: fetch the item before placing it in the prompt")
        queues[item.modality].append(item)
    runs = placeholder_runs(token_ids, mm)
    for modality, queue in queues.items():
        found = sum(1 for _, _, m in runs if m == modality)
        if found != len(queue):
            token = mm.image_token_id if modality == "image" else mm.video_token_id
            raise MultimodalInputError(
                f"the prompt has {found} {modality} placeholder(s) (token {token}) but {len(queue)} "
                f"{modality} item(s) were given"
            )
    out: list[int] = []
    placed: list[MMItem] = []
    cursor = 0
    positions = {"image": 0, "video": 0}
    for start, length, modality in runs:
        item = queues[modality][positions[modality]]
        positions[modality] += 1
        assert item.features is not None and item.mm_hash is not None
        rows = int(item.features.shape[0])
        if length not in (1, rows):
            raise MultimodalInputError(
                f"{item.label}: its placeholder has {length} tokens; give one token (expanded to the "
                f"item's {rows} feature rows) or exactly {rows}"
            )
        out.extend(token_ids[cursor:start])
        placed.append(MMItem(modality, len(out), rows, item.grid_thw, item.mm_hash, item.features))
        out.extend([token_ids[start]] * rows)
        cursor = start + length
    out.extend(token_ids[cursor:])
    return out, placed


def placeholder_text(modality: str, tokenizer: Any, mm: MultimodalArchConfig) -> str:
    """``<|vision_start|><|image_pad|><|vision_end|>`` (or ``<|video_pad|>``) as this tokenizer spells it.

    This is what the Qwen2-VL chat template renders for an image part; encoded
    without special-token insertion it gives back exactly those three ids.
    """
    pad = mm.image_token_id if modality == "image" else mm.video_token_id
    ids = [mm.vision_start_token_id, pad, mm.vision_end_token_id]
    text = "".join(tokenizer.convert_ids_to_tokens(ids))
    if list(tokenizer.encode(text, add_special_tokens=False)) != ids:
        raise ValueError(
            f"the tokenizer does not encode {text!r} as the model's vision tokens {ids}; "
            "add them to the tokenizer as special tokens"
        )
    return text
