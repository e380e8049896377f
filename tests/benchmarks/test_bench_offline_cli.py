"""``fastdeploy bench throughput`` and ``bench latency`` on the default model at tiny sizes (subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENGINE_ARGS = ["--kv-cache-memory", "0.25", "--num-threads", "1", "--max-model-len", "512"]


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", *args, *ENGINE_ARGS]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [*cmd, "--save-result", str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_throughput_random(tmp_path):
    r = run_bench(tmp_path, "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "8")
    assert r["num_requests"] == 4
    assert r["total_output_tokens"] == 32  # ignore_eos by default: exact lengths
    assert abs(r["total_input_tokens"] - 64) <= 4
    assert r["elapsed_s"] > 0 and r["output_tokens_per_s"] > 0
    assert r["total_tokens_per_s"] > r["output_tokens_per_s"]


def test_bench_latency_separates_prefill_and_decode(tmp_path):
    r = run_bench(tmp_path, "latency", "--batch-size", "2", "--input-len", "16", "--output-len", "6",
                  "--num-iters", "2", "--num-warmup-iters", "1")  # fmt: skip
    assert (r["batch_size"], r["input_len"], r["output_len"], r["num_iters"]) == (2, 16, 6, 2)
    assert r["prefill_ms"]["count"] == 2
    assert r["decode_token_ms"]["count"] == 2 * 5  # tokens 2..6 of each iteration
    for key in ("prefill_ms", "decode_token_ms", "total_ms"):
        assert 0 < r[key]["p50"] <= r[key]["p90"], (key, r[key])
    assert r["total_ms"]["mean"] > r["prefill_ms"]["mean"] + 4 * r["decode_token_ms"]["mean"] * 0.5
