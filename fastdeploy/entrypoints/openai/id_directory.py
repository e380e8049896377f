"""A directory of files named by object ids, that every API server process of a server shares: the
storage under the stored responses (:mod:`.responses_store`) and the Files / Batches APIs
(:mod:`.batch_api`).

Only an id that matches its kind's pattern (the ids this server gives) names a path, so a request
cannot reach a file outside the directory. A file is written beside its final name and moved in
(a reader never sees half a file), read back only as bytes or JSON (never executed or unpickled),
and an empty marker file beside an object (a cancel asked of whichever process runs it) is set,
tested and cleared by name. The directory is the one given (set by ``serve`` for several API
servers, which removes it at exit) or else a private temporary one, made on first use and removed
when the owner closes it or is collected.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import weakref
from typing import Any


class IdDirectory:
    """Files named ``<id><suffix>`` in one directory (module docstring)."""

    def __init__(self, directory: str | None, temp_prefix: str):
        self._directory = directory or None
        self._temp_prefix = temp_prefix
        self._cleanup: weakref.finalize | None = None

    @property
    def directory(self) -> str | None:
        """The directory (None: a private one not made yet, as nothing was stored)."""
        return self._directory

    def path(self, pattern: re.Pattern[str], object_id: str, suffix: str = ".json") -> str | None:
        """Where ``object_id`` keeps its ``suffix`` file; None if the id does not match ``pattern``."""
        if not pattern.fullmatch(object_id):
            return None
        if self._directory is None:
            self._directory = tempfile.mkdtemp(prefix=self._temp_prefix)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._directory, True)
        return os.path.join(self._directory, f"{object_id}{suffix}")

    def ids(self, pattern: re.Pattern[str], suffix: str = ".json") -> list[str]:
        """The ids matching ``pattern`` that have a ``suffix`` file."""
        if self._directory is None or not os.path.isdir(self._directory):
            return []
        names = (n[: -len(suffix)] for n in os.listdir(self._directory) if n.endswith(suffix))
        return [name for name in names if pattern.fullmatch(name)]

    def size(self, suffix: str) -> int:
        """Bytes of every ``suffix`` file in the directory (every process's)."""
        if self._directory is None or not os.path.isdir(self._directory):
            return 0
        with os.scandir(self._directory) as entries:
            return sum(e.stat().st_size for e in entries if e.name.endswith(suffix) and e.is_file())

    @staticmethod
    def write(path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically (beside it, then moved in)."""
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    @staticmethod
    def read_bytes(path: str | None) -> bytes | None:
        """The bytes at ``path`` (None: no such file, or no path)."""
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            return None

    @classmethod
    def read_json(cls, path: str | None) -> Any | None:
        """The JSON value at ``path`` (None: no such file, no path, or not JSON)."""
        data = cls.read_bytes(path)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return None

    @staticmethod
    def remove(path: str | None) -> bool:
        """Delete ``path``; whether it was there."""
        if path is None:
            return False
        try:
            os.unlink(path)
        except OSError:
            return False
        return True

    def set_marker(self, pattern: re.Pattern[str], object_id: str, name: str) -> None:
        """Leave the empty marker ``name`` beside ``object_id`` (e.g. ``"cancel"``)."""
        path = self.path(pattern, object_id, f".{name}")
        if path is not None:
            self.write(path, b"")

    def has_marker(self, pattern: re.Pattern[str], object_id: str, name: str) -> bool:
        """Whether the marker ``name`` of ``object_id`` is set."""
        path = self.path(pattern, object_id, f".{name}")
        return path is not None and os.path.exists(path)

    def clear_marker(self, pattern: re.Pattern[str], object_id: str, name: str) -> None:
        """Drop the marker ``name`` of ``object_id`` (if set)."""
        self.remove(self.path(pattern, object_id, f".{name}"))

    def close(self) -> None:
        """Remove the private directory (a given one belongs to whoever gave it)."""
        if self._cleanup is not None:
            self._cleanup()
