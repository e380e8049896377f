"""How an embedding model pools: the pooling runner's settings, from the model folder and flags.

Read from a sentence-transformers folder (``modules.json`` naming a ``Pooling`` module, whose
``config.json`` gives the pooling mode, and an optional ``Normalize`` module), overridden by
``--pooler-config``; Matryoshka support (``dimensions``) from ``config.json``'s ``is_matryoshka`` /
``matryoshka_dimensions``, as vLLM reads them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import ModelConfig
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.transformers_utils.config import ModelArchConfig

_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
"""sentence-transformers' Pooling flags → our name (only ``last`` and ``mean`` are implemented)."""


class PoolerConfigError(ValueError):
    """The model's or the flags' pooling settings name something not implemented."""


@dataclass
class PoolerConfig:
    """The pooling runner's settings for the served model."""

    pooling_type: str = "last"
    """``last`` or ``mean``."""
    normalize: bool = True
    """L2-normalise every vector."""
    is_matryoshka: bool = False
    """The model was trained so that any prefix of its vector is an embedding (``dimensions`` allowed)."""
    matryoshka_dimensions: list[int] | None = None
    """The prefix lengths the model allows (None: any, when ``is_matryoshka``)."""

    def params(self) -> PoolingParams:
        """The pooling parameters every embedding request of this model carries."""
        return PoolingParams(pooling_type=self.pooling_type, normalize=self.normalize)  # type: ignore[arg-type]

    def dimensions_error(self, dimensions: int, hidden_size: int) -> str | None:
        """Why ``dimensions`` cannot be served (None: it can)."""
        if not self.is_matryoshka:
            return "this model does not support matryoshka representation (dimensions)"
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            return f"this model supports dimensions {sorted(allowed)}, not {dimensions}"
        if not 1 <= dimensions <= hidden_size:
            return f"dimensions must be from 1 to the model's {hidden_size}"
        return None


def read_sentence_transformers(folder: str) -> tuple[str, bool] | None:
    """(pooling mode, normalize) of a sentence-transformers folder, or None when it is not one."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    if not isinstance(modules, list):
        return None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling = types.get("Pooling")
    if pooling is None:
        return None
    mode = "mean"  # sentence-transformers' default
    config_path = os.path.join(folder, pooling.get("path") or "", "config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            flags = json.load(f)
        modes = [name for key, name in _ST_MODES.items() if flags.get(key)]
        if len(modes) != 1:
            raise PoolerConfigError(
                f"{config_path} asks for pooling modes {modes or 'none'}; one of last or mean is supported"
            )
        mode = modes[0]
    return mode, "Normalize" in types


def resolve_pooler(model: ModelConfig, folder: str, arch: ModelArchConfig) -> PoolerConfig | None:
    """The pooling runner's settings, or None when the model is served for generation (``--runner``)."""
    from_folder = read_sentence_transformers(folder) if os.path.isdir(folder) else None
    runner = model.runner
    if runner == "auto":
        runner = "pooling" if arch.headless or from_folder is not None else "generate"
    if runner == "generate":
        if model.pooler_config:
            raise PoolerConfigError("pooler_config applies to --runner pooling only")
        return None
    pooling_type, normalize = from_folder or ("last", True)
    overrides: dict[str, Any] = dict(model.pooler_config)
    unknown = set(overrides) - {"pooling_type", "normalize"}
    if unknown:
        raise PoolerConfigError(
            f"unknown pooler_config keys {sorted(unknown)}; known: pooling_type, normalize"
        )
    if "pooling_type" in overrides:
        pooling_type = str(overrides["pooling_type"]).lower()
    if "normalize" in overrides:
        if not isinstance(overrides["normalize"], bool):
            raise PoolerConfigError("pooler_config normalize must be true or false")
        normalize = overrides["normalize"]
    if pooling_type not in ("last", "mean"):
        raise PoolerConfigError(f"pooling type {pooling_type!r} is not implemented; use LAST or MEAN")
    dims = arch.raw.get("matryoshka_dimensions")
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        is_matryoshka=bool(arch.raw.get("is_matryoshka")) or bool(dims),
        matryoshka_dimensions=[int(d) for d in dims] if dims else None,
    )
