"""Fetch, load, check and hash the feature items of one request, in parallel.

:func:`fetch_features` is the one entry point: it takes a request's
:class:`~fastdeploy.multimodal.inputs.FeatureItem` list and returns the same
items, in the same order, each with its ``features`` tensor and ``mm_hash``.

- Distinct URLs are downloaded by a thread pool of ``parallel`` threads
  (``FD_FEATURE_DOWNLOAD_PARALLEL``, 1 = serially in the calling thread); a URL
  that appears twice in a request is downloaded once.
- The first failure fails the request: downloads not yet started are cancelled,
  those in flight stop at their next chunk, and the error (a
  :class:`~fastdeploy.multimodal.inputs.MultimodalInputError` naming the URL) is
  raised once the pool has shut down, so no thread outlives the call.
- ``http(s)://`` URLs must pass the server's
  :class:`~fastdeploy.multimodal.url_policy.MediaUrlPolicy` (no private addresses
  by default), and every failed download, an unloadable file included, reads the
  same to the client (the detail goes to the server log).
- With an :class:`~fastdeploy.multimodal.encoder_cache.EncoderCacheManager`,
  a URL fetched before (``FD_FEATURE_URL_CACHE``) is served from the cache
  without a download, and equal content from another URL reuses the cached tensor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import httpx
import torch

from fastdeploy import envs
from fastdeploy.multimodal.hashing import mm_hash
from fastdeploy.multimodal.inputs import (
    FeatureFetchError,
    FeatureItem,
    MultimodalInputError,
    validate_features,
)
from fastdeploy.multimodal.loaders import load_feature_bytes
from fastdeploy.multimodal.sources import (
    FetchCancelled,
    RequestBytes,
    http_fetch_failed,
    new_http_client,
    read_url,
    scheme_of,
    source_key,
)
from fastdeploy.multimodal.url_policy import MediaUrlPolicy

if TYPE_CHECKING:
    from fastdeploy.multimodal.encoder_cache import EncoderCacheManager

MIB = 1 << 20


@dataclass
class _Job:
    """One distinct URL to download and the request items that use it."""

    url: str
    key: str
    """The URL's source key (what the encoder cache's URL index is keyed by)."""
    items: list[tuple[int, FeatureItem]]
    """(position in the request, item) of every item with this URL."""


@dataclass
class _Limits:
    """What every download of one call shares."""

    hidden_size: int
    spatial_merge_size: int
    timeout_s: float
    max_bytes: int
    allowed_local_media_path: str | None
    url_policy: MediaUrlPolicy
    http_client: httpx.Client | None
    cancel: threading.Event
    observe_latency: Callable[[float], None] | None
    request_bytes: RequestBytes


def _alias(item: FeatureItem, key: str) -> str:
    """URL-index key of an item: its source plus what else enters its hash."""
    return f"{item.modality}|{list(item.grid_thw)}|{key}"


def _checked(item: FeatureItem, features: torch.Tensor, limits: _Limits) -> FeatureItem:
    try:
        validate_features(features, item.grid_thw, limits.hidden_size, limits.spatial_merge_size, item.label)
    except MultimodalInputError as exc:
        raise item.located(exc) from None
    return item.with_features(features, mm_hash(features, item.modality, item.grid_thw))


def _run_job(job: _Job, limits: _Limits) -> list[FeatureItem]:
    """Download, load, check and hash one URL's items (runs in a pool thread or the caller's)."""
    if limits.cancel.is_set():
        raise FetchCancelled(job.url)
    start = time.monotonic()
    first = job.items[0][1]
    try:
        data = read_url(
            job.url,
            timeout_s=limits.timeout_s,
            max_bytes=limits.max_bytes,
            allowed_local_media_path=limits.allowed_local_media_path,
            http_client=limits.http_client,
            cancel=limits.cancel,
            url_policy=limits.url_policy,
            request_bytes=limits.request_bytes,
        )
        features = load_feature_bytes(data)
    except FeatureFetchError as exc:
        raise first.located(exc) from None
    except MultimodalInputError as exc:
        if scheme_of(job.url) in ("http", "https"):  # the same text as a failed download
            raise first.located(http_fetch_failed(job.url, str(exc))) from None
        raise first.located(MultimodalInputError(f"{job.url}: {exc}")) from None
    if limits.observe_latency is not None:
        limits.observe_latency(time.monotonic() - start)
    return [_checked(item, features, limits) for _, item in job.items]


def _run_jobs(jobs: list[_Job], parallel: int, limits: _Limits) -> list[list[FeatureItem]]:
    """Results of ``jobs`` in order; the first failure cancels the rest and is raised."""
    if parallel <= 1 or len(jobs) <= 1:
        return [_run_job(job, limits) for job in jobs]
    lock = threading.Lock()
    first_error: list[Exception] = []

    def task(job: _Job) -> list[FeatureItem]:
        try:
            return _run_job(job, limits)
        except Exception as exc:
            with lock:
                if not first_error and not isinstance(exc, FetchCancelled):
                    first_error.append(exc)
                limits.cancel.set()  # jobs not yet started skip themselves; running ones stop
            raise

    pool = ThreadPoolExecutor(max_workers=min(parallel, len(jobs)), thread_name_prefix="fd-feature-fetch")
    try:
        futures = [pool.submit(task, job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:
        limits.cancel.set()  # a no-op when all succeeded; stops the rest on a failure or interrupt
        pool.shutdown(wait=True, cancel_futures=True)
    if first_error:
        raise first_error[0]
    return [future.result() for future in futures]


def fetch_features(
    items: Sequence[FeatureItem],
    *,
    hidden_size: int,
    spatial_merge_size: int = 2,
    parallel: int | None = None,
    allowed_local_media_path: str | None = None,
    url_policy: MediaUrlPolicy | None = None,
    timeout_s: float | None = None,
    max_bytes: int | None = None,
    cache: EncoderCacheManager | None = None,
    observe_latency: Callable[[float], None] | None = None,
    cancel: threading.Event | None = None,
    request_max_bytes: int | None = None,
) -> list[FeatureItem]:
    """Load every item of a request and return them in request order with ``features`` and ``mm_hash``.

    Items given inline are checked and hashed; URL items are fetched (file://
    only under ``allowed_local_media_path``; http(s):// only where ``url_policy``
    allows, by default public addresses of any host). Every feature must be float,
    ``[t*h*w / spatial_merge_size**2, hidden_size]``. ``parallel``,
    ``timeout_s`` (per URL) and ``max_bytes`` (per URL) default to
    ``FD_FEATURE_DOWNLOAD_PARALLEL``, ``FD_FEATURE_FETCH_TIMEOUT_S`` and
    ``FD_FEATURE_MAX_MB``; ``request_max_bytes`` (all the URLs' bytes together)
    ``FD_FEATURE_REQUEST_MAX_MB``. ``observe_latency`` receives the seconds each
    successful download plus load took (e.g. ``EngineMetrics.on_feature_fetch``).
    Setting ``cancel`` (e.g. when the client has gone) stops the downloads at once.

    Raises :class:`MultimodalInputError` (a ``ValueError``; :class:`FeatureFetchError`
    for download failures) naming the failing URL or item: a client error.
    """
    parallel = envs.FD_FEATURE_DOWNLOAD_PARALLEL if parallel is None else parallel
    limits = _Limits(
        hidden_size=hidden_size,
        spatial_merge_size=spatial_merge_size,
        timeout_s=envs.FD_FEATURE_FETCH_TIMEOUT_S if timeout_s is None else timeout_s,
        max_bytes=int(envs.FD_FEATURE_MAX_MB * MIB) if max_bytes is None else max_bytes,
        allowed_local_media_path=allowed_local_media_path,
        url_policy=url_policy if url_policy is not None else MediaUrlPolicy(),
        http_client=None,
        cancel=cancel if cancel is not None else threading.Event(),
        observe_latency=observe_latency,
        request_bytes=RequestBytes(
            int(envs.FD_FEATURE_REQUEST_MAX_MB * MIB) if request_max_bytes is None else request_max_bytes
        ),
    )
    url_index = cache if cache is not None and envs.FD_FEATURE_URL_CACHE else None
    results: list[FeatureItem | None] = [None] * len(items)
    jobs: dict[str, _Job] = {}
    for i, item in enumerate(items):
        if item.url is None:
            assert item.features is not None
            checked = _checked(item, item.features, limits)
            results[i] = checked if cache is None else _through_cache(cache, checked, None)
            continue
        scheme_of(item.url)  # an unsupported scheme fails the request before anything is fetched
        key = item.url
        if url_index is not None:
            key = source_key(item.url, allowed_local_media_path)
            cached_hash = url_index.lookup_source(_alias(item, key))
            cached = url_index.get(cached_hash) if cached_hash is not None else None
            if cached_hash is not None and cached is not None:
                results[i] = item.with_features(cached, cached_hash)
                continue
        jobs.setdefault(key, _Job(item.url, key, [])).items.append((i, item))

    job_list = list(jobs.values())
    if any(scheme_of(job.url) in ("http", "https") for job in job_list):
        limits.http_client = new_http_client()
    try:
        fetched = _run_jobs(job_list, parallel, limits)
    finally:
        if limits.http_client is not None:
            limits.http_client.close()

    for job, loaded in zip(job_list, fetched):
        for (i, _), item in zip(job.items, loaded):
            if cache is not None:
                item = _through_cache(cache, item, _alias(item, job.key) if url_index is not None else None)
            results[i] = item
    return cast("list[FeatureItem]", results)  # every position was filled above


def _through_cache(cache: EncoderCacheManager, item: FeatureItem, alias: str | None) -> FeatureItem:
    """Reuse the cached tensor of equal content (a hit), else cache this one (a miss)."""
    assert item.mm_hash is not None and item.features is not None
    cached = cache.get(item.mm_hash)
    cache.put(item.mm_hash, cached if cached is not None else item.features, source=alias)
    return item if cached is None else item.with_features(cached, item.mm_hash)
