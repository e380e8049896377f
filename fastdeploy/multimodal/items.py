"""Multimodal items placed in a prompt, and how they travel between processes.

A fetched :class:`~fastdeploy.multimodal.inputs.FeatureItem` becomes an
:class:`MMItem` once its placeholder tokens are laid out in the prompt by
:func:`expand_placeholders`: one placeholder token per feature row, at
``offset .. offset + length``. Items cross process borders (front end → engine
core → worker) as msgpack-friendly dicts: the features as dtype, shape and raw
bytes, never pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastdeploy.multimodal.inputs import FeatureItem, MultimodalInputError
from fastdeploy.transformers_utils.config import MultimodalArchConfig

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def tensor_to_wire(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}`` of a float tensor (raw little-endian bytes, no pickle)."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"features of dtype {tensor.dtype} cannot be sent; use one of {sorted(WIRE_DTYPES)}")
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": dtype, "shape": list(tensor.shape), "data": data}


def tensor_from_wire(wire: dict[str, Any]) -> torch.Tensor:
    """The tensor of :func:`tensor_to_wire` (a fresh, writable copy)."""
    dtype = WIRE_DTYPES.get(wire["dtype"])
    if dtype is None:
        raise ValueError(f"unknown feature dtype {wire['dtype']!r}")
    flat = torch.frombuffer(bytearray(wire["data"]), dtype=torch.uint8)
    return flat.view(dtype).reshape(wire["shape"])


@dataclass
class MMItem:
    """One image or video of a prompt: where its placeholder tokens are and what replaces them."""

    modality: str
    """``"image"`` or ``"video"``."""
    offset: int
    """Index of the first placeholder token in the prompt."""
    length: int
    """Placeholder tokens = feature rows."""
    grid_thw: tuple[int, int, int]
    """Patch grid before spatial merging (drives the M-RoPE positions)."""
    mm_hash: str
    """Content hash: encoder cache key and prefix-cache extra key."""
    features: torch.Tensor | None = None
    """``[length, hidden_size]``; None where the receiver already holds them (by ``mm_hash``)."""
    second_per_grid_t: float = 1.0
    """Qwen2.5-VL videos: seconds one temporal patch covers (scales temporal positions)."""

    @property
    def end(self) -> int:
        """One past the last placeholder token."""
        return self.offset + self.length

    def to_wire(self, with_features: bool = True) -> dict[str, Any]:
        """A msgpack-friendly dict; the features only when ``with_features`` (and present)."""
        send = with_features and self.features is not None
        return {
            "modality": self.modality,
            "offset": self.offset,
            "length": self.length,
            "grid_thw": list(self.grid_thw),
            "mm_hash": self.mm_hash,
            "features": tensor_to_wire(self.features) if send else None,
            "second_per_grid_t": self.second_per_grid_t,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> MMItem:
        """Inverse of :meth:`to_wire` (extra keys are ignored)."""
        features = wire.get("features")
        return cls(
            modality=wire["modality"],
            offset=int(wire["offset"]),
            length=int(wire["length"]),
            grid_thw=tuple(int(v) for v in wire["grid_thw"]),  # type: ignore[arg-type]
            mm_hash=wire["mm_hash"],
            features=None if features is None else tensor_from_wire(features),
            second_per_grid_t=float(wire.get("second_per_grid_t", 1.0)),
        )


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
