"""Where an offline throughput run's time goes: step times by phase, and one decode window's kernels.

    python -m benchmarks.gpubench.profile_throughput [config dir] [--attention-backend B]
        [--num-prompts 256] [--input-len 512] [--output-len 256] [--window-step 100]

Runs the throughput workload of ``gpu_benchmark.py`` (random prompts, greedy, ``ignore_eos``,
dummy bf16 weights) step by step through the engine and prints:

* the wall time of the prefill steps (any step that computes prompt tokens) and of the
  decode-only steps, by batch size. With async scheduling a step's GPU time shows up in
  the wall time of the step after it, so each step is charged the next step's time;
* for four decode steps from ``--window-step`` on (torch profiler, CUDA activity): the GPU's
  busy time, the span from the first kernel's start to the last one's end, the wall
  time, the gaps between kernels by size, and the kernels with the most time and the
  most idle time before them.

Without CUDA the kernel window is skipped, so ``--device cpu`` only checks the script.
"""

from __future__ import annotations

import argparse
import json
import time

from fastdeploy import LLM, SamplingParams
from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.model_loader import resolve_model

from .kernel_window import phase_table, run_steps
from .measure import random_prompts
from .settings import MODEL_8B


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=MODEL_8B)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the token budget (default: the engine's)"
    )
    parser.add_argument("--window-step", type=int, default=100)
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (weights quantized at load)")
    parser.add_argument(
        "--hf-config-overrides", type=str, default="{}", help="JSON, e.g. for a tiny smoke model"
    )
    args = parser.parse_args()
    overrides = json.loads(args.hf_config_overrides)
    vocab = resolve_model(ModelConfig(model=args.config, hf_config_overrides=dict(overrides))).arch.vocab_size
    llm = LLM(
        model=args.config, load_format="dummy", skip_tokenizer_init=True, seed=0, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
        max_model_len=-(-(args.input_len + args.output_len + 1) // 16) * 16,
        hf_config_overrides=overrides, quantization=args.quantization,
    )  # fmt: skip
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(1, args.input_len, vocab, seed=1), params)  # warm-up
    scheduler = llm.engine.core.scheduler
    log: list[tuple[int, int]] = []
    schedule = scheduler.schedule

    def logged_schedule():
        out = schedule()
        log.append((out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)))
        return out

    scheduler.schedule = logged_schedule
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"tp-{i}", prompt, params)
    start = time.perf_counter()
    times, window = run_steps(
        lambda: llm.engine.step(final_only=True),  # as LLM.generate
        llm.engine.has_unfinished_requests,
        args.window_step if args.device == "cuda" else None,
    )
    elapsed = time.perf_counter() - start
    llm.shutdown()
    print(f"{args.num_prompts} prompts x {args.input_len} / {args.output_len} tokens: {elapsed:.2f} s "
          f"({args.num_prompts * args.output_len / elapsed:,.0f} output tok/s, profiled window included), "
          f"{len(times)} steps")  # fmt: skip
    print("\n".join(phase_table(log, times, args.num_prompts)))
    if window:
        print(f"\nDecode steps {args.window_step}-{args.window_step + 3}:")
        print("\n".join(window))


if __name__ == "__main__":
    main()
