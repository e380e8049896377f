"""Plumbing shared by the engine's processes: ZMQ addresses, msgpack frames, child processes, signals.

Process tree of ``fastdeploy serve``: the top process (API server) starts the
engine core, which starts its worker(s). Children are started by
:class:`ChildProcess`, in a process group of their own (the engine core's), so
that Ctrl-C in a terminal reaches only the top process, which stops its
children itself. The top process reacts to SIGINT/SIGTERM through
:data:`STOP_SIGNALS`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

# --------------------------------------------------------------------------- addresses and frames

_MAX_IPC_DIR_LEN = 80
"""Longest socket directory used: a Unix socket path must fit in about 107 bytes."""


def new_ipc_dir() -> str:
    """A private (mode 0700) directory for one run's ``ipc://`` sockets; remove it with :func:`remove_ipc_dir`.

    Under the temp directory, or ``/tmp`` when that path is too long for a Unix socket.
    """
    path = tempfile.mkdtemp(prefix="fastdeploy-")
    if len(path) > _MAX_IPC_DIR_LEN:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="fastdeploy-", dir="/tmp")
    return path


def ipc_address(ipc_dir: str, name: str) -> str:
    """The ``ipc://`` address of the socket ``name`` in ``ipc_dir``."""
    return f"ipc://{os.path.join(ipc_dir, name)}"


