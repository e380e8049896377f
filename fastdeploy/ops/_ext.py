"""Loading the compiled CUDA extension ``fastdeploy_ops`` (built by setup_ops.py), once.

The extension is looked for as an importable module (``setup_ops.py install``)
and then as ``fastdeploy_ops*.so`` in the repository root
(``setup_ops.py build_ext --inplace``). Importing it registers the ops under
``torch.ops.fastdeploy_ops``. It is never tried on a torch without CUDA (the
shared object links against libtorch_cuda), and ``FD_DISABLE_CUSTOM_OPS=1``
hides it, so every caller then takes its torch fallback.
"""

from __future__ import annotations

import functools
import importlib
import logging
from pathlib import Path
from typing import Any

import torch

from fastdeploy import envs

logger = logging.getLogger(__name__)

OPS_NAMESPACE = "fastdeploy_ops"
REQUIRED_OPS = ("reshape_and_cache_flash", "set_stop", "get_stop")


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _ops_registered() -> bool:
    namespace = getattr(torch.ops, OPS_NAMESPACE)
    try:
        return all(getattr(namespace, name, None) is not None for name in REQUIRED_OPS)
    except RuntimeError:  # torch raises when the namespace has no such op
        return False


@functools.cache
def _load() -> bool:
    """Import or load the extension; True when all of REQUIRED_OPS are registered."""
    if torch.version.cuda is None:
        return False
    try:
        importlib.import_module(OPS_NAMESPACE)
    except ModuleNotFoundError as exc:
        if exc.name != OPS_NAMESPACE:
            logger.warning("cannot import fastdeploy_ops, using the torch fallbacks: %s", exc)
            return False
        built = sorted(_repo_root().glob(f"{OPS_NAMESPACE}*.so"))
        if not built:
            logger.debug("fastdeploy_ops is not built; using the torch fallbacks")
            return False
        try:
            torch.ops.load_library(str(built[0]))
        except OSError as exc:  # built against another torch/CUDA, missing libraries
            logger.warning("cannot load %s, using the torch fallbacks: %s", built[0], exc)
            return False
    except ImportError as exc:  # found, but built against another torch/CUDA
        logger.warning("cannot import fastdeploy_ops, using the torch fallbacks: %s", exc)
        return False
    if not _ops_registered():
        logger.warning(
            "fastdeploy_ops is loaded but lacks some of %s; using the torch fallbacks", REQUIRED_OPS
        )
        return False
    return True


def has_cuda_ops() -> bool:
    """Whether the compiled CUDA ops are available and allowed (``FD_DISABLE_CUSTOM_OPS`` unset).

    The load is attempted once per process; the environment switch is read on
    every call so that tests can flip it.
    """
    return not envs.FD_DISABLE_CUSTOM_OPS and _load()


def cuda_op(name: str) -> Any:
    """The ``torch.ops.fastdeploy_ops.<name>`` overload packet; call only after has_cuda_ops()."""
    return getattr(getattr(torch.ops, OPS_NAMESPACE), name)
