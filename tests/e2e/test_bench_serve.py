"""``fastdeploy bench serve`` against the live server: a clean short run, and failures counted, not dropped."""

from __future__ import annotations

import asyncio
import json
import socket

from fastdeploy.benchmarks.datasets import SampleRequest
from fastdeploy.benchmarks.serve import ServeConfig, run_benchmark
from fastdeploy.entrypoints.cli.main import main

NUM, IN, OUT = 8, 32, 16


def bench_serve(server, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", server.url, "--api-key", server.api_key, "--disable-tqdm"]
    code = main([*argv, "--save-result", str(out), "--save-detailed", *args])
    return code, json.loads(out.read_text())


def test_short_run_has_no_failures_and_sane_numbers(server, model_name, tmp_path):
    code, r = bench_serve(
        server, tmp_path,
        "--num-prompts", str(NUM), "--input-len", str(IN), "--output-len", str(OUT),
        "--max-concurrency", "4", "--ignore-eos", "--num-warmups", "1", "--goodput", "ttft:60000", "tpot:60000",
    )  # fmt: skip
    assert code == 0
    assert r["model"] == model_name  # the default: first of /v1/models
    assert (r["completed"], r["failed"], r["errors"]) == (NUM, 0, [])
    assert r["total_output_tokens"] == NUM * OUT  # ignore_eos: exact lengths, from the server's usage
    assert abs(r["total_input_tokens"] - NUM * IN) <= NUM  # prompts sized through /tokenize
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["input_throughput"] > 0
    assert r["good_requests"] == NUM and r["goodput"] == r["request_throughput"]
    assert 0 < r["ttft_ms"]["mean"] < r["e2el_ms"]["mean"]
    assert r["tpot_ms"]["count"] == NUM and r["tpot_ms"]["mean"] > 0
    # one chunk per token, unless deltas that waited for a busy event loop went out as one
    assert 0 < r["itl_ms"]["count"] <= NUM * (OUT - 1)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = r[key]
        assert 0 < d["median"] <= d["p90"] <= d["p99"], (key, d)
    assert r["e2el_ms"]["p99"] / 1000 <= r["duration"]
    for req in r["requests"]:
        assert req["success"] and 0 < req["ttft"] < req["latency"]
        assert abs(req["ttft"] + sum(req["itl"]) - req["latency"]) < 0.05


def test_chat_endpoint_prefix_repetition(server, tmp_path):
    code, r = bench_serve(
        server, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset-name", "prefix-repetition",
        "--prefix-len", "32", "--suffix-len", "8", "--num-prefixes", "2", "--num-prompts", "4",
        "--output-len", "4", "--ignore-eos", "--request-rate", "20",
    )  # fmt: skip
    assert code == 0 and (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 16 and r["total_input_tokens"] > 4 * 40  # chat template adds tokens
    assert 0 < r["itl_ms"]["count"] <= 4 * 3  # the role chunk is not a token


def test_wrong_model_requests_are_counted_as_failed(server, tmp_path):
    code, r = bench_serve(server, tmp_path, "--model", "no-such-model", "--num-prompts", "3",
                          "--input-len", "8", "--output-len", "4")  # fmt: skip
    assert code == 1  # nothing succeeded
    assert (r["num_prompts"], r["completed"], r["failed"]) == (3, 0, 3)
    assert all(e.startswith("HTTP 404") for e in r["errors"]), r["errors"]
    assert r["ttft_ms"]["count"] == 0 and r["ttft_ms"]["mean"] is None


def test_one_bad_request_among_good_ones(server, model_name):
    """A request the server rejects (max_tokens beyond the context) fails alone; the others are measured."""
    good = SampleRequest("Say hello.", 4, 4)
    bad = SampleRequest("Say hello.", 4, server.max_model_len * 2)
    cfg = ServeConfig(server.url, model_name, api_key=server.api_key, max_concurrency=2, disable_tqdm=True)
    metrics, results = asyncio.run(run_benchmark(cfg, [good, bad, good]))
    assert (metrics.num_prompts, metrics.completed, metrics.failed) == (3, 2, 1)
    assert [r.success for r in results] == [True, False, True]
    assert results[1].error.startswith("HTTP 400") and metrics.errors == [results[1].error]


def test_closed_port_is_counted_as_failed():
    """Connection errors are failures with their error recorded (no server needed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    cfg = ServeConfig(f"http://127.0.0.1:{port}", "any", disable_tqdm=True)
    metrics, results = asyncio.run(run_benchmark(cfg, [SampleRequest("hi", 1, 2)] * 2))
    assert (metrics.completed, metrics.failed) == (0, 2)
    assert all("Connect" in r.error for r in results), [r.error for r in results]
