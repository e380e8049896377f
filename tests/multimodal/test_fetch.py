"""fetch_features over a local HTTP server and local files: parallelism, order, failures, limits.

The HTTP server is on loopback, so these fetches use a policy that allows private
addresses (as a server started with --allow-private-media-urls); what the default
policy refuses is tested in test_url_policy.py. The client reads one generic text for
every failed http(s) download; the detail is in the server log."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from fastdeploy.multimodal import (
    FeatureFetchError,
    FeatureItem,
    MultimodalInputError,
    encode_features,
    fetch_features,
)
from fastdeploy.multimodal.sources import HTTP_FETCH_FAILED
from fastdeploy.multimodal.url_policy import MediaUrlPolicy

HIDDEN = 16
GRID = (1, 4, 4)  # 4 rows at merge size 2
DELAY = 0.3
LOCAL = MediaUrlPolicy(allow_private=True)


def feats(seed: int) -> torch.Tensor:
    """A distinct [4, HIDDEN] feature tensor per seed."""
    return torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(4, HIDDEN) + 1000 * seed


def serve(server, n: int, delay: float = DELAY, fmt: str = "npy") -> list[FeatureItem]:
    """Put n distinct feature files on the server; return their items, in order."""
    items = []
    for i in range(n):
        path = f"/f{i}.{fmt}"
        server.files[path] = encode_features(feats(i), fmt)
        server.delays[path] = delay
        items.append(FeatureItem("image", GRID, url=server.url + path, index=i))
    return items


def fetch(items, **kw):
    """fetch_features at the test model's hidden size, private addresses allowed."""
    kw.setdefault("url_policy", LOCAL)
    return fetch_features(items, hidden_size=HIDDEN, spatial_merge_size=2, **kw)


def failed(url: str) -> str:
    """The client-facing text of every failed http(s) download of ``url``, as a regex."""
    return f"cannot fetch multimodal feature {url}: {HTTP_FETCH_FAILED}$"


def logged(caplog, text: str) -> bool:
    """Whether the server log has a warning containing ``text``."""
    return any(r.levelno == logging.WARNING and text in r.getMessage() for r in caplog.records)


def extra_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive, the test servers' own excluded."""
    return [t for t in threading.enumerate() if t not in before and not t.name.startswith("test-server")]


def test_parallel_fetch_takes_the_time_of_one_and_keeps_order(feature_server):
    items = serve(feature_server, 8)
    start = time.perf_counter()
    fetch(items[:1], parallel=8)
    one = time.perf_counter() - start

    start = time.perf_counter()
    parallel = fetch(items, parallel=8)
    t_parallel = time.perf_counter() - start

    start = time.perf_counter()
    serial = fetch(items, parallel=1)
    t_serial = time.perf_counter() - start

    print(f"one item {one:.3f}s, 8 items parallel=8 {t_parallel:.3f}s, parallel=1 {t_serial:.3f}s")
    assert t_parallel < 2 * one
    assert t_serial >= 8 * DELAY
    assert t_parallel < t_serial / 3
    for result in (parallel, serial):
        assert [r.url for r in result] == [i.url for i in items]
        for i, r in enumerate(result):
            assert torch.equal(r.features, feats(i)) and r.mm_hash is not None
    assert [r.mm_hash for r in parallel] == [r.mm_hash for r in serial]
    assert len({r.mm_hash for r in parallel}) == 8


def test_default_parallelism_comes_from_the_env(feature_server, monkeypatch):
    items = serve(feature_server, 4, delay=0.2)
    monkeypatch.setenv("FD_FEATURE_DOWNLOAD_PARALLEL", "1")
    start = time.perf_counter()
    fetch(items)
    assert time.perf_counter() - start >= 4 * 0.2
    monkeypatch.setenv("FD_FEATURE_DOWNLOAD_PARALLEL", "4")
    start = time.perf_counter()
    fetch(items)
    assert time.perf_counter() - start < 3 * 0.2


