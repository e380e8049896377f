"""Quantization methods by name, and the one config a model is built with.

``QUANTIZATION_METHODS`` maps a name (``--quantization NAME``, a checkpoint's
``quantization_config.quant_method``) to its :class:`QuantizationConfig` class; a new method
is one class and one entry here. :func:`resolve_quant_config` decides, once per model, which
config (if any) its layers get.
"""

from __future__ import annotations

from typing import Any

import torch

from fastdeploy.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from fastdeploy.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, PtpcFp8Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    Fp8Config.name: Fp8Config,
    PtpcFp8Config.name: PtpcFp8Config,
}


def resolve_quant_config(
    quantization: str | None, hf_config: dict[str, Any], load_format: str = "auto"
) -> QuantizationConfig | None:
    """The quantization of a model: its checkpoint's ``quantization_config`` if it has one, else
    the ``--quantization`` method applied at load time, else None (unquantized).

    ValueError for an unknown method, or a flag that contradicts the checkpoint. Dummy weights
    for a quantized checkpoint are drawn unquantized and quantized at load (same layout).
    """
    checkpoint = hf_config.get("quantization_config")
    if checkpoint:
        method = checkpoint.get("quant_method")
        if method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"the checkpoint's quantization_config.quant_method {method!r} is not supported; "
                f"supported: {', '.join(QUANTIZATION_METHODS)}"
            )
        if quantization is not None and quantization != method:
            raise ValueError(
                f"--quantization {quantization} contradicts the checkpoint's quant_method {method!r}"
            )
        config = QUANTIZATION_METHODS[method].from_checkpoint(checkpoint)
        return config.online() if load_format == "dummy" else config
    if quantization is None:
        return None
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}"
        )
    return QUANTIZATION_METHODS[quantization].from_flag()


def check_quantization_supported(config: QuantizationConfig | None, device: torch.device) -> None:
    """RuntimeError naming the flag when ``device`` is a GPU too old for the method (CPUs run every
    method through its torch path)."""
    if config is None or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < config.min_capability:
        need = ".".join(map(str, config.min_capability))
        raise RuntimeError(
            f"--quantization {config.name} needs a GPU of compute capability {need} or newer; "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
        )


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Call ``process_weights_after_loading()`` on every module that defines it, once all weights
    are loaded (quantized layers turn their loaded weights into their serving form)."""
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            hook()


__all__ = [
    "QUANTIZATION_METHODS",
    "Fp8Config",
    "Fp8LinearMethod",
    "LinearMethod",
    "PtpcFp8Config",
    "QuantizationConfig",
    "check_quantization_supported",
    "process_weights_after_loading",
    "resolve_quant_config",
]
