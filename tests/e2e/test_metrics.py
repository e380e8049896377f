"""``GET /metrics``: Prometheus text that parses, ``fastdeploy:`` names, and counters that move."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "fastdeploy:"
EXPECTED_FAMILIES = {
    "fastdeploy:num_requests_running": "gauge",
    "fastdeploy:num_requests_waiting": "gauge",
    "fastdeploy:kv_cache_usage_perc": "gauge",
    "fastdeploy:prefix_cache_queries": "counter",
    "fastdeploy:prefix_cache_hits": "counter",
    "fastdeploy:num_preemptions": "counter",
    "fastdeploy:prompt_tokens": "counter",
    "fastdeploy:generation_tokens": "counter",
    "fastdeploy:request_success": "counter",
    "fastdeploy:time_to_first_token_seconds": "histogram",
    "fastdeploy:inter_token_latency_seconds": "histogram",
    "fastdeploy:e2e_request_latency_seconds": "histogram",
    "fastdeploy:request_queue_time_seconds": "histogram",
    "fastdeploy:request_prompt_tokens": "histogram",
    "fastdeploy:request_generation_tokens": "histogram",
    "fastdeploy:request_params_n": "histogram",
    "fastdeploy:request_params_max_tokens": "histogram",
    "fastdeploy:request_prefill_time_seconds": "histogram",
    "fastdeploy:request_decode_time_seconds": "histogram",
    "fastdeploy:request_inference_time_seconds": "histogram",
    "fastdeploy:encoder_cache_hits": "counter",
    "fastdeploy:encoder_cache_misses": "counter",
    "fastdeploy:feature_fetch_latency_seconds": "histogram",
    "fastdeploy:api_server_requests": "counter",
}
HISTOGRAMS = [name for name, kind in EXPECTED_FAMILIES.items() if kind == "histogram"]
# 40+ tokens: two full 16-token KV blocks that a second identical request finds in the prefix cache
CACHED_PROMPT = (
    "You are a meticulous assistant. Read the following notes carefully and answer briefly. "
    "Note one: the meeting is on Tuesday. Note two: bring the blue folder. Question:"
)


def test_metrics_parse_with_prefix_types_and_labels(server, model_name):
    response = httpx.get(server.url + "/metrics", timeout=30)
    assert response.status_code == 200
    # the classic text format (docs/metrics.md), not prometheus_client's newest version=1.0.0 label
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    # prometheus_client also exports a ``<name>_created`` gauge (creation timestamp) per counter/histogram
    ours = {n: f for n, f in families.items() if n.startswith(PREFIX) and not n.endswith("_created")}
    created = {
        n.removesuffix("_created") for n in families if n.startswith(PREFIX) and n.endswith("_created")
    }
    assert created == {n for n, kind in EXPECTED_FAMILIES.items() if kind != "gauge"}
    # everything FastDeploy exports is prefixed, and each expected family has its type
    assert {name: f.type for name, f in ours.items()} == EXPECTED_FAMILIES
    for family in ours.values():
        assert family.samples, family.name  # exposed from the start, before (or without) traffic
        for sample in family.samples:
            assert sample.name.startswith(PREFIX)
            assert sample.labels["model_name"] == model_name, sample
    reasons = {s.labels["finished_reason"] for s in ours["fastdeploy:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    for name in HISTOGRAMS:
        buckets = [s for s in ours[name].samples if s.name == name + "_bucket"]
        assert buckets and buckets[-1].labels["le"] == "+Inf"


def scrape_after_settling(server) -> dict[str, float]:
    """Metrics once the engine is idle (gauges and prefix-cache counters arrive with engine snapshots)."""
    server.wait_idle(timeout=5)
    time.sleep(0.2)  # the idle snapshot follows the last output
    return server.metrics()


def test_counters_move_as_requests_are_served(server, model_name):
    client = server.openai()
    before = scrape_after_settling(server)

    # two identical greedy requests that run to max_tokens: the second hits the prefix cache
    usages = []
    for _ in range(2):
        response = client.completions.create(
            model=model_name,
            prompt=CACHED_PROMPT,
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert response.choices[0].finish_reason == "length"
        usages.append(response.usage)
    # and one that a stop string ends
    full = client.completions.create(model=model_name, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0)
    stop = full.choices[0].text[3:6]
    stopped = client.completions.create(
        model=model_name, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop", (full.choices[0].text, stop)

    after = scrape_after_settling(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    responses = [*usages, full.usage, stopped.usage]
    prompt_tokens = sum(u.prompt_tokens for u in responses)
    assert delta("fastdeploy:prompt_tokens_total") == prompt_tokens
    # every token generated is counted; a stop string may end a request after a few more
    # tokens were generated than the (cut) text it reports
    completion_tokens = sum(u.completion_tokens for u in responses)
    assert completion_tokens <= delta("fastdeploy:generation_tokens_total") <= completion_tokens + 8
    reasons = [*["length"] * 2, full.choices[0].finish_reason, "stop"]
    for reason in ("length", "stop"):
        assert delta(f"fastdeploy:request_success_total{{finished_reason={reason}}}") == reasons.count(reason)
    assert delta("fastdeploy:request_success_total{finished_reason=abort}") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"fastdeploy:{name}_count") == 4, name
        assert delta(f"fastdeploy:{name}_sum") >= 0, name
    # the per-request histograms (vLLM's): one observation per finished request
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                 "request_params_max_tokens", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):  # fmt: skip
        assert delta(f"fastdeploy:{name}_count") == 4, name
    assert delta("fastdeploy:request_prompt_tokens_sum") == prompt_tokens
    assert completion_tokens <= delta("fastdeploy:request_generation_tokens_sum") <= completion_tokens + 8
    assert delta("fastdeploy:request_params_n_sum") == 4
    assert delta("fastdeploy:request_params_max_tokens_sum") == 5 + 5 + 8 + 8
    assert delta("fastdeploy:request_inference_time_seconds_sum") >= delta(
        "fastdeploy:request_decode_time_seconds_sum"
    )
    # one inter-token gap per token after the first, at least (5 + 5 tokens, plus the others)
    assert delta("fastdeploy:inter_token_latency_seconds_count") >= 8
    assert delta("fastdeploy:e2e_request_latency_seconds_sum") > delta(
        "fastdeploy:time_to_first_token_seconds_sum"
    )
    # prefix cache: every prompt was looked up; the repeated prompt found its full blocks
    assert delta("fastdeploy:prefix_cache_queries_total") >= prompt_tokens
    assert delta("fastdeploy:prefix_cache_hits_total") >= 32
    assert usages[1].prompt_tokens_details.cached_tokens >= 32
    assert delta("fastdeploy:prefix_cache_hits_total") <= delta("fastdeploy:prefix_cache_queries_total")
    # idle again
    assert after["fastdeploy:num_requests_running"] == 0
    assert after["fastdeploy:num_requests_waiting"] == 0
    assert after["fastdeploy:kv_cache_usage_perc"] == 0


def test_gauges_move_while_a_request_runs(server, model_name):
    """While a long request streams, running is 1 and the KV cache is in use; afterwards both are 0."""
    body = {
        "model": model_name,
        "prompt": CACHED_PROMPT,
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
    }
    seen_running, seen_kv = 0.0, 0.0
    with server.http() as client, client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and seen_running == 0:
                m = server.metrics()
                seen_running, seen_kv = (
                    m["fastdeploy:num_requests_running"],
                    m["fastdeploy:kv_cache_usage_perc"],
                )
    assert seen_running == 1
    assert 0 < seen_kv < 1
    m = server.wait_idle(timeout=5)
    assert m["fastdeploy:num_requests_running"] == 0
    assert m["fastdeploy:kv_cache_usage_perc"] == 0


def test_health_answers_head_probes(server):
    """Load balancers and uptime monitors probe with HEAD: 200 as GET (no API key needed)."""
    for path in ("/health", "/ping", "/health_generate"):
        response = httpx.head(server.url + path, timeout=30)
        assert response.status_code == 200, (path, response.status_code, response.text)
