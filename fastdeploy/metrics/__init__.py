"""Prometheus metrics of the server, names prefixed ``fastdeploy:``, times in seconds.

``REGISTRY`` holds them; :func:`exposition` is what ``GET /metrics`` answers.
``EngineMetrics`` is fed by the front end: scheduler snapshots from the engine
core(s), and per-request timings from the output processor.

With several API server processes (``--api-server-count``) each one runs with
``PROMETHEUS_MULTIPROC_DIR`` set to a private directory of the run (before
prometheus_client is imported): the counters and histograms of every API server
are kept in files there and :func:`exposition`, in whichever process answers,
sums them (prometheus_client's multiprocess mode). The scheduler gauges are each
process's own copy of the engine cores' last snapshots (every client receives
them); their interval counters are added by API server 0 alone, so nothing is
counted twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from fastdeploy.core.request import FinishedRequestStats, SchedulerStats

REGISTRY = CollectorRegistry()

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_LABELS = ["model_name"]
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
"""1, 2, 5, 10, ... 5,000,000: token counts and ``max_tokens`` (vLLM's 1-2-5 series)."""
_N_BUCKETS = (1, 2, 5, 10, 20)


class _SchedulerGauges(Collector):
    """The scheduler gauges (running, waiting, KV usage): each engine core's last snapshot, read when scraped.

    A collector rather than ``Gauge`` objects because its label names depend on the server:
    ``model_name``, plus ``engine`` (the data-parallel rank) when it runs several engine cores.
    """

    FAMILIES = (
        ("fastdeploy:num_requests_running", "Requests in the running batch.", "num_running"),
        ("fastdeploy:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
        ("fastdeploy:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", "kv_cache_usage"),
        (
            "fastdeploy:moe_load_imbalance",
            "Mixture-of-experts models: max / mean of the tokens routed per expert-parallel rank (per "
            "expert without expert parallelism) in the last step, over all MoE layers (1 = balanced).",
            "moe_load_imbalance",
        ),
    )

    OPTIONAL = frozenset({"moe_load_imbalance"})
    """Fields whose family is exported only once an engine core reports a value (MoE models)."""

    def __init__(self) -> None:
        self.snapshots: dict[tuple[tuple[str, str], ...], SchedulerStats] = {}
        """Label pairs of one engine core → its last snapshot."""

    def collect(self) -> Iterator[Metric]:
        snapshots = list(self.snapshots.items())
        for name, doc, field in self.FAMILIES:
            family = Metric(name, doc, "gauge")
            for labels, stats in snapshots:
                value = getattr(stats, field)
                if value is not None:
                    family.add_sample(name, dict(labels), float(value))
            if family.samples or field not in self.OPTIONAL:
                yield family


_scheduler_gauges = _SchedulerGauges()
REGISTRY.register(_scheduler_gauges)
_prefix_queries = Counter(
    "fastdeploy:prefix_cache_queries",
    "Prompt tokens looked up in the prefix cache.",
    _LABELS,
    registry=REGISTRY,
)
_prefix_hits = Counter(
    "fastdeploy:prefix_cache_hits", "Prompt tokens found in the prefix cache.", _LABELS, registry=REGISTRY
)
_preemptions = Counter(
    "fastdeploy:num_preemptions", "Requests preempted for lack of KV blocks.", _LABELS, registry=REGISTRY
)
_prompt_tokens = Counter("fastdeploy:prompt_tokens", "Prompt tokens processed.", _LABELS, registry=REGISTRY)
_generation_tokens = Counter("fastdeploy:generation_tokens", "Tokens generated.", _LABELS, registry=REGISTRY)
_success = Counter(
    "fastdeploy:request_success",
    "Finished requests (choices) by finish reason.",
    _LABELS + ["finished_reason"],
    registry=REGISTRY,
)
_ttft = Histogram(
    "fastdeploy:time_to_first_token_seconds",
    "Arrival to first token.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
_itl = Histogram(
    "fastdeploy:inter_token_latency_seconds",
    "Time between successive token deliveries of a request.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
_e2e = Histogram(
    "fastdeploy:e2e_request_latency_seconds",
    "Arrival to finish.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
_queue = Histogram(
    "fastdeploy:request_queue_time_seconds",
    "Arrival to first scheduling.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)
_request_prompt_tokens = Histogram(
    "fastdeploy:request_prompt_tokens", "Prompt tokens of each finished request.", _LABELS,
    buckets=_TOKEN_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_generation_tokens = Histogram(
    "fastdeploy:request_generation_tokens", "Output tokens of each finished request (all its choices).",
    _LABELS, buckets=_TOKEN_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_params_n = Histogram(
    "fastdeploy:request_params_n", "The n (choices) of each finished request.", _LABELS,
    buckets=_N_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_params_max_tokens = Histogram(
    "fastdeploy:request_params_max_tokens", "The max_tokens of each finished request.", _LABELS,
    buckets=_TOKEN_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_prefill = Histogram(
    "fastdeploy:request_prefill_time_seconds", "First scheduling to first token, per finished request.",
    _LABELS, buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_decode = Histogram(
    "fastdeploy:request_decode_time_seconds", "First token to last token, per finished request.",
    _LABELS, buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_request_inference = Histogram(
    "fastdeploy:request_inference_time_seconds", "First scheduling to finish, per finished request.",
    _LABELS, buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)  # fmt: skip
_encoder_cache_hits = Counter(
    "fastdeploy:encoder_cache_hits",
    "Multimodal items found in the encoder cache.",
    _LABELS,
    registry=REGISTRY,
)
_encoder_cache_misses = Counter(
    "fastdeploy:encoder_cache_misses",
    "Multimodal items not in the encoder cache (fetched and encoded).",
    _LABELS,
    registry=REGISTRY,
)
_feature_fetch = Histogram(
    "fastdeploy:feature_fetch_latency_seconds",
    "Download plus load time of one multimodal feature URL.",
    _LABELS,
    buckets=_LATENCY_BUCKETS,
    registry=REGISTRY,
)


_api_server_requests = Counter(
    "fastdeploy:api_server_requests",
    "Generation and embedding requests received, by API server process (--api-server-count).",
    _LABELS + ["api_server"],
    registry=REGISTRY,
)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess mode: set (to a private directory) for every API server process
of a run with several, before prometheus_client is imported."""


def exposition() -> bytes:
    """The Prometheus text of ``GET /metrics``: this process's metrics, or with several API server
    processes the counters and histograms of all of them summed, plus this process's gauges."""
    path = os.environ.get(MULTIPROC_DIR_ENV)
    if not path:
        return generate_latest(REGISTRY)
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path)
    registry.register(_scheduler_gauges)
    return generate_latest(registry)


def api_server_request_counter(model_name: str, api_server: int) -> Counter:
    """The counter of generation and embedding requests received by API server ``api_server`` (its
    series exists, at 0, from this call on)."""
    return _api_server_requests.labels(model_name=model_name, api_server=str(api_server))


class EngineMetrics:
    """Records one engine's metrics under its ``model_name`` label.

    With ``num_engines`` > 1 (data parallelism) the scheduler gauges have one series per
    engine core, labelled ``engine`` with its rank (as vLLM's); the counters add up over
    the engine cores. With one engine core the label is left out: nothing changes.
    ``engine_counters``: whether the interval counters of the scheduler snapshots (prefix and
    encoder cache, preemptions) are added here (False in every API server process but the first).
    """

    def __init__(self, model_name: str, num_engines: int = 1, engine_counters: bool = True):
        self.labels = {"model_name": model_name}
        self._engine_counters = engine_counters
        per_engine = [(("engine", str(rank)),) if num_engines > 1 else () for rank in range(num_engines)]
        self._gauge_keys = [(("model_name", model_name), *engine) for engine in per_engine]
        """Per engine core, the label pairs of its scheduler gauges."""
        # create every labelled series now, so that a fresh server exposes its gauges and
        # counters at 0 instead of leaving them out until the first request
        for rank in range(num_engines):
            self.on_scheduler_gauges(SchedulerStats(), rank)
        for metric in (_prefix_queries, _prefix_hits, _preemptions,
                       _prompt_tokens, _generation_tokens, _ttft, _itl, _e2e, _queue,
                       _encoder_cache_hits, _encoder_cache_misses, _feature_fetch,
                       _request_prompt_tokens, _request_generation_tokens, _request_params_n,
                       _request_params_max_tokens, _request_prefill, _request_decode,
                       _request_inference):  # fmt: skip
            metric.labels(**self.labels)
        for reason in ("stop", "length", "abort"):
            _success.labels(model_name=model_name, finished_reason=reason)  # expose zeros from the start

    def on_scheduler_gauges(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Set engine core ``engine``'s gauges (running, waiting, KV usage) from ``stats``."""
        _scheduler_gauges.snapshots[self._gauge_keys[engine]] = stats

    def on_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Take a snapshot that engine core ``engine`` sent: its gauges, and add its interval counters."""
        self.on_scheduler_gauges(stats, engine)
        if not self._engine_counters:
            return
        _prefix_queries.labels(**self.labels).inc(stats.prefix_cache_queries)
        _prefix_hits.labels(**self.labels).inc(stats.prefix_cache_hits)
        _preemptions.labels(**self.labels).inc(stats.num_preemptions)
        self.on_encoder_cache(stats.encoder_cache_hits, stats.encoder_cache_misses)

    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None:
        _ttft.labels(**self.labels).observe(ttft)
        _prompt_tokens.labels(**self.labels).inc(num_prompt_tokens)

    def on_inter_token(self, gap: float) -> None:
        _itl.labels(**self.labels).observe(gap)

    def on_generation_tokens(self, n: int) -> None:
        _generation_tokens.labels(**self.labels).inc(n)

    def on_finished(self, finish_reason: str, e2e: float, queue_time: float | None) -> None:
        _success.labels(finished_reason=finish_reason, **self.labels).inc()
        _e2e.labels(**self.labels).observe(e2e)
        if queue_time is not None:
            _queue.labels(**self.labels).observe(queue_time)

    def on_request_finished(self, stats: FinishedRequestStats) -> None:
        """A generation request whose every choice has finished: its sizes and phases (vLLM's
        per-request histograms)."""
        _request_prompt_tokens.labels(**self.labels).observe(stats.prompt_tokens)
        _request_generation_tokens.labels(**self.labels).observe(stats.generation_tokens)
        _request_params_n.labels(**self.labels).observe(stats.n)
        if stats.max_tokens is not None:
            _request_params_max_tokens.labels(**self.labels).observe(stats.max_tokens)
        for histogram, seconds in (
            (_request_prefill, stats.prefill_time),
            (_request_decode, stats.decode_time),
            (_request_inference, stats.inference_time),
        ):
            if seconds is not None:
                histogram.labels(**self.labels).observe(seconds)

    def on_encoder_cache(self, hits: int, misses: int) -> None:
        """Add an interval's encoder cache lookups (``EncoderCacheManager.take_stats()``)."""
        _encoder_cache_hits.labels(**self.labels).inc(hits)
        _encoder_cache_misses.labels(**self.labels).inc(misses)

    def on_feature_fetch(self, seconds: float) -> None:
        """Record one feature URL's fetch time (pass as ``fetch_features(observe_latency=...)``)."""
        _feature_fetch.labels(**self.labels).observe(seconds)
