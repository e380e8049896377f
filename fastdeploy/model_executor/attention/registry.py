"""Which attention backends exist, when each can run, and which one a model gets.

A backend is registered once, at the bottom of this file, with the module that defines
it (imported only when it is considered, so ``triton`` or ``flashinfer`` need not be
installed) and its priority per device type. ``--attention-backend NAME`` takes that
backend when it can serve the model here and otherwise fails with the reason;
``auto`` takes the available backend of highest priority for the device (a backend with
no priority for a device can still be named there, e.g. ``triton`` on a CPU under
``TRITON_INTERPRET=1``).

A backend can serve a model when its class imports, the device type is in its
``devices``, it has the capabilities the model needs (``supports_fp8_kv_cache``,
``supports_mm_bidirectional``) and its own :meth:`AttentionBackend.unavailable_reason`
finds nothing (dtype, head size, a missing package).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from fastdeploy.model_executor.attention.backend import AttentionBackend, AttentionSpec, PrefillDecodeBackend


class AttentionBackendUnavailable(ValueError):
    """The named (or, under ``auto``, every) attention backend cannot serve this model here."""


@dataclass(frozen=True)
class AttentionBackendEntry:
    """One registered backend: where its class lives and how much ``auto`` prefers it per device."""

    name: str
    target: str | type[AttentionBackend]
    """``"package.module:ClassName"`` (imported on first use) or the class itself."""
    priority: Mapping[str, int]
    """Device type → rank under ``auto`` (highest first); a device missing here is never ``auto``'s pick."""

    def load(self) -> type[AttentionBackend]:
        """The backend class (ImportError when its module or a package it needs is missing)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


ATTENTION_BACKENDS: dict[str, AttentionBackendEntry] = {}
"""Every registered backend by name, in registration order."""


def register_attention_backend(
    name: str, target: str | type[AttentionBackend], priority: Mapping[str, int]
) -> AttentionBackendEntry:
    """Make ``name`` selectable by ``--attention-backend`` (and by ``auto`` on ``priority``'s devices)."""
    if name == "auto" or name in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is already registered")
    entry = AttentionBackendEntry(name, target, dict(priority))
    ATTENTION_BACKENDS[name] = entry
    return entry


def unavailable_reason(name: str, spec: AttentionSpec) -> str | None:
    """Why the registered backend ``name`` cannot serve ``spec``, or None when it can."""
    try:
        cls = ATTENTION_BACKENDS[name].load()
    except ImportError as exc:
        return f"it cannot be imported: {exc}"
    if spec.device.type not in cls.devices:
        return f"it runs on {' or '.join(d.upper() for d in cls.devices)} devices only"
    if spec.needs_mask_offsets and not cls.supports_mm_bidirectional:
        return "it has no attention-mask offsets (--mm-bidirectional-attention)"
    if spec.kv_cache_dtype != "auto" and not cls.supports_fp8_kv_cache:
        supporters = " or ".join(_names_with_fp8_kv_cache())
        if not supporters:
            return f"kv_cache_dtype {spec.kv_cache_dtype} is read by no registered attention backend"
        return f"kv_cache_dtype {spec.kv_cache_dtype} needs the {supporters} attention backend"
    return cls.unavailable_reason(spec)


def choose_attention_backend(choice: str, spec: AttentionSpec) -> AttentionBackend:
    """The backend for ``--attention-backend choice`` (``auto`` or a registered name) and ``spec``.

    A named backend that cannot serve the model raises :class:`AttentionBackendUnavailable`
    with the reason; ``auto`` takes the highest-priority available backend for the device
    and raises, with every candidate's reason, only when none is available.
    """
    if choice != "auto":
        if choice not in ATTENTION_BACKENDS:
            known = ", ".join(["auto", *ATTENTION_BACKENDS])
            raise AttentionBackendUnavailable(f"unknown attention backend {choice!r}; available: {known}")
        reason = unavailable_reason(choice, spec)
        if reason is not None:
            raise AttentionBackendUnavailable(f"--attention-backend {choice} is not available: {reason}")
        return create_attention_backend(choice, spec)
    device = spec.device.type
    candidates = sorted(
        (e for e in ATTENTION_BACKENDS.values() if device in e.priority), key=lambda e: -e.priority[device]
    )
    reasons = []
    for entry in candidates:
        reason = unavailable_reason(entry.name, spec)
        if reason is None:
            return create_attention_backend(entry.name, spec)
        reasons.append(f"{entry.name}: {reason}")
    raise AttentionBackendUnavailable(
        f"no attention backend can serve this model on {device}: " + ("; ".join(reasons) or "none registered")
    )


def create_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend:
    """An instance of the registered backend ``name`` (assumed available), paired with its
    declared ``decode_backend`` when that one is available too and the pairing's batch limit
    is positive."""
    cls = ATTENTION_BACKENDS[name].load()
    backend = cls.from_spec(spec)
    decode_name, decode_max_batch = cls.decode_backend, cls.decode_backend_max_batch()
    if decode_name is None or decode_max_batch <= 0 or unavailable_reason(decode_name, spec) is not None:
        return backend
    return PrefillDecodeBackend(backend, create_attention_backend(decode_name, spec), decode_max_batch)


def _names_with_fp8_kv_cache() -> list[str]:
    names = []
    for entry in ATTENTION_BACKENDS.values():
        try:
            if entry.load().supports_fp8_kv_cache:
                names.append(entry.name)
        except ImportError:
            continue
    return names


# ---- the registered backends: adding one is one registration here ---------------------------

_PACKAGE = "fastdeploy.model_executor.attention"
register_attention_backend(
    "torch", f"{_PACKAGE}.torch_backend:TorchAttentionBackend", priority={"cpu": 10, "cuda": 0}
)
register_attention_backend(
    "triton", f"{_PACKAGE}.triton_backend:TritonAttentionBackend", priority={"cuda": 20}
)
register_attention_backend(
    "flashinfer", f"{_PACKAGE}.flashinfer_backend:FlashInferAttentionBackend", priority={"cuda": 30}
)
