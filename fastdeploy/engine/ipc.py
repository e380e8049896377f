"""Plumbing shared by the engine's processes: ZMQ addresses, msgpack frames, child-process hygiene."""

from __future__ import annotations

import ctypes
import os
import signal
import tempfile
import uuid
from typing import Any

import msgpack


def new_ipc_address(name: str) -> str:
    """A fresh ``ipc://`` address in the temp directory."""
    return f"ipc://{tempfile.gettempdir()}/fastdeploy-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def become_child_process() -> None:
    """Call first thing in a child: die with the parent, leave Ctrl-C to the parent.

    ``PR_SET_PDEATHSIG`` makes the kernel kill this process when its parent
    dies, so no engine or worker is ever orphaned; SIGINT (sent to the whole
    process group by a terminal) is ignored because the parent coordinates
    shutdown; SIGTERM exits through ``SystemExit`` so ``finally`` blocks run.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def stop_process(proc, timeout: float = 5.0) -> None:
    """Terminate a multiprocessing child and make sure it is gone."""
    if proc is None or not proc.is_alive():
        return
    proc.terminate()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)
