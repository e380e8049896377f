"""The stored responses of ``/v1/responses`` (``store: true``): one JSON file per response in a
directory every API server process of the server shares, so that ``GET /v1/responses/{id}`` and
``previous_response_id`` work whichever process a connection lands on.

A stored response holds the response object, the chat messages of its turn (its input, without
the instructions, then its output) and the id of the response it continued: a conversation is
read back by following ``previous_response_id`` links. Each process bounds what it wrote itself
(``FD_RESPONSES_STORE_MB``), dropping its oldest first. The directory is ``FD_RESPONSES_STORE_DIR``
(set by ``serve`` for several API servers, removed by it at exit) or else a private temporary one,
made on the first store and removed when the process ends. Nothing from these files is executed
or unpickled: they are JSON, read back only by id (checked against the id format).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from fastdeploy import envs
from fastdeploy.entrypoints.openai.id_directory import IdDirectory

logger = logging.getLogger(__name__)

_ID = re.compile(r"resp_[0-9a-f]{32}")
"""The ids this server gives (``new_id("resp")``): nothing else names a file."""

MAX_CHAIN = 10_000
"""Most responses one ``previous_response_id`` chain may follow (a cycle cannot be made, but a
damaged directory must not loop forever)."""


@dataclass
class StoredResponse:
    """One stored response."""

    response: dict[str, Any]
    """The response object, as ``GET /v1/responses/{id}`` returns it."""
    messages: list[dict[str, Any]]
    """This turn as chat messages: its input (not its instructions), then its output."""
    input_items: list[dict[str, Any]] = field(default_factory=list)
    """Its ``input`` items, as ``GET /v1/responses/{id}/input_items`` lists them."""
    previous_response_id: str | None = None


class ResponseStore:
    """Stored responses in a directory (module docstring); safe to call from several threads."""

    def __init__(self, directory: str | None = None, max_bytes: int | None = None):
        self._files = IdDirectory(directory or envs.FD_RESPONSES_STORE_DIR, "fastdeploy-responses-")
        self.max_bytes = int(envs.FD_RESPONSES_STORE_MB * 2**20) if max_bytes is None else max_bytes
        """Bytes of files this process keeps (0: nothing is stored)."""
        self._written: OrderedDict[str, int] = OrderedDict()
        """Ids this process stored, oldest first, with their file sizes."""
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether responses are stored at all."""
        return self.max_bytes > 0

    @property
    def directory(self) -> str | None:
        """Where the responses are (None: a private directory not made yet)."""
        return self._files.directory

    def _path(self, response_id: str) -> str | None:
        return self._files.path(_ID, response_id)

    def save(self, response_id: str, stored: StoredResponse) -> bool:
        """Store a response (its oldest ones dropped past the byte bound); whether it was stored (a
        full or unwritable disk is logged, and the response is just not kept)."""
        if not self.enabled:
            return False
        data = json.dumps(asdict(stored), ensure_ascii=False).encode()
        try:
            path = self._path(response_id)
            if path is None:
                return False
            self._files.write(path, data)
        except OSError as exc:
            logger.warning("could not store response %s in %s: %s", response_id, self.directory, exc)
            return False
        with self._lock:
            self._bytes += len(data) - self._written.pop(response_id, 0)  # (a background response is
            self._written[response_id] = len(data)  # saved again as it progresses)
            while self._bytes > self.max_bytes and len(self._written) > 1:
                old, size = self._written.popitem(last=False)
                self._bytes -= size
                self._unlink(old)
        return True

    def load(self, response_id: str) -> StoredResponse | None:
        """The stored response ``response_id`` (None: never stored, dropped or deleted)."""
        data = self._files.read_json(self._path(response_id))
        return StoredResponse(**data) if isinstance(data, dict) else None

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; whether it was stored."""
        with self._lock:
            self._bytes -= self._written.pop(response_id, 0)
        return self._unlink(response_id)

    def _unlink(self, response_id: str) -> bool:
        self.clear_cancel(response_id)
        return self._files.remove(self._path(response_id))

    def request_cancel(self, response_id: str) -> None:
        """Ask the process running background response ``response_id`` to cancel it (a marker file
        it polls: the cancel may reach another API server process than the one running it)."""
        if self.enabled:
            self._files.set_marker(_ID, response_id, "cancel")

    def cancel_requested(self, response_id: str) -> bool:
        """Whether a cancel of ``response_id`` was asked (:meth:`request_cancel`)."""
        return self._files.has_marker(_ID, response_id, "cancel")

    def clear_cancel(self, response_id: str) -> None:
        """Drop the cancel marker of ``response_id`` (its run is over)."""
        self._files.clear_marker(_ID, response_id, "cancel")

    def conversation(
        self, response_id: str, loaded: StoredResponse | None = None
    ) -> list[dict[str, Any]] | None:
        """The chat messages of every turn up to and including ``response_id``, oldest first
        (None: a response of the chain is not stored). ``loaded``: ``response_id``'s stored
        response, when the caller has read it already."""
        turns: list[list[dict[str, Any]]] = []
        current: str | None = response_id
        while current is not None and len(turns) < MAX_CHAIN:
            stored = loaded if loaded is not None and current == response_id else self.load(current)
            if stored is None:
                return None
            turns.append(stored.messages)
            current = stored.previous_response_id
        return [message for turn in reversed(turns) for message in turn]

    def close(self) -> None:
        """Remove the private directory (a shared one belongs to ``serve``)."""
        self._files.close()
