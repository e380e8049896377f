"""Turn the bytes of a feature file into a tensor, without ever unpickling.

Two formats are accepted, recognised by their content (the file name does not
matter, so a URL without an extension works):

- ``.npy`` (NumPy's format, magic ``\\x93NUMPY``), read with ``allow_pickle=False``:
  object arrays, which would need pickle, are refused.
- ``.safetensors``: a file holding one tensor, or several of which the one named
  ``features`` is taken.

``torch.save`` files (zip or raw pickle) are refused with a message saying why:
loading them would run pickle on data a client controls.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct

import numpy as np
import torch

from fastdeploy.multimodal.inputs import MultimodalInputError

NPY_MAGIC = b"\x93NUMPY"
SAFETENSORS_KEY = "features"
"""Tensor taken from a ``.safetensors`` file that holds more than one."""
_PICKLE_PROTOCOL_2_PLUS = b"\x80"
_ZIP_MAGIC = b"PK\x03\x04"


def detect_format(data: bytes) -> str:
    """``"npy"``, ``"safetensors"``, or a :class:`MultimodalInputError` for anything else."""
    if data.startswith(NPY_MAGIC):
        return "npy"
    if len(data) >= 10:
        (header_len,) = struct.unpack("<Q", data[:8])
        if 2 <= header_len <= len(data) - 8 and data[8:9] == b"{":
            return "safetensors"
    if data.startswith(_ZIP_MAGIC) or data.startswith(_PICKLE_PROTOCOL_2_PLUS):
        raise MultimodalInputError(
            "torch.save / pickle files are not accepted (loading them could run arbitrary code); "
            "save the features with numpy.save (.npy) or safetensors instead"
        )
    raise MultimodalInputError("unrecognised feature file: expected a .npy or .safetensors file")


_NPY_FLOAT_SIZES = (2, 4, 8)
"""Item sizes of the .npy float dtypes accepted (float16 / 32 / 64; not longdouble)."""


def _check_npy_header(data: bytes) -> None:
    """Refuse what ``np.load`` must not see: a non-float or object dtype, or a shape whose data the
    file does not hold (numpy allocates the declared size before reading: a 200-byte file can ask
    for terabytes)."""
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        read = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, _, dtype = read(stream)
    except Exception as exc:  # a malformed header: numpy raises ValueError, SyntaxError, ...
        raise MultimodalInputError(f"unreadable .npy feature file header: {exc}") from None
    if dtype.kind != "f" or dtype.itemsize not in _NPY_FLOAT_SIZES:
        raise MultimodalInputError(f".npy features must be float16, float32 or float64, got dtype {dtype}")
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if declared > len(data) - stream.tell():
        raise MultimodalInputError(
            f"truncated .npy feature file: its header declares {declared} bytes of data, "
            f"it holds {len(data) - stream.tell()}"
        )


def _load_npy(data: bytes) -> torch.Tensor:
    _check_npy_header(data)
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:  # object arrays: "Object arrays cannot be loaded when allow_pickle=False"
        raise MultimodalInputError(f"unreadable .npy feature file: {exc}") from None
    except (OSError, EOFError) as exc:
        raise MultimodalInputError(f"truncated or corrupt .npy feature file: {exc}") from None
    if not array.dtype.isnative:  # big-endian floats: the same values in the machine's order
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _load_safetensors(data: bytes) -> torch.Tensor:
    from safetensors.torch import load

    try:
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError for bad headers
        raise MultimodalInputError(f"unreadable .safetensors feature file: {exc}") from None
    if len(tensors) == 1:
        return next(iter(tensors.values()))
    if SAFETENSORS_KEY in tensors:
        return tensors[SAFETENSORS_KEY]
    raise MultimodalInputError(
        f".safetensors feature file holds {len(tensors)} tensors {sorted(tensors)[:8]}; "
        f"store one tensor, or name the features {SAFETENSORS_KEY!r}"
    )


def load_feature_bytes(data: bytes) -> torch.Tensor:
    """The tensor stored in ``data`` (.npy or .safetensors bytes); never unpickles. Whatever is
    wrong with the bytes (a client's file) is a :class:`MultimodalInputError`."""
    fmt = detect_format(data)
    try:
        return _load_npy(data) if fmt == "npy" else _load_safetensors(data)
    except MultimodalInputError:
        raise
    except Exception as exc:  # (MemoryError, TypeError, ...): the file's fault, not the server's
        raise MultimodalInputError(f"unreadable .{fmt} feature file: {type(exc).__name__}: {exc}") from None


def decode_image_embeds(payload: str, max_bytes: int | None = None) -> torch.Tensor:
    """Decode the payload of an ``image_embeds`` content part: base64 of .npy or .safetensors bytes.

    vLLM accepts base64 of a ``torch.save`` file there; that format needs
    pickle and is refused with a clear message. ``max_bytes`` caps the decoded size.
    """
    if not isinstance(payload, str):
        raise MultimodalInputError(f"image_embeds must be a base64 string, got {type(payload).__name__}")
    if payload.startswith("data:"):
        payload = payload.partition(",")[2]  # a data URL: keep what follows "base64,"
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
        raise MultimodalInputError(f"image_embeds payload exceeds the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MultimodalInputError(f"image_embeds is not valid base64: {exc}") from None
    return load_feature_bytes(data)


def encode_features(features: torch.Tensor, fmt: str = "safetensors") -> bytes:
    """Bytes of ``features`` in ``fmt`` (``"npy"`` or ``"safetensors"``), the inverse of
    :func:`load_feature_bytes`; for clients and tests that produce feature files."""
    if fmt == "npy":
        buffer = io.BytesIO()
        np.save(buffer, features.detach().cpu().numpy(), allow_pickle=False)
        return buffer.getvalue()
    if fmt == "safetensors":
        from safetensors.torch import save

        return save({SAFETENSORS_KEY: features.detach().cpu().contiguous()})
    raise ValueError(f"unknown feature format {fmt!r}")
