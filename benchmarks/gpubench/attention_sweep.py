"""Sweep the Triton decode-attention kernel's tile sizes and KV splits on decode shapes.

    python -m benchmarks.gpubench.attention_sweep [--out DIR]

For each (batch, context, q heads, KV heads) shape, times
:func:`fastdeploy.ops.triton_attention.decode_attention` (bf16, head_dim 128, KV blocks of 16 at
random places) with the engine's choice (:func:`decode_config`, :func:`decode_num_splits`) and
with every candidate (TILE_N, warps, stages, splits), and prints the engine's and the best
time per shape with the achieved KV read bandwidth. The winners are what ``decode_config`` /
``decode_num_splits`` should choose.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from benchmarks.gpubench.measure import time_per_call
from fastdeploy.ops import triton_attention as ta

SHAPES = [(256, 640, 32, 4), (256, 640, 32, 8), (128, 1024, 32, 8), (64, 2048, 32, 4), (1, 160, 32, 4)]
"""(requests, context tokens, query heads, KV heads): Qwen3-30B-A3B and Llama-8B decode steps."""
HEAD_DIM, BLOCK = 128, 16


def problem(batch: int, context: int, q_heads: int, kv_heads: int, device: torch.device):
    """Random queries, caches and block tables (blocks at random places)."""
    blocks_per_req = -(-context // BLOCK)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_req).to(torch.int32)
    q = torch.randn(batch, q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return q, k, v, table, seq_lens, qsl


def time_one(args, splits: int, config: dict | None, device: torch.device) -> float:
    q, k, v, table, seq_lens, qsl = args
    out = torch.empty_like(q)

    def call(_: int) -> None:
        ta.decode_attention(
            out, q, k, v, table, seq_lens, qsl, scale=HEAD_DIM**-0.5, num_reqs=q.shape[0],
            num_splits=splits, config=config,
        )  # fmt: skip

    return time_per_call(call, device, iters=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/attention_sweep")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for batch, context, q_heads, kv_heads in SHAPES:
        data = problem(batch, context, q_heads, kv_heads, device)
        kv_bytes = 2 * batch * context * kv_heads * HEAD_DIM * 2
        splits0 = ta.decode_num_splits(batch, kv_heads, -(-context // BLOCK) * BLOCK, num_sms)
        engine = time_one(data, splits0, None, device)
        group = q_heads // kv_heads
        best = (engine, splits0, None)
        for tile, warps, stages, splits in itertools.product(
            (16, 32, 64, 128), (2, 4, 8), (2, 3, 4), (1, 2, 4, 8)
        ):
            if splits > 1 and context // splits < 64:
                continue
            config = dict(BLOCK_H=max(16, group), TILE_N=tile, num_warps=warps, num_stages=stages)
            try:
                t = time_one(data, splits, config, device)
            except Exception:  # out of shared memory / registers: not a candidate
                continue
            if t < best[0]:
                best = (t, splits, config)
        row = {
            "shape": f"{batch} x {context} ctx, {q_heads}/{kv_heads} heads",
            "engine_us": engine * 1e6, "engine_splits": splits0,
            "engine_config": ta.decode_config(torch.bfloat16, HEAD_DIM, group, batch * kv_heads * splits0),
            "engine_TBps": kv_bytes / engine / 1e12,
            "best_us": best[0] * 1e6, "best_splits": best[1], "best_config": best[2],
            "best_TBps": kv_bytes / best[0] / 1e12,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(args.out, "attention_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| shape | engine µs (splits, config) | TB/s | best µs (splits, config) | TB/s |")
    print("| --- | --- | ---: | --- | ---: |")
    for r in rows:
        print(
            f"| {r['shape']} | {r['engine_us']:.1f} ({r['engine_splits']}, {r['engine_config']}) | "
            f"{r['engine_TBps']:.2f} | {r['best_us']:.1f} ({r['best_splits']}, {r['best_config']}) | {r['best_TBps']:.2f} |"
        )


if __name__ == "__main__":
    main()
