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
and the mask pipe (one request and one reply a step, read by the engine loop). Messages are the
dataclasses below, pickled by ``multiprocessing.connection``: both ends are this engine's own
processes.
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
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

LIVE, REFUSED, ENDED = 0, 1, 2
"""A remote row's state after its step: the grammar goes on (its row filled), refused a token
(the row's mask is lifted), or took a stop token (only stop tokens may follow)."""

READY = "ready"
"""What a grammar process sends on its control pipe once it has started."""
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
class CompileRequest:
    """Compile a constraint (its :func:`~fastdeploy.structured_output.grammar.constraint_key`)."""

    key_id: int
    kind: str
    text: str
    reasoning_prefix: str


@dataclass
class CompileReply:
    """A compile's outcome: ``error`` is xgrammar's message for an invalid constraint, else None."""

    key_id: int
    error: str | None


@dataclass
class NewMatcher:
    """Make the matcher ``handle`` of one request from compiled constraint ``key_id``."""

    handle: int
    key_id: int
    stop_token_ids: list[int]


@dataclass
class MaskRow:
    """One row of a step's mask: the matcher ``handle`` fills row ``row``."""

    row: int
    handle: int
    tokens: list[int]
    """Output tokens to advance past before the row is filled (one a step; more after a resume)."""


@dataclass
class MaskWork:
    """One step's work for one process: its rows of mask buffer ``buffer``."""

    buffer: int
    rows: list[MaskRow]
    new: list[NewMatcher] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)


@dataclass
class MaskReply:
    """A process's answer to :class:`MaskWork` (``error``: it failed as a whole)."""

    states: list[int]
    """Per row of the work: :data:`LIVE`, :data:`REFUSED` or :data:`ENDED`."""
    error: str | None = None
    matchers: int = 0
    """Matchers the process holds after the step (those of requests still running)."""


@dataclass
class RemoteCompiled:
    """A constraint compiled in process ``process`` (what the manager's compile future gives)."""

    key_id: int
    process: int


