"""The ``bench serve`` load generator: streamed requests against an OpenAI-compatible server.

Requests arrive as a Poisson process of ``request_rate`` per second (``inf``:
all at once), at most ``max_concurrency`` in flight. Every request streams
(``stream_options.include_usage``) so that TTFT and ITL are measured on the
wire and token counts come from the server's ``usage``. A chunk counts as a token
chunk when it carries text or token ids: the request also asks for
``return_token_ids`` (vLLM's extension, which ours and vLLM's servers honour), so a
token that decodes to no text (a partial UTF-8 character, a special token) still
counts. A request that fails (HTTP error, connection error, an error event in the
stream, no token at all) is recorded as failed with its error; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from fastdeploy.benchmarks.datasets import SampleRequest
from fastdeploy.benchmarks.metrics import BenchmarkMetrics, RequestResult, compute_metrics

ENDPOINTS: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")
BACKENDS: dict[str, str] = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""``--backend`` names (vLLM's client's) and the endpoint each defaults to."""


@dataclass
class ServeConfig:
    """How to send the requests (everything but the samples)."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    num_warmups: int = 0
    disable_tqdm: bool = False
    timeout_s: float = 6 * 3600
    return_token_ids: bool = True
    """Ask for ``return_token_ids`` (off for servers that refuse unknown fields)."""
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(cfg: ServeConfig, sample: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streamed request for ``cfg.endpoint``."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": sample.expected_output_len,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return {**body, **cfg.extra_body}


def chunk_tokens(event: dict[str, Any]) -> tuple[str, int | None]:
    """The generated text of one stream event (completions ``text``, chat ``delta.content`` /
    ``reasoning_content``) and its number of token ids (None when the event carries no ``token_ids``)."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    ids = choice.get("token_ids")
    num_ids = len(ids) if isinstance(ids, list) else None
    if "text" in choice:
        return choice.get("text") or "", num_ids
    delta = choice.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return (delta.get("content") or "") + reasoning, num_ids


async def send_request(
    session: aiohttp.ClientSession, cfg: ServeConfig, sample: SampleRequest
) -> RequestResult:
    """Send one streamed request and time it; never raises (failures go into the result)."""
    result = RequestResult(prompt_len=sample.prompt_len)
    url = cfg.base_url.rstrip("/") + cfg.endpoint
    chunks = 0
    ids_seen: int | None = None
    """Token ids the chunks carried (None: the server sent no ``token_ids``)."""
    usage: dict[str, Any] | None = None
    text_parts: list[str] = []
    start = time.perf_counter()
    result.start_time = start
    last = start
    try:
        async with session.post(url, json=request_body(cfg, sample), headers=cfg.headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                result.latency = time.perf_counter() - start
                return result
            async for raw in response.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error in stream: {json.dumps(event['error'])[:500]}"
                    result.latency = time.perf_counter() - start
                    return result
                if event.get("usage"):
                    usage = event["usage"]
                text, num_ids = chunk_tokens(event)
                if num_ids is not None:
                    ids_seen = (ids_seen or 0) + num_ids
                if text or num_ids:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(text)
        result.latency = time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.latency = time.perf_counter() - start
        return result
    result.generated_text = "".join(text_parts)
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or sample.prompt_len)
    elif ids_seen is not None:  # no usage in the stream: the token ids the chunks carried
        result.output_tokens = ids_seen
    else:  # neither: one token per chunk (a lower bound)
        result.output_tokens = chunks
    if chunks == 0:
        result.error = "no token received"
        return result
    result.success = True
    return result


async def _arrivals(samples: Sequence[SampleRequest], rate: float, rng: random.Random):
    """Yield the samples at Poisson arrival times of ``rate`` per second (``inf``: at once)."""
    for i, sample in enumerate(samples):
        if i and rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
        yield sample


async def run_benchmark(
    cfg: ServeConfig,
    samples: Sequence[SampleRequest],
    slos_ms: dict[str, float] | None = None,
    warmup_samples: Sequence[SampleRequest] | None = None,
) -> tuple[BenchmarkMetrics, list[RequestResult]]:
    """Warm up, send every sample, and compute the metrics; results are in sample order.

    ``cfg.num_warmups`` untimed requests go first, taken from ``warmup_samples``
    (extra samples of the same dataset, so the timed prompts do not hit a prefix
    cache the warm-up filled) or, without them, cycled from ``samples``.
    """
    from tqdm.asyncio import tqdm

    if not samples:
        raise ValueError("no samples to send")
    limit = cfg.max_concurrency
    semaphore = asyncio.Semaphore(limit) if limit else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:

        async def limited(sample: SampleRequest, bar: Any) -> RequestResult:
            if semaphore is None:
                out = await send_request(session, cfg, sample)
            else:
                async with semaphore:
                    out = await send_request(session, cfg, sample)
            if bar is not None:
                bar.update(1)
            return out

        if cfg.num_warmups > 0:
            pool = list(warmup_samples or samples)
            warm = [pool[i % len(pool)] for i in range(cfg.num_warmups)]
            warm_results = await asyncio.gather(*(limited(s, None) for s in warm))
            failed = [r.error for r in warm_results if not r.success]
            if failed:
                print(f"warning: {len(failed)} of {len(warm)} warm-up requests failed: {failed[0]}")

        bar = None if cfg.disable_tqdm else tqdm(total=len(samples), desc="requests")
        rng = random.Random(cfg.seed)
        tasks: list[asyncio.Task[RequestResult]] = []
        start = time.perf_counter()
        async for sample in _arrivals(samples, cfg.request_rate, rng):
            tasks.append(asyncio.create_task(limited(sample, bar)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return compute_metrics(results, duration, slos_ms), results


async def first_model(base_url: str, api_key: str | None) -> str:
    """The first model id of ``GET /v1/models``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(trust_env=False) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers) as response:
            response.raise_for_status()
            data = await response.json()
    return str(data["data"][0]["id"])
