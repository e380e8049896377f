"""Offline throughput: N random prompts through ``LLM.generate``; prints requests/s and tokens/s.

Example (the figure in docs/benchmarks.md):
    python benchmarks/offline_throughput.py --num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16

``--backend paddle`` runs the same engine on PaddlePaddle (docs/paddle.md).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from fastdeploy import SamplingParams
from fastdeploy.platforms.backend import activate, backend_version


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # stay clear of the special tokens at the bottom of the vocabulary
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "paddle"])
    parser.add_argument("--num-threads", type=int, default=None, help="CPU threads; default: all cores")
    args = parser.parse_args()
    activate(args.backend)  # before the engine imports torch
    from fastdeploy import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
    )
    vocab = llm.engine.source.arch.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(2, 16, vocab, args.seed + 1), SamplingParams(max_tokens=4))  # warm-up

    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    result = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "backend": backend_version(),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(args.num_prompts / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 1),
    }
    print(f"{'metric':<22}{'value':>12}")
    for key, value in result.items():
        print(f"{key:<22}{value!s:>12}")
    if args.json:
        print(json.dumps(result))
    llm.shutdown()


if __name__ == "__main__":
    main()
