"""Which Triton kernels compile after start-up, in the first requests' steps, and what that costs.

    python -m benchmarks.gpubench.cold_start [config dir] [--quantization ptpc_fp8] \
        [--hf-config-overrides '{"num_hidden_layers": 4}'] [--num-prompts 64] [--input-len 512]

With an empty Triton cache (a fresh ``TRITON_CACHE_DIR``) the engine starts (weights, profile
run, warm-up, CUDA graphs), then the same burst of random prompts (greedy, ``ignore_eos``) runs
twice. For each burst it prints the wall time and the kernels that were compiled during it (new
entries in the cache): every one is a first-request stall of a second or so on a fresh machine
that the start-up warm-up should have taken. A fewer-layer override keeps the kernels (same
widths) and makes start-up quick.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

from .measure import random_prompts
from .settings import MODEL_8B


def compiled_kernels(cache: Path) -> collections.Counter:
    """Kernel name → number of compiled variants in a Triton cache folder (one ``<name>.json``
    metadata file per variant)."""
    names: collections.Counter = collections.Counter()
    for meta in cache.glob("*/*.json"):
        if not meta.name.startswith("__grp__"):
            names[meta.stem] += 1
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=MODEL_8B)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--hf-config-overrides", default="{}", help="JSON, e.g. fewer layers")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="triton-cold-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)  # before triton is imported by the engine

    from fastdeploy import LLM, SamplingParams
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import resolve_model

    overrides = json.loads(args.hf_config_overrides)
    vocab = resolve_model(ModelConfig(model=args.config, hf_config_overrides=dict(overrides))).arch.vocab_size
    start = time.perf_counter()
    llm = LLM(
        model=args.config, load_format="dummy", skip_tokenizer_init=True, seed=0, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_num_batched_tokens=args.max_num_batched_tokens, hf_config_overrides=overrides,
        max_model_len=-(-(args.input_len + args.output_len + 1) // 16) * 16, quantization=args.quantization,
    )  # fmt: skip
    print(f"start-up {time.perf_counter() - start:.1f} s: {sum(compiled_kernels(cache).values())} variants")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        for burst in (1, 2):
            before = compiled_kernels(cache)
            prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=burst)
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            new = compiled_kernels(cache) - before
            print(f"burst {burst}: {seconds:.2f} s, compiled during it: {dict(new) or 'nothing'}")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
