"""vLLM's offline engine on the workloads of ``benchmarks/multi_gpu.py``, for the side-by-side numbers.

    python benchmarks/vllm_offline.py --model benchmarks/configs/llama-3.1-8b --tokenizer TOK --tp 2
    python benchmarks/vllm_offline.py --model benchmarks/configs/qwen3-30b-a3b --tokenizer TOK --tp 2 \\
        --enable-expert-parallel [--quantization fp8]

One ``vllm.LLM`` (dummy weights, bf16, its defaults: CUDA graphs, torch.compile) measures what
``multi_gpu.py``'s ``tp_run`` measures for FastDeploy: the batch-1 inter-token latency (one
request of 32 random prompt tokens; (time of 1 + N tokens - time of 1 + 8 tokens) / (N - 8), so
the prefill cancels) and the offline output tokens/s of ``--num-prompts`` random prompts of
``--input-len`` tokens, ``--output-len`` tokens each (greedy, EOS ignored), after a warm-up of
32 short requests. Prints one JSON line and writes it to ``--out``. Needs ``vllm`` importable
(docs/benchmarks.md says how it is carried to the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids drawn uniformly from ``[10, vocab)``."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def main() -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--itl-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        tokenizer=args.tokenizer,
        load_format="dummy",
        dtype="bfloat16",
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        max_model_len=max(args.input_len + args.output_len, 32 + args.itl_tokens) + 16,
        max_num_seqs=args.num_prompts,
        seed=0,
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def generate(prompts: list[list[int]], tokens: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    one = random_prompts(1, 32, vocab, 1)
    generate(one, 8)  # warm-up
    short = min(generate(one, 9)[0] for _ in range(3))
    full = min(generate(one, 1 + args.itl_tokens)[0] for _ in range(2))
    itl_ms = (full - short) * 1000.0 / (args.itl_tokens - 8)
    generate(random_prompts(min(32, args.num_prompts), args.input_len, vocab, 2), 4)
    elapsed, tokens = generate(random_prompts(args.num_prompts, args.input_len, vocab, 0), args.output_len)
    row = {
        "engine": "vllm",
        "model": os.path.basename(args.model.rstrip("/")),
        "tp": args.tp,
        "enable_expert_parallel": args.enable_expert_parallel,
        "quantization": args.quantization,
        "batch1_itl_ms": itl_ms,
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed,
    }
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(row, f)


if __name__ == "__main__":
    main()
