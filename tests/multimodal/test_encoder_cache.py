"""EncoderCacheManager (LRU, budget, pins, stats), its use by fetch_features, and the metrics."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fastdeploy.config import CacheConfig
from fastdeploy.metrics import REGISTRY, EngineMetrics
from fastdeploy.multimodal import FeatureItem, encode_features, fetch_features
from fastdeploy.multimodal.encoder_cache import GIB, EncoderCacheManager
from fastdeploy.multimodal.url_policy import MediaUrlPolicy

KIB = 1024


def t(kib: int, value: float = 0.0) -> torch.Tensor:
    """A float32 tensor of ``kib`` KiB."""
    return torch.full((kib, 256), value, dtype=torch.float32)


def test_lru_eviction_within_budget():
    cache = EncoderCacheManager(3 * KIB)
    for h in "abc":
        assert cache.put(h, t(1))
    assert cache.bytes_used == 3 * KIB and len(cache) == 3
    assert cache.get("a") is not None  # a is now most recently used: b is the LRU entry
    assert cache.put("d", t(1))
    assert [cache.contains(h) for h in "abcd"] == [True, False, True, True]
    assert cache.put("e", t(2))  # needs two evictions: c then a
    assert [cache.contains(h) for h in "acde"] == [False, False, True, True]
    assert cache.bytes_used == 3 * KIB


def test_evictions_are_reported_for_mirrors():
    cache = EncoderCacheManager(2 * KIB, track_evictions=True)
    for h in "abc":
        cache.put(h, t(1))
    cache.pin("req", "b")
    cache.put("d", t(1))  # b is pinned: c goes
    assert cache.take_evicted() == ["a", "c"]
    assert cache.take_evicted() == []
    with pytest.raises(RuntimeError, match="track_evictions"):
        EncoderCacheManager(KIB).take_evicted()


def test_item_larger_than_budget_is_not_cached():
    cache = EncoderCacheManager(2 * KIB)
    cache.put("a", t(1))
    assert not cache.put("big", t(3))
    assert not cache.contains("big") and cache.contains("a")  # nothing was evicted for it
    assert not EncoderCacheManager(0).put("x", t(1))
    with pytest.raises(ValueError):
        EncoderCacheManager(-1)


def test_hits_misses_and_stats():
    cache = EncoderCacheManager(4 * KIB)
    x = t(1, 3.0)
    assert cache.get("x") is None
    cache.put("x", x)
    assert cache.get("x") is x and cache.get("x") is x
    assert (cache.hits, cache.misses) == (2, 1)
    assert cache.take_stats() == (2, 1)
    assert cache.get("y") is None
    assert cache.take_stats() == (0, 1)
    assert cache.contains("x") and cache.take_stats() == (0, 0)  # contains() is not a lookup


def test_pinned_entries_are_not_evicted():
    cache = EncoderCacheManager(2 * KIB)
    cache.put("a", t(1))
    cache.put("b", t(1))
    assert cache.pin("req-1", "a") and cache.pin("req-2", "a")
    assert not cache.pin("req-1", "missing")
    assert cache.put("c", t(1))  # evicts b, the only unpinned entry, though a is older
    assert cache.contains("a") and not cache.contains("b")
    assert cache.pin("req-1", "c")
    assert not cache.put("d", t(1))  # everything left is pinned: d is not cached
    cache.release("req-1")
    assert cache.is_pinned("a") and not cache.is_pinned("c")  # req-2 still holds a
    assert cache.put("d", t(1)) and not cache.contains("c")
    cache.release("req-2")
    cache.release("req-unknown")
    assert cache.put("e", t(1)) and not cache.contains("a")


def test_url_index_follows_eviction():
    cache = EncoderCacheManager(1 * KIB)
    cache.put("a", t(1), source="http://h/a.npy")
    assert cache.lookup_source("http://h/a.npy") == "a"
    cache.put("b", t(1), source="http://h/b.npy")
    assert cache.lookup_source("http://h/a.npy") is None and cache.lookup_source("http://h/b.npy") == "b"


def test_budget_from_config():
    assert CacheConfig().encoder_cache_memory == 0.5
    assert EncoderCacheManager.from_gib(CacheConfig().encoder_cache_memory).budget_bytes == GIB // 2


LOCAL = MediaUrlPolicy(allow_private=True)
"""The test file server is on loopback: allow private addresses (--allow-private-media-urls)."""


def _item(server, name: str, tensor: torch.Tensor) -> FeatureItem:
    server.files[f"/{name}"] = encode_features(tensor, "npy")
    return FeatureItem("image", (1, 4, 4), url=f"{server.url}/{name}")


def test_repeated_url_is_not_fetched_again(feature_server):
    cache = EncoderCacheManager(GIB)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    a, b = _item(feature_server, "a.npy", x), _item(feature_server, "b.npy", y)
    first = fetch_features([a, b], hidden_size=16, url_policy=LOCAL, cache=cache)
    assert cache.take_stats() == (0, 2)
    second = fetch_features([b, a], hidden_size=16, url_policy=LOCAL, cache=cache)
    assert feature_server.counts == {"/a.npy": 1, "/b.npy": 1}  # served from the cache
    assert cache.take_stats() == (2, 0)
    assert [r.mm_hash for r in second] == [first[1].mm_hash, first[0].mm_hash]
    assert second[0].features is first[1].features
    # the same URL with another grid_thw is another item: fetched and hashed anew
    other_grid = FeatureItem("image", (1, 2, 8), url=a.url)
    (z,) = fetch_features([other_grid], hidden_size=16, url_policy=LOCAL, cache=cache)
    assert feature_server.counts["/a.npy"] == 2 and z.mm_hash != first[0].mm_hash


def test_same_content_from_another_url_is_a_hit(feature_server, monkeypatch):
    cache = EncoderCacheManager(GIB)
    x = torch.randn(4, 16)
    a, copy = _item(feature_server, "a.npy", x), _item(feature_server, "copy.npy", x.clone())
    (first,) = fetch_features([a], hidden_size=16, url_policy=LOCAL, cache=cache)
    (second,) = fetch_features([copy], hidden_size=16, url_policy=LOCAL, cache=cache)
    assert second.mm_hash == first.mm_hash and second.features is first.features
    assert cache.take_stats() == (1, 1) and len(cache) == 1
    monkeypatch.setenv("FD_FEATURE_URL_CACHE", "0")
    fetch_features([a], hidden_size=16, url_policy=LOCAL, cache=cache)
    assert feature_server.counts["/a.npy"] == 2  # URL index off: fetched again, still a content hit
    assert cache.take_stats() == (1, 0)


def test_duplicate_url_in_one_request_is_fetched_once(feature_server):
    x = torch.randn(4, 16)
    a = _item(feature_server, "a.npy", x)
    out = fetch_features([a, a, a], hidden_size=16, url_policy=LOCAL, parallel=4)
    assert feature_server.counts["/a.npy"] == 1 and all(torch.equal(r.features, x) for r in out)


def _samples(model: str) -> dict[str, float]:
    text = generate_latest(REGISTRY).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name") == model and "le" not in s.labels
    }


def test_metrics(feature_server):
    metrics = EngineMetrics("mm-test-model")
    before = _samples("mm-test-model")
    assert before["fastdeploy:encoder_cache_hits_total"] == 0
    assert before["fastdeploy:feature_fetch_latency_seconds_count"] == 0
    cache = EncoderCacheManager(GIB)
    item = _item(feature_server, "m.npy", torch.randn(4, 16))
    for _ in range(3):
        fetch_features(
            [item], hidden_size=16, url_policy=LOCAL, cache=cache, observe_latency=metrics.on_feature_fetch
        )
    metrics.on_encoder_cache(*cache.take_stats())
    after = _samples("mm-test-model")
    assert after["fastdeploy:encoder_cache_hits_total"] == 2
    assert after["fastdeploy:encoder_cache_misses_total"] == 1
    assert after["fastdeploy:feature_fetch_latency_seconds_count"] == 1
    assert after["fastdeploy:feature_fetch_latency_seconds_sum"] > 0
