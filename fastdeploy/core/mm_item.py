"""A multimodal item placed in a prompt, and how it travels between processes.

An :class:`MMItem` is an image or video whose placeholder tokens are laid out in
the prompt (by :func:`fastdeploy.multimodal.items.expand_placeholders`): one
placeholder token per feature row, at ``offset .. offset + length``. Items cross
process borders (front end → engine core → worker) as msgpack-friendly dicts: the
features as dtype, shape and raw bytes, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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