def remove_ipc_dir(ipc_dir: str | None) -> None:
    """Remove a directory from :func:`new_ipc_dir` with every socket file in it (no error if gone)."""
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def decode(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# --------------------------------------------------------------------------- signals of the top process


class StopSignals:
    """How the top process reacts to SIGINT and SIGTERM (Ctrl-C, ``kill``, a supervisor).

    Only the first signal counts; it is kept for the exit status (:attr:`exit_code`:
    130 for SIGINT, 143 for SIGTERM) and later ones are ignored, so the cleanup it
    started is never cut short. What the first signal does depends on the mode:

    - *interrupt* (after :meth:`installed`): raise ``KeyboardInterrupt`` wherever the
      main thread is — importing, loading the tokenizer, waiting for the engine;
    - *callback* (within :meth:`calling`): call a function instead (the HTTP server's
      graceful stop);
    - within :meth:`shielded` the signal is only noted, and the interrupt is raised
      at the end of the block (around starting a child process, and cleanups).
    """

    HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        """The first signal received (its number), or None."""
        self._callback: Callable[[int], None] | None = None
        self._shield_depth = 0
        self._pending = False

    @property
    def exit_code(self) -> int | None:
        """``128 + signal number`` of the first signal received (130: SIGINT, 143: SIGTERM), else None."""
        return None if self.received is None else 128 + self.received

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            return
        self.received = signum
        if self._callback is not None:
            self._callback(signum)
        elif self._shield_depth:
            self._pending = True
        else:
            raise KeyboardInterrupt(f"signal {signum}")

    def raise_if_received(self) -> None:
        """Raise ``KeyboardInterrupt`` again if a signal has come (for loops that wait during start-up).

        A Python signal handler runs at the next bytecode of the main thread, which
        may be inside a ``__del__`` or a callback whose exceptions are only printed:
        the first interrupt can be lost, the signal cannot.
        """
        if self.received is not None and self._callback is None and not self._shield_depth:
            raise KeyboardInterrupt(f"signal {self.received}")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Within the block the handlers are ours (main thread only); the previous ones come back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.received, self._callback, self._shield_depth, self._pending = None, None, 0, False
        previous = {sig: signal.signal(sig, self._handle) for sig in self.HANDLED}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.received = None

    @contextlib.contextmanager
    def calling(self, callback: Callable[[int], None]) -> Iterator[None]:
        """Within the block the first signal calls ``callback(signum)`` instead of raising.

        Installs the handlers for the block if :meth:`installed` has not (a server run
        without ``fastdeploy``'s ``main``).
        """
        with contextlib.ExitStack() as stack:
            if signal.getsignal(signal.SIGINT) != self._handle:
                stack.enter_context(self.installed())
            previous, self._callback = self._callback, callback
            try:
                yield
            finally:
                self._callback = previous

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Within the block a signal is only noted; ``KeyboardInterrupt`` follows at its end."""
        self._shield_depth += 1
        try:
            yield
        finally:
            self._shield_depth -= 1
            if self._pending and not self._shield_depth:
                self._pending = False
                raise KeyboardInterrupt(f"signal {self.received}")


STOP_SIGNALS = StopSignals()
"""The top process's signal policy (installed by ``fastdeploy``'s ``main``)."""


# --------------------------------------------------------------------------- child processes

_CHILD_CODE = "from fastdeploy.engine.ipc import child_main; child_main()"
_LENGTH = struct.Struct("<Q")


class ChildProcess:
    """``target(*args)`` run in a fresh Python interpreter (like multiprocessing's "spawn").

    Unlike multiprocessing this starts no resource-tracker process (which would
    outlive the top process by a moment), and the child starts in a process group
    of its own (``new_group``) or its parent's: Ctrl-C at a terminal reaches the
    whole foreground group, but only the top process should decide how to stop.
    The child dies with its parent (``PR_SET_PDEATHSIG``), ignores SIGINT, turns
    SIGTERM into ``SystemExit`` (its ``finally`` blocks run) and ends with
    ``os._exit``: the interpreter's own teardown of torch takes over a second.
    ``pass_fds``: file descriptors the child inherits under the same numbers (a listening
    socket); ``env``: its environment (default: this process's).
    """

    def __init__(
        self,
        target: Callable[..., Any],
        args: tuple,
        name: str,
        new_group: bool = False,
        pass_fds: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
    ):
        payload = pickle.dumps((target, args))
        self.name = name
        with STOP_SIGNALS.shielded():  # never a child started but not recorded
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(os.getpid()), name],
                stdin=subprocess.PIPE,
                start_new_session=new_group,
                pass_fds=pass_fds,
                env=env,
            )
            try:
                assert self._popen.stdin is not None
                self._popen.stdin.write(_LENGTH.pack(len(payload)) + payload)
                self._popen.stdin.close()
            except BaseException:
                self.kill_and_wait()
                raise

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while running; else the exit status (negative: killed by that signal)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit; whether it has."""
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill_and_wait(self) -> None:
        """SIGKILL the process and reap it."""
        with contextlib.suppress(OSError):
            self._popen.kill()
        self._popen.wait()

    def stop(self, grace_s: float) -> None:
        """SIGTERM, up to ``grace_s`` seconds to exit, then SIGKILL; returns once the process is gone."""
        if not self.is_alive():
            return
        with contextlib.suppress(OSError):
            self._popen.terminate()
        if not self.join(grace_s):
            self.kill_and_wait()


def _set_parent_death_signal() -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the cleanup finish
    raise SystemExit(0)


def _read_payload(stream: Any) -> bytes | None:
    """The length-prefixed payload a :class:`ChildProcess` writes, or None if it was cut short."""
    header = stream.read(_LENGTH.size)
    if len(header) != _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(header)
    payload = stream.read(size)
    return payload if len(payload) == size else None


def child_main() -> None:
    """Entry point of a :class:`ChildProcess`: set up, read ``(target, args)`` from stdin, run it, exit."""
    parent_pid = int(sys.argv[1])
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before we could watch it
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    code = 1
    try:
        payload = _read_payload(sys.stdin.buffer)
        if payload is not None:  # else the parent gave up on us while starting us: leave quietly
            target, args = pickle.loads(payload)  # imports the target's module (torch, ...)
            target(*args)
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def kill_process_group(pgid: int, timeout: float = 2.0) -> bool:
    """SIGKILL every process left in group ``pgid`` and wait up to ``timeout`` s for them to go.

    The last resort after a child has been stopped: whatever it left behind (its
    worker, when the child itself had to be killed) is gone before we return.
    Returns whether the group is empty (zombies count as gone).
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return True
    deadline = time.monotonic() + timeout
    while _group_has_live_process(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _group_has_live_process(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is running (not a zombie); from /proc where it exists."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
