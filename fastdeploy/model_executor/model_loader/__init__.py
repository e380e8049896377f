"""Find a model, read its architecture, build it and fill in its weights.

Three sources: a Hugging Face folder (config.json + safetensors), a GGUF file,
and ``load_format="dummy"`` (random weights from a config, seeded). With no
model given, the embedded default model is used.
"""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass

import torch

from fastdeploy.config import ModelConfig
from fastdeploy.distributed import tp_size
from fastdeploy.model_executor.layers.quantization import (
    QuantizationConfig,
    check_quantization_supported,
    process_weights_after_loading,
    resolve_quant_config,
)
from fastdeploy.model_executor.layers.weight_loading import checkpoint_shapes, weight_loader
from fastdeploy.model_executor.model_loader.default_model import default_model_path
from fastdeploy.model_executor.model_loader.gguf_loader import gguf_config_dict, iterate_gguf_weights
from fastdeploy.model_executor.model_loader.safetensors_loader import iterate_safetensors
from fastdeploy.model_executor.models import MODEL_REGISTRY
from fastdeploy.transformers_utils.config import (
    ModelArchConfig,
    flatten_text_config,
    read_config_json,
    read_generation_eos,
)
from fastdeploy.transformers_utils.pooling import PoolerConfig, resolve_pooler

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a model's files are and what architecture they describe."""

    path: str
    """The .gguf file or the model folder."""
    is_gguf: bool
    arch: ModelArchConfig
    pooler: PoolerConfig | None = None
    """Set when the model is served by the pooling runner (embeddings; ``--runner``), else None."""

    @property
    def folder(self) -> str:
        return os.path.dirname(self.path) if self.is_gguf else self.path

    @property
    def display_name(self) -> str:
        return os.path.basename(self.path.rstrip("/"))


def resolve_model(config: ModelConfig) -> ModelSource:
    """Locate the model files and parse the architecture (no weights read yet)."""
    if config.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"unknown load_format {config.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}"
        )
    path = config.model or default_model_path()
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    is_gguf = path.endswith(".gguf")
    if is_gguf:
        cfg = gguf_config_dict(path)
    else:
        cfg = read_config_json(path)
    cfg = {**flatten_text_config(cfg), **config.hf_config_overrides}  # overrides reach nested text configs
    arch = ModelArchConfig.from_dict(cfg)
    if not is_gguf:
        arch.eos_token_ids = sorted(set(arch.eos_token_ids) | set(read_generation_eos(path)))
    folder = os.path.dirname(path) if is_gguf else path
    return ModelSource(path=path, is_gguf=is_gguf, arch=arch, pooler=resolve_pooler(config, folder, arch))


def resolve_dtype(dtype: str, arch: ModelArchConfig, device: torch.device) -> torch.dtype:
    """The torch dtype for ``--dtype``; ``auto`` follows the checkpoint (float16 → bfloat16 on a CPU, float32 → bfloat16 on a GPU)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(str(arch.torch_dtype).replace("torch.", ""), torch.bfloat16)
    if chosen == torch.float16 and device.type == "cpu":
        chosen = torch.bfloat16
    if chosen == torch.float32 and device.type == "cuda":  # float32 checkpoints serve in bfloat16
        chosen = torch.bfloat16
    return chosen


def load_model(
    config: ModelConfig, source: ModelSource, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """Build the model on ``device`` in ``dtype`` and load (or randomly draw) its weights; then
    every module's ``process_weights_after_loading()`` runs (quantized layers quantize there).

    The quantization is the checkpoint's or ``config.quantization``'s (:func:`quant_config_of`);
    RuntimeError naming the flag on a GPU too old for it.
    """
    model_cls = MODEL_REGISTRY[source.arch.architecture]
    load_format = config.load_format
    if load_format == "auto":
        load_format = "gguf" if source.is_gguf else "safetensors"
    quant_config = quant_config_of(config, source)
    check_quantization_supported(quant_config, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(source.arch, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model, config.seed)
        elif load_format == "gguf":
            if not source.is_gguf:
                raise ValueError(f"load_format gguf needs a .gguf file, got {source.path!r}")
            model.load_weights(_progress(iterate_gguf_weights(source.path, source.arch.raw), source))
        else:
            if source.is_gguf:
                raise ValueError("load_format safetensors cannot read a .gguf file")
            weights = iterate_safetensors(source.path)
            if source.arch.headless:
                weights = _under_model_prefix(weights)
            model.load_weights(_progress(weights, source))
        process_weights_after_loading(model)
    return model.eval()


def quant_config_of(config: ModelConfig, source: ModelSource) -> QuantizationConfig | None:
    """The model's quantization: its checkpoint's ``quantization_config``, else ``--quantization``."""
    return resolve_quant_config(config.quantization, source.arch.raw, config.load_format)


def _under_model_prefix(weights):
    """A bare decoder's tensors (``layers.0...``, ``norm.weight``) under the causal-LM names (``model.``)."""
    for name, tensor in weights:
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


