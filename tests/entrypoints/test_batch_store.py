"""The Files and Batches API's store: file objects and bytes by id, newest first, ids of the server's
own format only (nothing else names a path), the storage bound, a cancel marker any process sees."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.openai.batch_api import BatchStore, new_batch
from fastdeploy.entrypoints.openai.errors import BadRequestError, NotFoundError


def test_files_by_id_newest_first_and_deleted(tmp_path):
    store = BatchStore(str(tmp_path))
    first = store.save_file(b"a\n", "a.jsonl", "batch")
    second = store.save_file(b"bb\n", "b.jsonl", "batch")
    assert first["id"].startswith("file-") and first["bytes"] == 2 and first["object"] == "file"
    assert store.file(second["id"]) == second and store.file_content(second["id"]) == b"bb\n"
    assert {f["id"] for f in store.files()} == {first["id"], second["id"]}
    assert BatchStore(str(tmp_path)).file(first["id"]) == first  # (another process's view)
    assert store.delete_file(first["id"]) == {"id": first["id"], "object": "file", "deleted": True}
    with pytest.raises(NotFoundError):
        store.file(first["id"])
    for bad in ("../etc/passwd", "file-" + "0" * 31, "file-" + "0" * 32 + "/x", second["id"].upper()):
        with pytest.raises(NotFoundError):
            store.file_content(bad)


def test_storage_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_BATCH_STORE_MB", str(10 / 2**20))  # 10 bytes
    store = BatchStore(str(tmp_path))
    kept = store.save_file(b"12345678", "a", "batch")
    with pytest.raises(BadRequestError, match="FD_BATCH_STORE_MB"):
        store.save_file(b"123", "b", "batch")
    store.delete_file(kept["id"])
    store.save_file(b"123", "b", "batch")


def test_batches_and_the_cancel_marker(tmp_path):
    store = BatchStore(str(tmp_path))
    batch = new_batch("file-" + "1" * 32, "/v1/completions", "24h", {"k": "v"})
    store.save_batch(batch)
    assert store.batch(batch["id"]) == batch and store.batches() == [batch]
    other = BatchStore(str(tmp_path))
    assert not other.cancel_requested(batch["id"])
    store.request_cancel(batch["id"])
    assert other.cancel_requested(batch["id"])
    with pytest.raises(NotFoundError):
        store.batch("batch_" + "2" * 32)
