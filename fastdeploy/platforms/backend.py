"""The tensor backend: real torch, or PaddlePaddle through its torch-compat proxy.

The engine is written once against torch. With ``FD_BACKEND=paddle`` (``--backend
paddle``) :func:`activate` calls ``paddle.enable_compat()`` before any engine module
imports torch, so that ``import torch`` resolves to Paddle, and closes the few gaps of
the proxy (:mod:`fastdeploy.platforms.paddle_shim`). ``fastdeploy/__init__.py`` calls
:func:`activate_from_env`, so every process (API server, engine core, workers) binds
the same backend before its first ``import torch``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

BACKENDS = ("torch", "paddle")
"""The tensor backends the engine runs on (``auto``: torch when installed, else paddle)."""

_active: str | None = None


class BackendError(RuntimeError):
    """The requested backend cannot be bound in this process (not installed, or torch already imported)."""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _resolve(name: str) -> str:
    name = (name or "auto").strip().lower()
    if name == "auto":
        if "torch" in sys.modules or _installed("torch"):
            return "torch"
        return "paddle" if _installed("paddle") else "torch"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    return name


def activate(name: str = "auto") -> str:
    """Bind ``import torch`` to backend ``name`` in this process and its children; returns it.

    Must run before torch is imported. Calling it again with the active backend is a
    no-op; asking for another one once torch is bound raises :class:`BackendError`.
    """
    global _active
    resolved = _resolve(name)
    if _active is not None:
        if resolved != _active:
            raise BackendError(f"backend {_active!r} is already active in this process; cannot switch to {resolved!r}")
        return _active
    if resolved == "paddle":
        torch_module = sys.modules.get("torch")
        if torch_module is not None and not _is_paddle_proxy(torch_module):
            raise BackendError(
                "--backend paddle must be chosen before torch is imported "
                "(set FD_BACKEND=paddle in the environment, or choose it before importing fastdeploy.LLM)"
            )
        if not _installed("paddle"):
            raise BackendError("--backend paddle needs PaddlePaddle 3.x: pip install -e '.[paddle]'")
        from fastdeploy.platforms import paddle_shim

        paddle_shim.install()
    _active = resolved
    os.environ["FD_BACKEND"] = resolved  # child processes (engine core, workers) follow
    return resolved


def activate_from_env() -> str | None:
    """Bind the backend ``FD_BACKEND`` names when it names one explicitly (else leave it to first use)."""
    from fastdeploy import envs

    name = envs.FD_BACKEND
    return activate(name) if name != "auto" else None


def active_backend() -> str:
    """The backend ``import torch`` gives in this process (binding ``auto`` if nothing was chosen yet)."""
    return _active or activate("auto")


def backend_version() -> str:
    """``"torch 2.13.0"`` / ``"paddle 3.3.1"``: the active backend and its version, for /version and the logs."""
    name = active_backend()
    module = importlib.import_module("paddle" if name == "paddle" else "torch")
    return f"{name} {module.__version__}"


def _is_paddle_proxy(module: object) -> bool:
    return type(module).__name__ == "ProxyModule" or getattr(module, "__name__", "") == "paddle"