class RemoteGrammar:
    """One request's matcher, kept in a grammar process (the scheduler's ``GrammarState``)."""

    def __init__(self, handle: int, process: int, stop_token_ids: list[int]):
        self.handle = handle
        self.process = process
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
        try:
            for index in range(num_processes):
                self._start(index, tokenizer_info_json, start_process)
        except BaseException:
            self.shutdown()
            raise
        self._wait_until_ready()
        self._lock = threading.Lock()
        self._send_locks = [threading.Lock() for _ in range(num_processes)]
        """One sender at a time on each control pipe (compile threads, the engine loop)."""
        self._futures: dict[int, Future] = {}
        self._next_key = 0
        self._next_handle = 0
        self._new: list[list[NewMatcher]] = [[] for _ in range(num_processes)]
        self._freed: list[list[int]] = [[] for _ in range(num_processes)]
        self._dead = [False] * num_processes
        self.matcher_counts = [0] * num_processes
        """Matchers each process held after its last step (a leak would show here)."""
        self._readers = [
            threading.Thread(target=self._read_replies, args=(i,), name=f"fd-grammar-reply-{i}", daemon=True)
            for i in range(num_processes)
        ]
        for reader in self._readers:
            reader.start()

    def _start(self, index: int, tokenizer_info_json: str, start_process: Callable[..., Any]) -> None:
        """Start grammar process ``index`` with its two pipes and the mask buffers' descriptors."""
        control, child_control = socket.socketpair()
        mask, child_mask = socket.socketpair()
        fds = (child_control.fileno(), child_mask.fileno(), *self._buffer_fds)
        args = (fds[0], fds[1], list(self._buffer_fds), tokenizer_info_json, self.rows, self.words)
        try:
            self._procs.append(start_process(_serve, args, f"fastdeploy-grammar-{index}", pass_fds=fds))
        finally:
            child_control.close()
            child_mask.close()
        self._control.append(Connection(control.detach()))
        self._mask.append(Connection(mask.detach()))

    def _wait_until_ready(self) -> None:
        """Wait for every process to have started (imports, tokenizer: a second or two), so that the
        first steps do not wait for them; a RuntimeError (and none left running) if one cannot."""
        for index, connection in enumerate(self._control):
            try:
                ready = connection.poll(START_TIMEOUT_S) and connection.recv() == READY
            except (EOFError, OSError):
                ready = False
            if not ready:
                self.shutdown()
                raise RuntimeError(f"grammar process {index} did not start (its error is in the log above)")

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
        """Compile a constraint in the process its text maps to; a ValueError with xgrammar's
        message when it is invalid."""
        process = zlib.crc32(f"{kind}\0{text}\0{reasoning_prefix}".encode()) % len(self._procs)
        future: Future = Future()
        with self._lock:
            key_id = self._next_key
            self._next_key += 1
            self._futures[key_id] = future
            dead = self._dead[process]
        if dead:
            raise ValueError("the grammar process has stopped")
        try:
            with self._send_locks[process]:  # (not under _lock: a full pipe must not block the reader)
                self._control[process].send(CompileRequest(key_id, kind, text, reasoning_prefix))
        except OSError:
            with self._lock:
                self._futures.pop(key_id, None)
            raise ValueError("the grammar process has stopped") from None
        error = future.result(timeout=COMPILE_TIMEOUT_S)
        if error is not None:
            raise ValueError(error)
        return RemoteCompiled(key_id, process)

    def _read_replies(self, process: int) -> None:
        """Resolve compile futures from the process's control pipe until it closes."""
        connection = self._control[process]
        while True:
            try:
                reply = connection.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._futures.pop(reply.key_id, None)
            if future is not None:
                future.set_result(reply.error)
        with self._lock:
            self._dead[process] = True
            pending, self._futures = self._futures, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ValueError("the grammar process has stopped"))

    # ---- matchers and masks (the engine loop) -------------------------------------------

    def new_grammar(self, compiled: RemoteCompiled, stop_token_ids: list[int]) -> RemoteGrammar:
        """A matcher for one request, made in the constraint's process with the next mask work."""
        handle = self._next_handle
        self._next_handle += 1
        grammar = RemoteGrammar(handle, compiled.process, stop_token_ids)
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
        sent: list[tuple[int, list[tuple[int, RemoteGrammar]]]] = []
        for process, items in per_process.items():
            work = MaskWork(buffer, [MaskRow(row, g.handle, g.unseen) for row, g in items])
            work.new, self._new[process] = self._new[process], []
            work.freed, self._freed[process] = self._freed[process], []
            for _, grammar in items:
                grammar.unseen = []
            if not self._dead[process]:
                try:
                    self._mask[process].send(work)
                    sent.append((process, items))
                    continue
                except OSError:
                    self._dead[process] = True
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

    def receive(self, process: int) -> MaskReply | None:
        try:
            return self._mask[process].recv()
        except (EOFError, OSError):
            self._dead[process] = True
            return None

    def shutdown(self) -> None:
        """Stop the processes and free the shared memory."""
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
        sent: list[tuple[int, list[tuple[int, RemoteGrammar]]]],
    ):
        self._pool = pool
        self._array = array
        self._sent = sent

    def finish(self) -> None:
        """Read each process's reply; write the rows of refused and ended grammars (once)."""
        sent, self._sent = self._sent, []
        if self._pool._unfinished is self:
            self._pool._unfinished = None
        for process, items in sent:
            reply = self._pool.receive(process)
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


# ---- the grammar process ------------------------------------------------------------------


