"""xgrammar grammars and matchers in helper processes (``FD_GRAMMAR_PROCESSES=N``): the token
bitmasks are made beside the engine loop with no GIL shared with it.

In one process the matchers' threads wait for the GIL at every hand-over while the engine loop
runs Python (scheduling, output handling), so a step's mask is mostly made after the loop's
work rather than beside it (docs/benchmarks.md, sixteenth to eighteenth sessions). Here each
constraint is compiled in one of ``N`` processes (chosen by its key), every request's matcher
lives in the process of its constraint, and each step every process advances its matchers past
their new tokens and fills their rows into a shared-memory mask that the engine then uses as
it is (pinned for the GPU when the worker runs in the engine's process). The engine loop only
sends each process its rows and reads back, per row, whether the grammar goes on, refused a
token or ended.

Two pipes per process: the control pipe (compiles, each answered to a reader thread that
resolves the compile's future; a process keeps its last ``4 * FD_GRAMMAR_CACHE_SIZE`` grammars)
and the mask pipe (one request and one reply a step, read by the engine loop). The messages are
in :mod:`~fastdeploy.structured_output.grammar_messages`, the process's side in
:mod:`~fastdeploy.structured_output.grammar_process_main`. A process that dies is started again by
the next compile that maps to it (:meth:`GrammarProcessPool.compile`).
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import tempfile
import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from fastdeploy.structured_output.grammar_messages import (
    ENDED,
    READY,
    REFUSED,
    CompileRequest,
    MaskReply,
    MaskRow,
    MaskWork,
    NewMatcher,
)
from fastdeploy.structured_output.grammar_process_main import serve

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Longest wait for a process to start (imports, tokenizer)."""
COMPILE_TIMEOUT_S = 300.0
"""Longest wait for one compile."""


AUTO_PROCESSES = 8
"""Grammar processes an engine core runs by default on a GPU host with :data:`AUTO_MIN_CORES`."""
AUTO_MIN_CORES = 16
"""Cores of its own an engine core needs for :data:`AUTO_PROCESSES` by default: the processes then
leave the engine loop, the workers and the API server theirs (fewer: the compiles run in threads)."""


def grammar_process_count(setting: int | None, engines_on_host: int, on_gpu: bool) -> int:
    """How many grammar processes an engine core runs: ``setting`` (``FD_GRAMMAR_PROCESSES``) when
    given; else, where the model runs on a GPU, :data:`AUTO_PROCESSES` if this host's usable cores,
    shared by its ``engines_on_host`` engine cores (data-parallel replicas), give each
    :data:`AUTO_MIN_CORES`; else none (threads). On a GPU the engine loop's Python is the step's
    critical path and the processes hold none of its GIL, so a burst of new schemas delays no
    step (docs/benchmarks.md, twenty-second session); on a CPU the forward's own threads take the
    cores and the loop's Python matters less."""
    if setting is not None:
        return max(setting, 0)
    if not on_gpu:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return AUTO_PROCESSES if cores // max(engines_on_host, 1) >= AUTO_MIN_CORES else 0


@dataclass
class RemoteCompiled:
    """A constraint compiled in process ``process`` (what the manager's compile future gives), in
    its ``generation``-th start: a process restarted since no longer holds it."""

    key_id: int
    process: int
    generation: int = 0


class RemoteGrammar:
    """One request's matcher, kept in a grammar process (the scheduler's ``GrammarState``)."""

    def __init__(self, handle: int, process: int, stop_token_ids: list[int], generation: int = 0):
        self.handle = handle
        self.process = process
        self.generation = generation
        """The process's start that holds the matcher (:attr:`GrammarProcessPool.generations`)."""
        self.stop_token_ids = list(stop_token_ids)
        self.failed = False
        """A token the grammar refused was taken anyway: the row's mask is lifted from then on."""
        self.ended = False
        self.unseen: list[int] = []
        """Output tokens the process has not advanced the matcher past yet."""

    def accept_token(self, token_id: int) -> None:
        self.unseen.append(token_id)

    def write_stop_row(self, row: np.ndarray) -> None:
        """Write the row of an ended grammar: only its stop tokens."""
        write_stop_row(row, self.stop_token_ids)


