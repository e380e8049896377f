"""Sizes and engine options of one ``gpu_benchmark.py`` run: the full GPU run or a tiny smoke run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODEL_1B = str(CONFIGS / "llama-3.2-1b")
MODEL_8B = str(CONFIGS / "llama-3.1-8b")

TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # the C++ CPU prefill kernel takes head_dim 64, 128 or 256
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""``hf_config_overrides`` that shrink both Llama shapes for ``--smoke`` (CPU, seconds)."""

ALL_SECTIONS = ("correctness", "ops", "itl", "throughput", "overlap")
THROUGHPUT_MODES = {
    "on/on": (True, True),
    "off/off": (False, False),
    "on/off": (True, False),
    "off/on": (False, True),
}
"""``async scheduling / CUDA graphs`` combinations of the throughput section."""


@dataclass
class Settings:
    """Everything the sections read; built from the command line by :func:`settings_from_args`."""

    device: torch.device
    smoke: bool
    sections: list[str]
    seed: int = 0
    num_prompts: int = 256
    input_len: int = 512
    output_len: int = 256
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    throughput_modes: list[str] = field(default_factory=lambda: ["on/on", "off/off"])
    hf_num_prompts: int = 64
    hf_batch_size: int = 64
    attention_backends: list[str] = field(default_factory=lambda: ["auto"])
    """``--attention-backend`` values the ITL and throughput sections each run (auto: the platform's)."""
    itl_tokens: int = 128
    itl_batch_sizes: list[int] = field(default_factory=lambda: [1])
    """Decode batch sizes of the ITL section with graphs on (batch 1 is always measured)."""
    itl_prompt_len: int = 32
    correctness_model: str | None = None
    """None: the embedded default model (SmolLM2-135M GGUF)."""
    correctness_prompts: int = 4
    correctness_tokens: int = 32
    model_1b: str = MODEL_1B
    model_8b: str = MODEL_8B
    overrides: dict[str, Any] = field(default_factory=dict)
    """``hf_config_overrides`` of the dummy models (tiny shapes in smoke runs)."""
    engine_extra: dict[str, Any] = field(default_factory=dict)
    """Extra engine arguments of every engine on the benchmarked device."""
    quantization: str | None = None
    """``--quantization`` of the dummy-weight engines (itl, throughput): e.g. fp8."""
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192
    sustained_matmul_s: float = 5.0
    """How long the held matmul rate runs: about as long as one throughput run."""
    reshape_tokens: tuple[int, ...] = (256, 8192)
    """``reshape_and_cache_flash`` token counts: a decode batch and a prefill chunk."""
    decode_shapes: tuple[tuple[int, int], ...] = ((64, 2048), (1, 8192))
    """(batch, context) of the decode-attention measurements."""
    op_heads: tuple[int, int, int, int] = (32, 8, 128, 16)
    """Llama-3.1-8B attention: q heads, kv heads, head_dim, block size."""

    def dummy_kwargs(self) -> dict[str, Any]:
        """Engine arguments of a dummy-weight model from one of ``benchmarks/configs``."""
        return {
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "hf_config_overrides": dict(self.overrides),
            "dtype": "bfloat16",
            "seed": self.seed,
            "quantization": self.quantization,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line options of ``gpu_benchmark.py``."""
    parser.add_argument(
        "--sections",
        default=",".join(ALL_SECTIONS),
        help="comma-separated subset of: " + ", ".join(ALL_SECTIONS),
    )
    parser.add_argument(
        "--out", default="gpu_benchmark_results", help="folder for results.json and results.md"
    )
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (with --smoke)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes and few tokens: checks the script, measures nothing useful",
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--throughput-modes", default="on/on,off/off",
        help="async-scheduling/cuda-graphs combinations to run, or 'all' (adds on/off and off/on, ~+1 min)",
    )  # fmt: skip
    parser.add_argument(
        "--hf-num-prompts", type=int, default=64, help="prompts of the transformers baseline (same lengths)"
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=64, help="static batch size of transformers generate"
    )
    parser.add_argument(
        "--attention-backends", default="auto",
        help="comma-separated --attention-backend values the itl and throughput sections each run "
        "(e.g. triton,flashinfer; default auto: the platform's choice)",
    )  # fmt: skip
    parser.add_argument(
        "--itl-batch-sizes", default="1",
        help="comma-separated decode batch sizes the itl section also times with graphs (e.g. 1,4,16,64)",
    )  # fmt: skip
    parser.add_argument(
        "--itl-tokens", type=int, default=128, help="tokens generated per inter-token-latency run"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quantization", choices=["fp8"], default=None,
        help="quantize the dummy-weight models of the itl and throughput sections (fp8: 128x128 blocks)",
    )  # fmt: skip
    parser.add_argument(
        "--section-timeout", type=int, default=360, help="seconds after which a hung section is abandoned"
    )


def _comma_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [item.strip() for item in text.split(",") if item.strip()]


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Full-size settings, or tiny ones with ``--smoke`` (whatever sizes were given)."""
    sections = _comma_list(args.sections)
    unknown = sorted(set(sections) - set(ALL_SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {', '.join(ALL_SECTIONS)}")
    modes = list(THROUGHPUT_MODES) if args.throughput_modes == "all" else args.throughput_modes.split(",")
    if set(modes) - set(THROUGHPUT_MODES):
        raise SystemExit(
            f"unknown throughput modes {modes}; choose from {', '.join(THROUGHPUT_MODES)} or all"
        )
    device = torch.device(args.device)
    s = Settings(
        device=device,
        smoke=args.smoke,
        sections=sections,
        seed=args.seed,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        throughput_modes=modes,
        hf_num_prompts=args.hf_num_prompts,
        hf_batch_size=args.hf_batch_size,
        itl_tokens=args.itl_tokens,
        itl_batch_sizes=[int(b) for b in _comma_list(args.itl_batch_sizes)],
        attention_backends=_comma_list(args.attention_backends),
        quantization=args.quantization,
    )
    if args.smoke:
        s.num_prompts, s.input_len, s.output_len = 4, 16, 8
        s.max_num_seqs, s.max_num_batched_tokens = 4, 64
        s.hf_num_prompts, s.hf_batch_size = 4, 2
        s.itl_tokens, s.itl_prompt_len = 8, 8
        s.correctness_model, s.correctness_prompts, s.correctness_tokens = MODEL_1B, 2, 4
        s.overrides = dict(TINY_OVERRIDES)
        s.copy_bytes, s.matmul_n, s.sustained_matmul_s = 16 << 20, 128, 0.05
        s.reshape_tokens = (64,)
        s.decode_shapes = ((2, 64),)
        s.op_heads = (4, 2, 16, 16)
        if device.type == "cpu":
            s.engine_extra = {"num_threads": 1, "kv_cache_memory": 0.05}
    return s
