"""The engine loop's own cost per step: ``LLM.generate`` on a one-layer, 64-wide dummy Llama.

    python benchmarks/host_overhead.py [--batch 256] [--input-len 16] [--output-len 512]

With a model this small the forward pass is a small part of each step, so the time per
step is mostly the host's work: scheduling, KV-block bookkeeping, input preparation,
sampling launches and output processing for every request. On a GPU that work has to fit
inside one forward pass of the real model, or the GPU waits. Runs on the CPU, anywhere.
"""

from __future__ import annotations

import argparse
import time

from fastdeploy import LLM, SamplingParams

TINY_LLAMA = dict(
    num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=512, tie_word_embeddings=True,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(
        model="benchmarks/configs/llama-3.2-1b", load_format="dummy", skip_tokenizer_init=True,
        hf_config_overrides=TINY_LLAMA, dtype="float32", device="cpu", max_num_seqs=args.batch,
        max_model_len=args.input_len + args.output_len + 16, kv_cache_memory=0.5,
    )  # fmt: skip
    prompts = [[(i * 7 + j) % 500 + 3 for j in range(args.input_len)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    llm.shutdown()
    best = min(times)
    print("| batch | in / out tokens | best of | elapsed (s) | ms per step | µs per request per step |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    per_step = best / args.output_len
    print(f"| {args.batch} | {args.input_len} / {args.output_len} | {args.repeats} | {best:.3f} | "
          f"{per_step * 1e3:.2f} | {per_step / args.batch * 1e6:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