def _progress(weights, source: ModelSource):
    """Show a progress bar (stderr) while checkpoint tensors are read and copied."""
    from tqdm import tqdm

    return tqdm(weights, desc=f"Loading {source.display_name}", unit=" tensors", leave=False, mininterval=0.5)


_DUMMY_CHUNK = 1 << 26
"""Most values drawn at once by :func:`initialize_dummy_weights` (256 MiB of float32)."""


def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights: norms near 1, matrices and embeddings ~ U(-0.05, 0.05).

    Each checkpoint tensor a parameter is made of (one, or q/k/v and gate/up of a fused
    parameter) is drawn in full by a generator of the parameter's device seeded from
    ``seed`` and the tensor's name, and goes through the parameter's weight loader like a
    real checkpoint tensor: every tensor-parallel size gets the same model (each rank its
    shards), and every rank the same replicated parameters. Values are drawn in float32 in
    row chunks of at most ``_DUMMY_CHUNK`` values and cast; a tensor that is the whole
    parameter is drawn in place, others pass through one temporary of the parameter's dtype
    (nothing through host memory on a GPU). One seed gives the same weights in every dtype
    on one device type; a CPU and a GPU draw different values.
    """
    single_rank = tp_size() == 1
    for name, param in model.named_parameters():
        is_norm = name.endswith("norm.weight")
        for shard, shape in checkpoint_shapes(param).items():
            generator = torch.Generator(device=param.device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}:{shard}".encode())) % 2**63)
            whole = shard is None and shape == tuple(param.shape)
            if whole and (single_rank or not hasattr(param, "weight_loader")):
                _fill_dummy(param.data, generator, is_norm)
            else:
                full = torch.empty(shape, dtype=param.dtype, device=param.device)
                _fill_dummy(full, generator, is_norm)
                weight_loader(param)(param, full, shard)


def _fill_dummy(out: torch.Tensor, generator: torch.Generator, is_norm: bool) -> None:
    """Fill ``out`` row chunk by row chunk (see :func:`initialize_dummy_weights`)."""
    data = out.view(out.shape[0], -1) if out.dim() > 0 else out.view(1, 1)
    rows = max(1, _DUMMY_CHUNK // max(1, data.shape[1]))
    for start in range(0, data.shape[0], rows):
        chunk = data[start : start + rows]
        values = torch.rand(chunk.shape, generator=generator, device=out.device, dtype=torch.float32)
        values.sub_(0.5).mul_(0.1)
        if is_norm:
            values.add_(1.0)
        chunk.copy_(values)


def load_tokenizer(config: ModelConfig, source: ModelSource):
    """The model's tokenizer; None with ``skip_tokenizer_init`` or for a model folder that has none."""
    if config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

    remote = {"trust_remote_code": True} if config.trust_remote_code else {}
    if config.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, **remote)
    elif source.is_gguf:
        tokenizer = load_gguf_tokenizer(source.path)
    elif any(
        os.path.isfile(os.path.join(source.folder, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        tokenizer = AutoTokenizer.from_pretrained(source.folder, **remote)
    else:
        return None
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    return tokenizer


def load_generation_defaults(config: ModelConfig, source: ModelSource) -> dict[str, float | int]:
    """The sampling defaults of requests that leave them unset (``--generation-config``; a GGUF file
    has no generation_config.json to read under ``auto``), logged once when there are any."""
    from fastdeploy.transformers_utils.config import read_generation_defaults

    setting = config.generation_config
    if setting == "auto" and source.is_gguf:
        return {}
    defaults = read_generation_defaults(setting, source.folder)
    if defaults:
        logger.info(
            "default sampling parameters from %s/generation_config.json: %s (--generation-config none "
            "for the OpenAI defaults)",
            source.folder if setting == "auto" else setting,
            defaults,
        )
    return defaults


def read_chat_template(value: str) -> str:
    """``--chat-template``: the file at ``value`` if it is one, else ``value`` itself when it looks
    like a Jinja template; a ``ValueError`` saying which otherwise (a mistyped path)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
