"""The tensor backend: real torch, or PaddlePaddle through its torch-compat proxy.

The engine is written once against torch. With ``FD_BACKEND=paddle`` (``--backend
paddle``) :func:`activate` calls ``paddle.enable_compat()`` before any engine module
imports torch, so that ``import torch`` resolves to Paddle, and closes the proxy's gaps
(:mod:`fastdeploy.platforms.paddle_shim`). ``fastdeploy/__init__.py`` calls
:func:`activate_from_env`, so every process (API server, engine core, workers) binds
the same backend before its first ``import torch``; :func:`activate` exports the choice
to ``FD_BACKEND`` for the child processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

BACKENDS = ("torch", "paddle")
"""The tensor backends the engine runs on (``auto``: torch when installed, else paddle)."""

_paddle_active = False


class BackendError(RuntimeError):
    """The requested backend cannot be bound in this process (not installed, or torch already imported)."""


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_backend(name: str | None) -> str:
    """``torch`` or ``paddle`` for ``name`` (``auto``/None: torch when installed, else paddle)."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        if _paddle_active:
            return "paddle"
        if "torch" in sys.modules or _installed("torch") or not _installed("paddle"):
            return "torch"
        return "paddle"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    return name


def activate(name: str | None = "auto") -> str:
    """Bind ``import torch`` to backend ``name`` in this process and its children; returns it.

    Paddle must be chosen before anything imports torch. Asking again for the active
    backend is a no-op; asking for the other one once torch is bound raises
    :class:`BackendError`.
    """
    global _paddle_active
    resolved = resolve_backend(name)
    if resolved == "paddle" and not _paddle_active:
        if "torch" in sys.modules:
            raise BackendError(
                "the paddle backend must be chosen before torch is imported: set FD_BACKEND=paddle in "
                "the environment (or call fastdeploy.platforms.backend.activate('paddle') before "
                "importing fastdeploy.LLM)"
            )
        if not _installed("paddle"):
            raise BackendError("the paddle backend needs PaddlePaddle 3.3: pip install -e '.[paddle]'")
        from fastdeploy.platforms import paddle_shim

        paddle_shim.install()
        _paddle_active = True
        os.environ["FD_DISABLE_CUSTOM_OPS"] = "1"  # the compiled ops are torch's: use the tensor fallbacks
    elif resolved == "torch" and _paddle_active:
        raise BackendError("the paddle backend is active in this process; torch cannot be chosen now")
    os.environ["FD_BACKEND"] = resolved  # child processes (engine core, workers) follow
    return resolved


def activate_from_env() -> str | None:
    """At ``import fastdeploy``: bind Paddle when ``FD_BACKEND`` says so, or when it is ``auto``
    and only Paddle is installed; torch needs nothing done."""
    from fastdeploy import envs

    name = envs.FD_BACKEND
    if name == "auto" and resolve_backend(name) == "torch":
        return None
    return activate(name)


def active_backend() -> str:
    """The backend ``import torch`` gives in this process: ``paddle`` once bound, else ``torch``."""
    return "paddle" if _paddle_active else "torch"


def backend_info() -> dict[str, str]:
    """``{"backend": "paddle", "backend_version": "3.3.1"}``: the active backend, for /version."""
    name = active_backend()
    return {"backend": name, "backend_version": str(importlib.import_module(name).__version__)}


def backend_version() -> str:
    """``"torch 2.13.0"`` / ``"paddle 3.3.1"``: the active backend and its version, for the logs."""
    info = backend_info()
    return f"{info['backend']} {info['backend_version']}"