def write_stop_row(row: np.ndarray, stop_token_ids: list[int]) -> None:
    """Set a mask row (int32 words) to allow only ``stop_token_ids``: an ended grammar's row."""
    bits = row.view(np.uint32)
    bits[:] = 0
    for token in stop_token_ids:
        bits[token // 32] |= np.uint32(1 << (token % 32))


class GrammarProcessPool:
    """``num_processes`` grammar processes and two shared-memory mask buffers of ``rows`` rows,
    used alternately (a buffer is written again two steps later, once the worker has read it).

    ``start_process(target, args, name, pass_fds)`` starts ``target(*args)`` in a fresh interpreter
    that inherits ``pass_fds`` and returns a handle with ``join(timeout)``, ``is_alive()`` and
    ``kill_and_wait()`` (the engine's ``ChildProcess``: never a re-import of the caller's
    ``__main__``, as multiprocessing's spawn would do)."""

    def __init__(
        self,
        num_processes: int,
        tokenizer_info_json: str,
        rows: int,
        words: int,
        pin: bool,
        start_process: Callable[..., Any],
    ):
        self.rows, self.words = rows, words
        self._tokenizer_info_json = tokenizer_info_json
        self._start_process = start_process
        size = max(rows * words * 4, mmap.PAGESIZE)
        self._buffer_fds = [_shared_file(size) for _ in range(2)]
        self._maps = [mmap.mmap(fd, size) for fd in self._buffer_fds]
        self.buffers = [np.ndarray((rows, words), dtype=np.int32, buffer=m) for m in self._maps]
        self._registered: list[int] = []
        if pin:
            self.pin_buffers()
        self._next_buffer = 0
        self._unfinished: PendingRemote | None = None
        """The last step's processes' work if its replies were never read (a step that failed)."""
        self._procs, self._control, self._mask = [], [], []
        self._closed = False
        self._lock = threading.Lock()
        try:
            for _ in range(num_processes):
                proc, control, mask = self._start_one(len(self._procs))
                self._procs.append(proc)
                self._control.append(control)
                self._mask.append(mask)
            for index, control in enumerate(self._control):
                self._wait_until_ready(index, control)
        except BaseException:
            self.shutdown()
            raise
        self._send_locks = [threading.Lock() for _ in range(num_processes)]
        """One sender at a time on each control pipe (compile threads, the engine loop)."""
        self._futures: dict[int, tuple[Future, int, int]] = {}
        """Compiles awaiting their reply, by key: (future, process, the process's generation)."""
        self._next_key = 0
        self._next_handle = 0
        self._new: list[list[NewMatcher]] = [[] for _ in range(num_processes)]
        self._freed: list[list[int]] = [[] for _ in range(num_processes)]
        self._dead = [False] * num_processes
        self.generations = [0] * num_processes
        """How many times each process was restarted (:meth:`is_current`)."""
        self._restart_locks = [threading.Lock() for _ in range(num_processes)]
        self.matcher_counts = [0] * num_processes
        """Matchers each process held after its last step (a leak would show here)."""
        for index in range(num_processes):
            self._start_reader(index, 0, self._control[index])

    def _start_one(self, index: int) -> tuple[Any, Connection, Connection]:
        """Start grammar process ``index`` with its two pipes and the mask buffers' descriptors:
        ``(process, control pipe, mask pipe)``."""
        control, child_control = socket.socketpair()
        mask, child_mask = socket.socketpair()
        fds = (child_control.fileno(), child_mask.fileno(), *self._buffer_fds)
        args = (fds[0], fds[1], list(self._buffer_fds), self._tokenizer_info_json, self.rows, self.words)
        try:
            proc = self._start_process(serve, args, f"fastdeploy-grammar-{index}", pass_fds=fds)
        except BaseException:
            control.close()
            mask.close()
            raise
        finally:
            child_control.close()
            child_mask.close()
        return proc, Connection(control.detach()), Connection(mask.detach())

    def _wait_until_ready(self, index: int, control: Connection) -> None:
        """Wait for a process to have started (imports, tokenizer: seconds), so that the first steps
        do not wait for it; a RuntimeError if it cannot (the caller stops it)."""
        try:
            ready = control.poll(START_TIMEOUT_S) and control.recv() == READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            raise RuntimeError(f"grammar process {index} did not start (its error is in the log above)")

    def _start_reader(self, process: int, generation: int, control: Connection) -> None:
        threading.Thread(
            target=self._read_replies,
            args=(process, generation, control),
            name=f"fd-grammar-reply-{process}",
            daemon=True,
        ).start()

    def is_current(self, compiled: RemoteCompiled) -> bool:
        """Whether the process that compiled ``compiled`` still holds it: running, and not started
        again since."""
        with self._lock:
            return (
                compiled.generation == self.generations[compiled.process] and not self._dead[compiled.process]
            )

    def _restart(self, process: int) -> None:
        """Start a stopped process again (a compile for it found it stopped: a crash must not fail
        every later constraint that maps to it). Its requests' masks were lifted; what it compiled
        is gone (:meth:`is_current`). A RuntimeError if it cannot start."""
        with self._restart_locks[process]:
            with self._lock:
                if not self._dead[process] or self._closed:
                    return
                old = (self._procs[process], self._control[process], self._mask[process])
            logger.warning("structured output: grammar process %d stopped; starting it again", process)
            if not old[0].join(0):
                old[0].kill_and_wait()
            proc, control, mask = self._start_one(process)
            try:
                self._wait_until_ready(process, control)
            except BaseException:
                _discard(proc, control, mask)
                raise
            with self._lock:
                if self._closed:  # (shut down meanwhile: this one goes too)
                    _discard(proc, control, mask)
                    return
                self._procs[process], self._control[process], self._mask[process] = proc, control, mask
                self.generations[process] += 1
                self._new[process], self._freed[process] = [], []
                self.matcher_counts[process] = 0
                self._dead[process] = False
                generation = self.generations[process]
            for connection in old[1:]:
                connection.close()
            self._start_reader(process, generation, control)

    def pin_buffers(self) -> None:
        """Page-lock the buffers for the GPU (the worker copies a mask to the device as it is)."""
        import torch

        if self._registered:
            return
        cudart = torch.cuda.cudart()
        for buffer in self.buffers:
            pointer, size = buffer.ctypes.data, buffer.nbytes
            if int(cudart.cudaHostRegister(pointer, size, 0)) == 0:  # (cudaSuccess)
                self._registered.append(pointer)

    # ---- compiling (any thread; blocks until the process answers) --------------------

    def compile(self, kind: str, text: str, reasoning_prefix: str) -> RemoteCompiled:
        """Compile a constraint in the process its text maps to (started again first if it has
        stopped); a ValueError with xgrammar's message when it is invalid, or when the process
        stopped during the compile."""
        process = zlib.crc32(f"{kind}\0{text}\0{reasoning_prefix}".encode()) % len(self._procs)
        future: Future = Future()
        while True:
            if self._dead[process]:
                try:
                    self._restart(process)
                except Exception as exc:  # (logged; this compile's request fails with it)
                    raise ValueError(
                        f"the grammar process has stopped and could not start again: {exc}"
                    ) from None
            with self._lock:  # (registered while running: a stop from now on fails it, in its reader)
                if self._closed:
                    raise ValueError("the grammar processes were shut down")
                if self._dead[process]:
                    continue
                key_id = self._next_key
                self._next_key += 1
                generation = self.generations[process]
                self._futures[key_id] = (future, process, generation)
                control = self._control[process]
                break
        try:
            with self._send_locks[process]:  # (not under _lock: a full pipe must not block the reader)
                control.send(CompileRequest(key_id, kind, text, reasoning_prefix))
        except OSError:
            with self._lock:
                self._futures.pop(key_id, None)
            raise ValueError("the grammar process has stopped") from None
        error = future.result(timeout=COMPILE_TIMEOUT_S)
        if error is not None:
            raise ValueError(error)
        return RemoteCompiled(key_id, process, generation)

    def _read_replies(self, process: int, generation: int, connection: Connection) -> None:
        """Resolve compile futures from one start of a process's control pipe until it closes."""
        while True:
            try:
                reply = connection.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._futures.pop(reply.key_id, (None,))[0]
            if future is not None:
                future.set_result(reply.error)
        with self._lock:
            if self.generations[process] == generation:  # (else an older start's pipe)
                self._dead[process] = True
            pending = [key for key, (_, p, g) in self._futures.items() if (p, g) == (process, generation)]
            futures = [self._futures.pop(key)[0] for key in pending]
        for future in futures:
            if not future.done():
                future.set_exception(ValueError("the grammar process has stopped"))

    # ---- matchers and masks (the engine loop) -------------------------------------------

    def new_grammar(self, compiled: RemoteCompiled, stop_token_ids: list[int]) -> RemoteGrammar:
        """A matcher for one request, made in the constraint's process with the next mask work."""
        handle = self._next_handle
        self._next_handle += 1
        grammar = RemoteGrammar(handle, compiled.process, stop_token_ids, compiled.generation)
        self._new[compiled.process].append(NewMatcher(handle, compiled.key_id, list(stop_token_ids)))
        weakref.finalize(grammar, self._note_freed, compiled.process, handle)
        return grammar

    def _note_freed(self, process: int, handle: int) -> None:
        """A request's grammar is gone: its matcher goes with the process's next mask work."""
        self._freed[process].append(handle)

    def take_buffer(self, num_rows: int) -> tuple[int, np.ndarray]:
        """The next mask buffer (its index, and a view of its first ``num_rows`` rows); the other
        may still be read by the worker."""
        if num_rows > self.rows:
            raise ValueError(f"{num_rows} grammar rows, more than the {self.rows} the mask buffers hold")
        index = self._next_buffer
        self._next_buffer = 1 - index
        return index, self.buffers[index][:num_rows]

    def start(self, buffer: int, array: np.ndarray, rows: list[tuple[int, RemoteGrammar]]) -> PendingRemote:
        """Send each process its rows of ``array``, the :meth:`take_buffer` view of buffer ``buffer``,
        to advance their matchers and fill them."""
        if self._unfinished is not None:  # keep each pipe's replies in step with its requests
            self._unfinished.finish()
        per_process: dict[int, list[tuple[int, RemoteGrammar]]] = {}
        for row, grammar in rows:
            per_process.setdefault(grammar.process, []).append((row, grammar))
        sent: list[tuple[int, Connection, list[tuple[int, RemoteGrammar]]]] = []
        for process, all_items in per_process.items():
            with self._lock:  # (one start of the process: a restart swaps all three together)
                generation, connection, dead = (
                    self.generations[process],
                    self._mask[process],
                    self._dead[process],
                )
            lost = [(row, g) for row, g in all_items if g.generation != generation]  # (restarted since)
            if lost:
                self._lift(array, lost)
            items = [(row, g) for row, g in all_items if g.generation == generation]
            if not items:
                continue
            work = MaskWork(buffer, [MaskRow(row, g.handle, g.unseen) for row, g in items])
            work.new, self._new[process] = self._new[process], []
            work.freed, self._freed[process] = self._freed[process], []
            for _, grammar in items:
                grammar.unseen = []
            if not dead:
                try:
                    connection.send(work)
                    sent.append((process, connection, items))
                    continue
                except OSError:
                    self._mark_dead(process, connection)
            self._lift(array, items)
        pending = PendingRemote(self, array, sent)
        self._unfinished = pending if sent else None
        return pending

    def _lift(self, array: np.ndarray, items: list[tuple[int, RemoteGrammar]]) -> None:
        """Rows whose process has stopped: their grammar is lost, their masks lifted (logged)."""
        newly = sum(not grammar.failed for _, grammar in items)
        if newly:
            logger.error("structured output: a grammar process has stopped; %d masks lifted", newly)
        for row, grammar in items:
            grammar.failed = True
            array[row] = -1

    def receive(self, process: int, connection: Connection) -> MaskReply | None:
        """A process's reply to the mask work sent on ``connection`` (None: it has stopped)."""
        try:
            return connection.recv()
        except (EOFError, OSError):
            self._mark_dead(process, connection)
            return None

    def _mark_dead(self, process: int, connection: Connection) -> None:
        """The process behind ``connection`` has stopped (unless it was restarted since)."""
        with self._lock:
            if self._mask[process] is connection:
                self._dead[process] = True

    def shutdown(self) -> None:
        """Stop the processes and free the shared memory."""
        with self._lock:
            self._closed = True
        for connection in self._control + self._mask:
            try:
                connection.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if not proc.join(5):
                proc.kill_and_wait()
        for connection in self._control + self._mask:
            connection.close()
        if self._registered:
            import torch

            cudart = torch.cuda.cudart()
            for pointer in self._registered:
                cudart.cudaHostUnregister(pointer)
            self._registered = []
        self.buffers = []
        for shared in self._maps:
            try:
                shared.close()
            except BufferError:  # a view of it still alive somewhere: the mapping goes with it
                pass
        for fd in self._buffer_fds:
            os.close(fd)
        self._maps, self._buffer_fds = [], []


def _discard(proc: Any, control: Connection, mask: Connection) -> None:
    """Stop a grammar process that will not be used and close its pipes."""
    control.close()
    mask.close()
    proc.kill_and_wait()


def _shared_file(size: int) -> int:
    """A file descriptor of ``size`` bytes of memory that a child process can map (inherited)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("fastdeploy-grammar-mask", 0)
    else:
        with tempfile.TemporaryFile() as file:
            fd = os.dup(file.fileno())
    os.ftruncate(fd, size)
    return fd


class PendingRemote:
    """The processes' part of a step's mask being made (:meth:`finish` waits for it)."""

    def __init__(
        self,
        pool: GrammarProcessPool,
        array: np.ndarray,
        sent: list[tuple[int, Connection, list[tuple[int, RemoteGrammar]]]],
    ):
        self._pool = pool
        self._array = array
        self._sent = sent

    def finish(self) -> None:
        """Read each process's reply; write the rows of refused and ended grammars (once)."""
        sent, self._sent = self._sent, []
        if self._pool._unfinished is self:
            self._pool._unfinished = None
        for process, connection, items in sent:
            reply = self._pool.receive(process, connection)
            if reply is None or reply.error is not None:
                if reply is not None:
                    logger.error("structured output: grammar process error: %s", reply.error)
                self._pool._lift(self._array, items)
                continue
            self._pool.matcher_counts[process] = reply.matchers
            for (row, grammar), state in zip(items, reply.states):
                if state == REFUSED:
                    grammar.failed = True
                    logger.error("structured output: a token does not follow the grammar; the mask is lifted")
                    self._array[row] = -1
                elif state == ENDED:
                    grammar.ended = True
                    grammar.write_stop_row(self._array[row])
