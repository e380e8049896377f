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

``--profile-window STEP`` runs the throughput workload step by step with vLLM's engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and prints what ``gpubench/profile_throughput.py``
prints for ours: the steps' wall times by phase, and the kernels of four steps from ``STEP`` on
(torch profiler, CUDA activity), so that the two engines' decode steps compare kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any


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
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    parser.add_argument(
        "--profile-window", type=int, default=None, help="profile 4 steps of the throughput run from this one"
    )
    args = parser.parse_args()
    if args.profile_window is not None:  # (the engine core's kernels then run in this process)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

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
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
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
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, 0)
    if args.profile_window is not None:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        profile_steps(llm, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, args.profile_window)
        return
    elapsed, tokens = generate(prompts, args.output_len)
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


def profile_steps(llm: Any, prompts: list[Any], params: Any, window_step: int) -> None:
    """The throughput run through ``llm.llm_engine.step()``: each step's wall time (charged to the
    step before, as async scheduling shows a step's GPU time in the next one's), the phases by
    the scheduler's tokens and requests a step, and four steps' kernels from ``window_step``."""
    from gpubench.kernel_window import phase_table, run_steps

    engine = llm.llm_engine
    log: list[tuple[int, int]] = []
    scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
    if scheduler is not None:
        schedule = scheduler.schedule

        def logged_schedule(*a, **kw):
            out = schedule(*a, **kw)
            log.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
            return out

        scheduler.schedule = logged_schedule
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tp-{i}", prompt, params)
    start = time.perf_counter()
    times, window = run_steps(engine.step, engine.has_unfinished_requests, window_step)
    elapsed = time.perf_counter() - start
    print(f"vllm: {len(prompts)} prompts: {elapsed:.2f} s ({len(prompts) * params.max_tokens / elapsed:,.0f} "
          f"output tok/s, profiled window included), {len(times)} steps")  # fmt: skip
    if log:
        print("\n".join(phase_table(log, times, len(prompts))))
    else:
        print("(the scheduler was not found: no phase table)")
    print(f"\nvllm decode steps {window_step}-{window_step + 3}:")
    print("\n".join(window))


if __name__ == "__main__":
    main()