@pytest.mark.parametrize("parallel", [1, 2])
def test_first_failure_cancels_the_rest(feature_server, parallel, caplog):
    items = serve(feature_server, 8)
    missing = feature_server.url + "/missing.npy"
    items[0] = FeatureItem("image", GRID, url=missing, index=0)
    before = set(threading.enumerate())
    start = time.perf_counter()
    with pytest.raises(FeatureFetchError) as info:
        fetch(items, parallel=parallel)
    elapsed = time.perf_counter() - start
    assert str(info.value) == f"cannot fetch multimodal feature {missing}: {HTTP_FETCH_FAILED}"
    assert logged(caplog, f"{missing}: HTTP 404")  # the detail is for the server log only
    assert info.value.url == missing
    assert elapsed < 4 * DELAY  # did not wait for the remaining downloads
    assert extra_threads(before) == []
    # with 2 threads, item 1 was in flight when item 0 failed; nothing after it started
    first_unstarted = parallel
    assert all(feature_server.counts[f"/f{i}.npy"] == 0 for i in range(first_unstarted, 8))


def test_failure_in_the_middle_names_its_url(feature_server):
    items = serve(feature_server, 8, delay=0.05)
    bad = feature_server.url + "/gone.npy"
    items[5] = FeatureItem("image", GRID, url=bad, index=5)
    before = set(threading.enumerate())
    with pytest.raises(MultimodalInputError, match=failed(bad)):
        fetch(items, parallel=8)
    assert extra_threads(before) == []


def test_wrong_shape_is_an_error_naming_the_url(feature_server, caplog):
    items = serve(feature_server, 3, delay=0)
    feature_server.files["/f1.npy"] = encode_features(torch.zeros(5, HIDDEN), "npy")
    with pytest.raises(
        MultimodalInputError,
        match=rf"{items[1].url}: wrong row count: expected shape \[4, 16\].*got \[5, 16\]",
    ):
        fetch(items, parallel=4)
    feature_server.files["/f1.npy"] = encode_features(torch.zeros(4, 32), "npy")
    with pytest.raises(MultimodalInputError, match=rf"{items[1].url}: wrong width.*got \[4, 32\]"):
        fetch(items, parallel=4)
    feature_server.files["/f1.npy"] = b"garbage, not a tensor file"
    with pytest.raises(FeatureFetchError, match=failed(items[1].url)):
        fetch(items, parallel=1)
    assert logged(caplog, "unrecognised feature file")


def test_safetensors_over_http_and_inline_items(feature_server):
    items = serve(feature_server, 2, delay=0, fmt="safetensors")
    inline = FeatureItem("image", GRID, features=feats(7), index=2)
    out = fetch([*items, inline])
    assert [torch.equal(r.features, feats(i)) for i, r in enumerate(out)] == [True, True, False]
    assert torch.equal(out[2].features, feats(7))
    bad_inline = FeatureItem("image", GRID, features=torch.zeros(4, 3), index=4)
    with pytest.raises(MultimodalInputError, match="image item 4: wrong width"):
        fetch([*items, bad_inline])
    assert feature_server.counts["/f0.safetensors"] == 1  # the bad inline item failed before any fetch


def test_timeout_and_size_limits(feature_server, caplog):
    (slow,) = serve(feature_server, 1, delay=3.0)
    start = time.perf_counter()
    with pytest.raises(FeatureFetchError, match=failed(slow.url)):
        fetch([slow], timeout_s=0.3)
    assert time.perf_counter() - start < 2.0
    assert logged(caplog, "timed out after 0.3 s")
    (item,) = serve(feature_server, 1, delay=0)
    with pytest.raises(FeatureFetchError, match=failed(item.url)):
        fetch([item], max_bytes=100)
    assert logged(caplog, "exceeds the limit of 100 bytes")


def test_a_peer_sending_a_byte_at_a_time_is_cut_at_the_deadline(feature_server, caplog):
    """A download whose peer sends a byte now and then (each read within the socket timeout) ends
    at its deadline, and leaves no thread behind."""
    feature_server.drips["/drip"] = 0.2
    item = FeatureItem("image", GRID, url=feature_server.url + "/drip")
    before = set(threading.enumerate())
    start = time.perf_counter()
    with pytest.raises(FeatureFetchError, match=failed(item.url)):
        fetch([item], timeout_s=1.0)
    assert 0.9 < time.perf_counter() - start < 2.0
    assert logged(caplog, "timed out after 1 s")
    assert extra_threads(before) == []


def test_cancel_stops_a_download_at_once(feature_server):
    """Setting the request's cancel flag (its client has gone) ends a stalled download at once."""
    from fastdeploy.multimodal.sources import FetchCancelled

    feature_server.drips["/drip"] = 5.0  # one byte, then nothing for the test's length
    item = FeatureItem("image", GRID, url=feature_server.url + "/drip")
    cancel = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            fetch([item], timeout_s=30, cancel=cancel)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.5)
    cancel.set()
    worker.join(timeout=1.0)
    assert not worker.is_alive() and isinstance(outcome[0], FetchCancelled)


