"""Embedding throughput: N random token-id inputs through ``LLM.embed`` (the pooling runner), against
the same inputs as generation requests that stop after their first token (the same prefills plus an
LM head and one sampled token each), on one model shape.

The embedding run should not be slower than the prefill-only generation run: both compute the same
prefills, and the pooling runner replaces the LM head and sampling by a gather (or a per-chunk sum)
and one vector copy per finished input.

Examples:
    python benchmarks/embeddings.py                                  # GPU: Qwen3-Embedding-0.6B shape, bf16, dummy weights
    python benchmarks/embeddings.py --num-inputs 64 --input-len 64 --dtype float32 \
        --hf-overrides '{"num_hidden_layers": 2}'                    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import time

from fastdeploy import LLM, SamplingParams
from fastdeploy.core.pooling_params import PoolingParams


def random_inputs(num: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Inputs of max_len / 2 to max_len tokens (ids clear of the special tokens at the bottom)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(max_len // 2, max_len))]
        for _ in range(num)
    ]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="benchmarks/configs/qwen3-embedding-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-inputs", type=int, default=1024)
    parser.add_argument(
        "--input-len", type=int, default=512, help="longest input; lengths are uniform from half of it"
    )
    parser.add_argument("--pooling-type", choices=["last", "mean"], default="last")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--hf-overrides", type=json.loads, default={})
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="each of the two engines")
    args = parser.parse_args()

    common = dict(
        load_format=args.load_format,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(args.input_len + 8, 64),
        hf_config_overrides=args.hf_overrides,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    results: dict[str, object] = {
        "model": args.model,
        "num_inputs": args.num_inputs,
        "input_len": args.input_len,
    }
    llm = LLM(args.model, runner="pooling", **common)
    inputs = random_inputs(args.num_inputs, args.input_len, llm.engine.source.arch.vocab_size, seed=0)
    tokens = sum(map(len, inputs))
    params = PoolingParams(args.pooling_type, normalize=True)
    llm.embed(inputs[:8], params)  # warm-up
    seconds = timed(lambda: llm.embed(inputs, params))
    results["embed"] = {
        "s": round(seconds, 3),
        "inputs_per_s": round(len(inputs) / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }
    llm.shutdown()
    del llm

    llm = LLM(args.model, runner="generate", **common)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(inputs[:8], one_token)
    seconds = timed(lambda: llm.generate(inputs, one_token))
    results["generate_1_token"] = {
        "s": round(seconds, 3),
        "inputs_per_s": round(len(inputs) / seconds, 1),
        "tokens_per_s": round(tokens / seconds),
    }
    llm.shutdown()
    results["embed_vs_generate"] = round(results["generate_1_token"]["s"] / results["embed"]["s"], 3)  # type: ignore[index]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
