"""Per-device hooks (``device.py``) and the tensor backend (``backend.py``: torch or Paddle).

This package's ``__init__`` imports no torch: ``fastdeploy/__init__.py`` imports
``platforms.backend`` to switch to Paddle before any engine module imports torch. The
device hooks are loaded on first use (``from fastdeploy.platforms import resolve_device``).
"""

from __future__ import annotations

from typing import Any

_DEVICE_HOOKS = ("resolve_device", "configure_threads", "get_attention_backend", "kv_cache_budget_bytes")


def __getattr__(name: str) -> Any:
    if name in _DEVICE_HOOKS:
        from fastdeploy.platforms import device

        return getattr(device, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
