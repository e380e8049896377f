"""bos:// URLs through the real bce-python-sdk BosClient against a local BOS GetObject endpoint
that checks the request's BCE v1 signature."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastdeploy.multimodal import FeatureFetchError, FeatureItem, encode_features, fetch_features

HIDDEN = 16
GRID = (1, 4, 4)


def feats(seed: int) -> torch.Tensor:
    """A distinct [4, HIDDEN] feature tensor per seed."""
    return torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(seed))


def put(server, key: str, tensor: torch.Tensor, fmt: str = "npy", delay: float = 0.0) -> FeatureItem:
    server.files[f"/feature-bucket/{key}"] = encode_features(tensor, fmt)
    server.delays[f"/feature-bucket/{key}"] = delay
    return FeatureItem("video", GRID, url=f"bos://feature-bucket/{key}")


def fetch(items, **kw):
    """fetch_features at the test model's hidden size."""
    return fetch_features(items, hidden_size=HIDDEN, **kw)


def test_bos_get_object_through_the_sdk(bos_server):
    a = put(bos_server, "clips/a.npy", feats(1))
    b = put(bos_server, "clips/b.safetensors", feats(2), fmt="safetensors")
    out = fetch([a, b])
    assert torch.equal(out[0].features, feats(1)) and torch.equal(out[1].features, feats(2))
    # the server only answers 200 to a request whose BCE v1 signature matches the test AK/SK
    assert bos_server.counts["/feature-bucket/clips/a.npy"] == 1
    assert bos_server.counts["/feature-bucket/clips/b.safetensors"] == 1


def test_bos_parallel(bos_server):
    items = [put(bos_server, f"k{i}.npy", feats(i), delay=0.3) for i in range(8)]
    start = time.perf_counter()
    out = fetch(items, parallel=8)
    elapsed = time.perf_counter() - start
    print(f"8 BOS objects with 0.3 s delay each, parallel=8: {elapsed:.3f}s")
    assert elapsed < 4 * 0.3
    assert all(torch.equal(r.features, feats(i)) for i, r in enumerate(out))


def test_bos_missing_key_names_the_url(bos_server):
    good = put(bos_server, "x.npy", feats(0))
    missing = FeatureItem("image", GRID, url="bos://feature-bucket/nope.npy")
    before = set(threading.enumerate())
    with pytest.raises(
        FeatureFetchError, match=r"bos://feature-bucket/nope.npy: BOS GetObject failed: HTTP 404 NoSuchKey"
    ):
        fetch([good, missing], parallel=2)
    assert [
        t for t in threading.enumerate() if t not in before and not t.name.startswith("test-server")
    ] == []


def test_bos_wrong_secret_is_refused(bos_server, monkeypatch):
    item = put(bos_server, "x.npy", feats(0))
    monkeypatch.setenv("FD_BOS_SECRET_KEY", "wrong-secret")
    with pytest.raises(FeatureFetchError, match="HTTP 403 AccessDenied signature mismatch"):
        fetch([item])


def test_bos_needs_configuration(monkeypatch):
    for name in ("FD_BOS_ENDPOINT", "FD_BOS_ACCESS_KEY", "FD_BOS_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        FeatureFetchError, match="need FD_BOS_ENDPOINT, FD_BOS_ACCESS_KEY and FD_BOS_SECRET_KEY"
    ):
        fetch([FeatureItem("image", GRID, url="bos://b/k.npy")])
    monkeypatch.setenv("FD_BOS_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("FD_BOS_ACCESS_KEY", "ak")
    monkeypatch.setenv("FD_BOS_SECRET_KEY", "sk")
    with pytest.raises(FeatureFetchError, match="must be bos://bucket/key"):
        fetch([FeatureItem("image", GRID, url="bos://bucket-only")])
