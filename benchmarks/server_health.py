"""Waiting for a benchmark's server to come up (shared by the scripts that start one)."""

from __future__ import annotations

import subprocess
import time
import urllib.request


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll ``url + "/health"`` until it answers 200; RuntimeError if the server exits first,
    TimeoutError if the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s")