def test_a_request_s_files_share_one_byte_cap(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.npy").write_bytes(encode_features(feats(1), "npy"))  # 384 bytes each
    items = [
        FeatureItem("image", GRID, url=f"file://{tmp_path}/{name}.npy", index=i)
        for i, name in enumerate("ab")
    ]
    assert len(fetch(items, allowed_local_media_path=str(tmp_path), request_max_bytes=1000)) == 2
    with pytest.raises(FeatureFetchError, match="exceed the limit of 500 bytes together"):
        fetch(items, allowed_local_media_path=str(tmp_path), request_max_bytes=500, parallel=1)


def test_malformed_urls_fifos_and_long_urls_are_client_errors(tmp_path):
    with pytest.raises(FeatureFetchError, match="malformed URL"):
        fetch([FeatureItem("image", GRID, url="http://[::1/x.npy")])
    with pytest.raises(FeatureFetchError, match="malformed path"):
        fetch(
            [FeatureItem("image", GRID, url=f"file://{tmp_path}/a%00.npy")],
            allowed_local_media_path=str(tmp_path),
        )
    os.mkfifo(tmp_path / "pipe.npy")  # opening it would block until a writer came
    start = time.perf_counter()
    with pytest.raises(FeatureFetchError, match="not a regular file"):
        fetch(
            [FeatureItem("image", GRID, url=f"file://{tmp_path}/pipe.npy")],
            allowed_local_media_path=str(tmp_path),
        )
    assert time.perf_counter() - start < 1.0
    long_url = "ftp://host/" + "a" * 100_000
    with pytest.raises(FeatureFetchError) as err:
        fetch([FeatureItem("image", GRID, url=long_url)])
    assert len(str(err.value)) < 500 and "(100011 characters)" in str(err.value)


def test_errors_name_the_item_s_request_field(feature_server, tmp_path):
    item = FeatureItem(
        "image", GRID, url=feature_server.url + "/missing.npy", location="messages[1].content[2]"
    )
    with pytest.raises(FeatureFetchError) as err:
        fetch([item])
    assert err.value.param == "messages[1].content[2]"
    wrong = FeatureItem("image", GRID, features=torch.zeros(4, 3), location="messages[0].content[0]")
    with pytest.raises(MultimodalInputError, match=r"messages\[0\]\.content\[0\]: wrong width") as err:
        fetch([wrong])
    assert err.value.param == "messages[0].content[0]"


def test_unsupported_scheme_fails_before_fetching(feature_server):
    items = serve(feature_server, 2, delay=0)
    with pytest.raises(FeatureFetchError, match="unsupported URL scheme 'ftp'"):
        fetch([*items, FeatureItem("image", GRID, url="ftp://host/x.npy", index=2)])
    assert sum(feature_server.counts.values()) == 0


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.npy").write_bytes(encode_features(feats(1), "npy"))
    (tmp_path / "secret.npy").write_bytes(encode_features(feats(2), "npy"))
    os.symlink(tmp_path / "secret.npy", allowed / "link.npy")

    inside = FeatureItem("image", GRID, url=f"file://{allowed}/a.npy")
    (out,) = fetch([inside], allowed_local_media_path=str(allowed))
    assert torch.equal(out.features, feats(1))
    with pytest.raises(FeatureFetchError, match="without --allowed-local-media-path"):
        fetch([inside])
    for url in (
        f"file://{tmp_path}/secret.npy",
        f"file://{allowed}/../secret.npy",
        f"file://{allowed}/link.npy",
    ):
        with pytest.raises(
            FeatureFetchError, match=f"{url}: the path lies outside --allowed-local-media-path"
        ):
            fetch([FeatureItem("image", GRID, url=url)], allowed_local_media_path=str(allowed))
    with pytest.raises(FeatureFetchError, match="cannot read the file"):
        fetch(
            [FeatureItem("image", GRID, url=f"file://{allowed}/nope.npy")],
            allowed_local_media_path=str(allowed),
        )


def test_latency_is_observed_per_url(feature_server):
    items = serve(feature_server, 3, delay=0.1)
    seen: list[float] = []
    fetch(items, parallel=3, observe_latency=seen.append)
    assert len(seen) == 3 and all(0.1 <= s < 2.0 for s in seen)