def _serve(
    control_fd: int, mask_fd: int, buffer_fds: list[int], tokenizer_info_json: str, rows: int, words: int
) -> None:
    """A grammar process: compiles on its control pipe (in a thread), advances matchers and fills
    mask rows on its mask pipe, until either pipe sends None or closes."""
    import torch
    import xgrammar as xgr

    from fastdeploy import envs
    from fastdeploy.platforms.thread_priority import lower_thread_priority
    from fastdeploy.structured_output.grammar import build_grammar, clean_message, prime_compiler

    control, mask = Connection(control_fd), Connection(mask_fd)
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    cache_mb = envs.FD_XGRAMMAR_CACHE_MB
    compiler = xgr.GrammarCompiler(
        info, max_threads=2, cache_enabled=cache_mb > 0, cache_limit_bytes=cache_mb << 20
    )
    maps = [mmap.mmap(fd, max(rows * words * 4, mmap.PAGESIZE)) for fd in buffer_fds]
    masks = [torch.from_numpy(np.ndarray((rows, words), dtype=np.int32, buffer=m)) for m in maps]
    grammars: OrderedDict[int, Any] = OrderedDict()
    keep = 4 * max(envs.FD_GRAMMAR_CACHE_SIZE, 1)
    lock = threading.Lock()

    def compile_loop() -> None:
        lower_thread_priority(envs.FD_GRAMMAR_COMPILE_NICE)  # (the mask loop keeps its priority)
        for message in _messages(control):
            error = None
            try:
                grammar = build_grammar(message.kind, message.text, reasoning_prefix=message.reasoning_prefix)
                compiled = compiler.compile_grammar(grammar)
                with lock:  # (the engine's cache holds fewer: one evicted there is not asked for again)
                    grammars[message.key_id] = compiled
                    while len(grammars) > keep:
                        grammars.popitem(last=False)
            except Exception as exc:  # an invalid constraint: its requests fail with the message
                error = clean_message(str(exc))
            control.send(CompileReply(message.key_id, error))

    def prime() -> None:
        lower_thread_priority(envs.FD_GRAMMAR_COMPILE_NICE)
        if cache_mb > 0:
            prime_compiler(compiler, envs.FD_GRAMMAR_PRIME_LENGTH)

    control.send(READY)
    threading.Thread(target=compile_loop, name="fd-grammar-compile", daemon=True).start()
    threading.Thread(target=prime, name="fd-grammar-prime", daemon=True).start()
    matchers: dict[int, Any] = {}
    filler = xgr.BatchGrammarMatcher(1)
    for work in _messages(mask):
        try:
            mask.send(_mask_step(work, matchers, grammars, lock, masks[work.buffer], filler, xgr))
        except Exception as exc:  # reported: the engine lifts these rows
            mask.send(MaskReply([], error=f"{type(exc).__name__}: {exc}"))


def _messages(connection: Connection) -> Iterator[Any]:
    """What the engine sends on ``connection``, until it sends None or closes the pipe."""
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        yield message


def _mask_step(
    work: MaskWork,
    matchers: dict[int, Any],
    grammars: dict[int, Any],
    lock: threading.Lock,
    buffer: Any,
    filler: Any,
    xgr: Any,
) -> MaskReply:
    """Make and free matchers, advance each row's matcher past its tokens, fill the live rows.

    (The rows never name a freed handle: the engine frees a grammar only once nothing holds it.)"""
    for new in work.new:
        with lock:
            compiled = grammars.get(new.key_id)
        if compiled is not None:  # (else its rows are refused: the engine lifts their masks)
            matchers[new.handle] = xgr.GrammarMatcher(
                compiled, override_stop_tokens=new.stop_token_ids or None
            )
    for handle in work.freed:  # (after the new ones: a request may end before its first mask)
        matchers.pop(handle, None)
    states, fill_matchers, fill_rows = [], [], []
    for item in work.rows:
        matcher = matchers.get(item.handle)
        if matcher is None:
            states.append(REFUSED)
            continue
        state = LIVE
        for token in item.tokens:
            if not matcher.accept_token(token):
                state = REFUSED
                break
            if matcher.is_terminated():
                state = ENDED
                break
        states.append(state)
        if state == LIVE:
            fill_matchers.append(matcher)
            fill_rows.append(item.row)
    if fill_matchers:
        filler.batch_fill_next_token_bitmask(fill_matchers, buffer, fill_rows)
    return MaskReply(states, matchers=len(matchers))
