"""The engine core's structured-output state: grammars compiled off the engine loop (once per distinct
constraint, an LRU of futures), one matcher per request, and the token bitmask of each step.

Backends (``FD_STRUCTURED_OUTPUTS_BACKEND``): ``xgrammar`` compiles every constraint, and its
requests sample nothing until the compile ends (the default; the engine core prefills their
prompts meanwhile); ``guidance`` (llguidance) builds matchers at once
and computes masks lazily; ``auto`` gives a request whose constraint has no compiled xgrammar
grammar yet an llguidance matcher right away and compiles the constraint with xgrammar in the
background, so later requests with the same constraint take xgrammar's faster masks. Without
llguidance installed, or for a model whose end-of-sequence ids lie outside its tokenizer's
vocabulary (llguidance could not stop), ``auto`` is ``xgrammar``. docs/benchmarks.md has why
``xgrammar`` is the default.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastdeploy import envs
from fastdeploy.core.sampling_params import StructuredOutputsParams
from fastdeploy.core.step_io import GrammarBitmask, bitmask_words
from fastdeploy.platforms.gc_heap import freeze_late_heap, unfreeze_heap
from fastdeploy.platforms.thread_priority import lower_thread_priority
from fastdeploy.structured_output import guidance
from fastdeploy.structured_output.grammar import build_grammar, constraint_key, prime_compiler
from fastdeploy.structured_output.grammar_processes import (
    GrammarProcessPool,
    PendingRemote,
    RemoteCompiled,
    RemoteGrammar,
    write_stop_row,
)

logger = logging.getLogger(__name__)


BACKENDS = ("auto", "xgrammar", "guidance")
"""Values of ``FD_STRUCTURED_OUTPUTS_BACKEND``."""


class RequestGrammar:
    """The grammar matcher of one request (one choice), advanced with each of its output tokens.

    Implements the scheduler's ``core.request.GrammarState`` protocol.
    """

    def __init__(self, matcher: Any, stop_token_ids: list[int]):
        self.matcher = matcher
        self.stop_token_ids = list(stop_token_ids) or list(matcher.stop_token_ids)
        """The tokens that end the grammar; what may follow once it has ended (sampled on only
        with ``ignore_eos``)."""
        self.stop_set = frozenset(self.stop_token_ids)
        self.failed = False
        """A token the grammar refused was accepted anyway (never expected: it is logged once)."""
        self.ended = False
        """The matcher took a stop token (xgrammar's ``is_terminated``, kept here: no native call)."""
        self.unseen: list[int] = []
        """Output tokens the matcher has not advanced past yet: the manager feeds them to the
        matchers in its threads before it fills their rows (:meth:`StructuredOutputManager.start_bitmask`)."""

    def accept_token(self, token_id: int) -> None:
        """Record an output token; the matcher advances past it before its next bitmask."""
        self.unseen.append(token_id)

    def advance_alone(self, tokens: list[int]) -> None:
        """Advance the matcher past ``tokens`` here, one by one (tokens after its end are ignored)."""
        for token in tokens:
            if not self.failed and not self.ended:
                self.record(token, self.matcher.accept_token(token))

    def record(self, token: int, accepted: bool) -> None:
        """Note what the matcher's advance past ``token`` did: it ended, or the token was refused."""
        if not accepted:
            self.failed = True
            logger.error("structured output: token %d does not follow the grammar; the mask is lifted", token)
        elif token in self.stop_set:
            self.ended = True

    def write_stop_row(self, row: Any) -> None:
        """Write the row of an ended grammar: only its stop tokens (``row``: int32 numpy words)."""
        write_stop_row(row, self.stop_token_ids)


@dataclass
class _SliceWork:
    """The rows of one pool thread's native calls: matchers to advance past a token, rows to fill."""

    accept_grammars: list[RequestGrammar] = field(default_factory=list)
    accept_matchers: list[Any] = field(default_factory=list)
    accept_rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    fill_matchers: list[Any] = field(default_factory=list)
    fill_rows: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, grammars: list[Any], rows: list[int]) -> _SliceWork:
        """The work of ``rows`` (live grammars with at most one unseen token each, taken here, in the
        engine loop's thread: the pool thread then only makes the two native calls)."""
        work = cls()
        for row in rows:
            grammar = grammars[row]
            if grammar.unseen:
                token = grammar.unseen.pop()
                work.accept_grammars.append(grammar)
                work.accept_matchers.append(grammar.matcher)
                work.accept_rows.append(row)
                work.tokens.append(token)
                if token in grammar.stop_set:
                    continue  # ends the grammar: its row is written once the advance is back
            work.fill_matchers.append(grammar.matcher)
            work.fill_rows.append(row)
        return work


class PendingBitmask:
    """A step's bitmask while the manager's threads advance and fill it (:meth:`result` waits)."""

    def __init__(
        self,
        req_ids: list[str],
        tensor: Any,
        work: list[_SliceWork],
        futures: list[Future],
        remote: PendingRemote | None = None,
    ):
        """``futures``: each slice's advance and fill → the slice's accepted flags; ``remote``: the
        rows of the grammar processes' matchers."""
        self._req_ids = req_ids
        self._tensor = tensor
        self._array = tensor.numpy()
        self._work = work
        self._futures = futures
        self._remote = remote

    def result(self) -> GrammarBitmask:
        """The finished bitmask: rows whose token was refused lifted, ended grammars' rows written."""
        if self._remote is not None:
            self._remote.finish()
        for work, future in zip(self._work, self._futures):
            accepted = future.result()
            for grammar, row, token, ok in zip(work.accept_grammars, work.accept_rows, work.tokens, accepted):
                if not ok or token in grammar.stop_set:
                    grammar.record(token, ok)
                    if grammar.failed:
                        self._array[row] = -1
                    else:
                        grammar.write_stop_row(self._array[row])
        return GrammarBitmask(self._req_ids, self._array, self._array.shape[1], tensor=self._tensor)


class StructuredOutputManager:
    """Compiles grammars in threads (a slow compile delays only its own requests) and builds bitmasks.

    ``load_tokenizer`` is called once, in a compile thread, when the first grammar is needed.
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        eos_token_ids: list[int],
        pin_memory: bool = False,
        max_rows: int = 1024,
        start_process: Callable[..., Any] | None = None,
        num_processes: int = 0,
    ):
        """``pin_memory``: the worker runs in this process on a GPU (offline): masks are filled into
        pinned host memory, which the worker copies to the device as it is (or :meth:`pin_masks`
        later). ``num_processes``: grammar processes (:func:`grammar_process_count`), started with
        ``start_process``; 0: threads of this process."""
        self._load_tokenizer = load_tokenizer
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size
        """The model's vocabulary (the logits' width, maybe padded past the tokenizer's)."""
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._hf_tokenizer: Any = None
        self._init_lock = threading.Lock()
        self._num_processes = max(num_processes, 0) if start_process is not None else 0
        # compiles here run at a lower priority (xgrammar's own compile threads inherit it); with the
        # grammar processes these threads only hand compiles over and start the processes, which
        # would inherit it (a process lowers its own compile thread: its mask loop keeps the priority)
        nice = envs.FD_GRAMMAR_COMPILE_NICE if not self._num_processes else 0
        self._pool = ThreadPoolExecutor(
            max(envs.FD_GRAMMAR_COMPILE_THREADS, 1),
            "fd-grammar",
            initializer=lower_thread_priority,
            initargs=(nice,),
        )
        """Compiles, or hands them to the grammar processes."""
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.cache_size = envs.FD_GRAMMAR_CACHE_SIZE
        self._slice_threads = max(envs.FD_GRAMMAR_MASK_THREADS, 1)
        self._slice_pool = ThreadPoolExecutor(self._slice_threads, "fd-grammar-mask")
        """Advances the matchers (and fills the rows of a few), in slices, beside the engine loop."""
        self._fill_pool = ThreadPoolExecutor(1, "fd-grammar-fill")
        """Advances every matcher and fills every row in one task (``THREADED_FILL``)."""
        self.num_compiles = 0
        """Grammars compiled so far (cache misses)."""
        self.backend = envs.FD_STRUCTURED_OUTPUTS_BACKEND
        """auto, xgrammar or guidance (module docstring)."""
        if self.backend not in BACKENDS:
            raise ValueError(
                f"FD_STRUCTURED_OUTPUTS_BACKEND must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.backend == "auto" and not guidance.available():
            self.backend = "xgrammar"
        self._guidance: guidance.GuidanceBackend | None = None
        self._guidance_error: ValueError | None = None
        """Why llguidance cannot serve this model (then ``auto`` compiles every constraint)."""
        self._guidance_pool = ThreadPoolExecutor(1, "fd-guidance")
        """llguidance grammars (about a millisecond each): never queued behind xgrammar's compiles."""
        self.num_guidance_grammars = 0
        """Constraints handed to llguidance so far."""
        self._start_process = start_process
        """How the grammar processes start (the engine's ``ChildProcess``; None: no processes)."""
        self._max_rows = max_rows
        """Most grammar rows of a step (the scheduler's running requests): the processes' mask buffers."""
        self.primed: Future | None = None
        """The priming compile of the in-process compiler (:func:`prime_compiler`), once it started."""
        self._processes: GrammarProcessPool | None = None
        """The grammar processes (``num_processes``), started by :meth:`start_processes_soon` or with
        the first compile."""
        self._closed = False
        self._state_lock = threading.Lock()
        """Makes "shut down" and "processes started" exclusive (:meth:`processes`, :meth:`shutdown`)."""
        self._process_stop_ids: list[int] = []
        if self._num_processes and self.backend == "auto":
            self.backend = "xgrammar"  # (llguidance's matchers would stay in this process)

    # ---- compiling -----------------------------------------------------------------

    def _tokenizer_info(self) -> Any:
        """xgrammar's view of this model's tokenizer (call with ``_init_lock`` held)."""
        import xgrammar as xgr

        return xgr.TokenizerInfo.from_huggingface(
            self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
        )

    def processes(self) -> GrammarProcessPool:
        """The grammar processes: started by :meth:`start_processes_soon` or on first use, in a
        compile thread (seconds: each imports xgrammar and torch and reads the tokenizer)."""
        with self._init_lock:
            if self._processes is None:
                if self._closed:
                    raise RuntimeError("the structured-output manager was shut down")
                info = self._tokenizer_info()
                self._process_stop_ids = list(info.stop_token_ids)
                pool = GrammarProcessPool(
                    self._num_processes,
                    info.serialize_json(),
                    self._max_rows,
                    bitmask_words(self.vocab_size),
                    self.pin_memory,
                    self._start_process,
                )
                with self._state_lock:  # (a shutdown meanwhile would not see them)
                    if self._closed:
                        pool.shutdown()
                        raise RuntimeError("the structured-output manager was shut down")
                    self._processes = pool
                freeze_late_heap()
            return self._processes

    def start_processes_soon(self) -> Future | None:
        """Start the grammar processes (``num_processes``) now, in a compile thread, beside
        the engine's start-up, rather than with the first compile: their start takes seconds (6.6-9.3
        s on the GPU host, docs/benchmarks.md) that the first structured request would wait. A start
        that fails is logged and tried again by the first compile. Returns the start's future (None
        without processes)."""
        return self._pool.submit(self._start_processes_logged) if self._num_processes else None

    def _start_processes_logged(self) -> None:
        try:
            self.processes()
        except Exception as exc:
            if not self._closed:
                logger.warning("the grammar processes did not start (the first compile tries again): %s", exc)

    def pin_masks(self) -> None:
        """Fill the masks into pinned host memory from now on: the worker turned out to run in this
        process on a GPU (known once the executor exists, after the grammar processes started)."""
        with self._init_lock:
            self.pin_memory = True
            if self._processes is not None:
                self._processes.pin_buffers()

    def compiler(self) -> Any:
        """xgrammar's compiler for this model's tokenizer (built on first use)."""
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = self._tokenizer_info()
                # two threads per compile: a new schema waits ~30% less (60 -> 42 ms on the CI CPU);
                # the cache keeps each rule's token masks, so schemas sharing parts (a bounded string,
                # an integer range) compile in a few ms after the first (docs/benchmarks.md)
                cache_mb = envs.FD_XGRAMMAR_CACHE_MB
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=2, cache_enabled=cache_mb > 0, cache_limit_bytes=cache_mb << 20
                )
                # the tokenizer's Python heap lives as long as the engine: out of the collector's
                # full scans, which otherwise stall the engine loop (~100 ms each; docs/benchmarks.md)
                freeze_late_heap()
                if cache_mb > 0 and envs.FD_GRAMMAR_PRIME_LENGTH > 0:
                    self.primed = self._pool.submit(
                        prime_compiler, self._compiler, envs.FD_GRAMMAR_PRIME_LENGTH
                    )
            return self._compiler

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of what :meth:`new_request_grammar` takes for ``params``: xgrammar's compiled
        grammar (cached per constraint), or, where the backend says so, an llguidance grammar."""
        key = constraint_key(params)
        uses_guidance = self.backend == "guidance" or (
            self.backend == "auto" and key[0] in guidance.SUPPORTED_KINDS
        )
        if uses_guidance and not params.reasoning_prefix:  # (a reasoning prefix: xgrammar's concat)
            compiled = self._cache.get(key) if self.backend == "auto" else None
            if compiled is None and self.backend == "auto":
                self._compile_later(key)  # for the requests that repeat this constraint
            elif compiled is not None and compiled.done() and compiled.exception() is None:
                self._cache.move_to_end(key)
                return compiled
            return self._guidance_pool.submit(self._guidance_grammar, *key[:2])
        return self._compile_later(key)

    def _compile_later(self, key: tuple[str, str, str]) -> Future:
        """The xgrammar compile of ``key``: the cached future, or a new one in the pool."""
        future = self._cache.get(key)
        if future is not None and (not future.done() or self.is_usable(future)):
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, *key)
        self._cache[key] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def _guidance_grammar(self, kind: str, text: str) -> Any:
        """llguidance's grammar of the constraint; under ``auto``, one llguidance cannot take waits
        for xgrammar's compile instead."""
        with self._init_lock:
            if self._guidance is None and self._guidance_error is None:
                try:
                    self._guidance = guidance.GuidanceBackend(
                        self._tokenizer(),
                        self.vocab_size,
                        self.eos_token_ids,
                        envs.FD_GRAMMAR_MASK_THREADS,
                    )
                except ValueError as exc:  # kept: not retried for every constraint
                    self._guidance_error = exc
        try:
            if self._guidance_error is not None:
                raise self._guidance_error
            grammar = self._guidance.grammar(kind, text)
        except ValueError:
            if self.backend != "auto":
                raise
            return self._compile(kind, text)  # (in this thread: the cache belongs to the engine loop)
        self.num_guidance_grammars += 1
        return grammar

    def _tokenizer(self) -> Any:
        """The model's tokenizer, loaded once (call with ``_init_lock`` held)."""
        if self._hf_tokenizer is None:
            self._hf_tokenizer = self._load_tokenizer()
            if self._hf_tokenizer is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
        return self._hf_tokenizer

    def _compile(self, kind: str, text: str, reasoning_prefix: str = "") -> Any:
        if self._num_processes:  # in the grammar process this constraint maps to
            processes = self.processes()
            self.num_compiles += 1
            return processes.compile(kind, text, reasoning_prefix)
        compiler = self.compiler()
        self.num_compiles += 1
        return compiler.compile_grammar(build_grammar(kind, text, reasoning_prefix))

    def is_usable(self, future: Future) -> bool:
        """Whether a finished compile can make matchers: it succeeded, and not in a grammar process
        that was started again since (which no longer holds it: compile it again)."""
        if future.exception() is not None:
            return False
        compiled = future.result()
        return not isinstance(compiled, RemoteCompiled) or self._processes.is_current(compiled)

    def new_request_grammar(
        self, compiled: Any, eos_token_ids: list[int]
    ) -> RequestGrammar | guidance.GuidanceRequestGrammar:
        """A fresh matcher for one request; the grammar's end lets only ``eos_token_ids`` through
        (llguidance: the model's end-of-sequence tokens)."""
        if isinstance(compiled, guidance.GuidanceGrammar):
            return self._guidance.new_request_grammar(compiled)
        stop = list(eos_token_ids) or self.eos_token_ids
        if isinstance(compiled, RemoteCompiled):
            return self._processes.new_grammar(compiled, stop or self._process_stop_ids)
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop or None), stop)

    # ---- bitmasks ------------------------------------------------------------------

    def bitmask(self, req_ids: list[str], grammars: list[Any]) -> GrammarBitmask:
        """The allowed next tokens of each request (rows in ``req_ids`` order), once every matcher
        has advanced past the tokens recorded since its last bitmask."""
        return self.start_bitmask(req_ids, grammars).result()

    def start_bitmask(self, req_ids: list[str], grammars: list[Any]) -> PendingBitmask:
        """Start :meth:`bitmask` in the manager's threads and return at once: the caller goes on with
        other work while xgrammar advances the matchers and fills their rows (batched native calls;
        the advance and the threaded fill let go of the GIL, the one-thread fill keeps it), and takes
        the mask with :meth:`PendingBitmask.result`. The grammars must not be advanced again before then."""
        import torch

        # Uninitialised: xgrammar's fill writes its rows whole; every other row is set explicitly
        # (through numpy: torch's ops wake its thread pool, milliseconds on a busy host; and no 2 MB
        # memset a step at 128 rows of a 128k vocabulary).
        shape = (len(grammars), bitmask_words(self.vocab_size))
        if self._processes is not None:  # (the processes write into shared memory)
            buffer, array = self._processes.take_buffer(len(grammars))
            mask = torch.from_numpy(array)
        else:
            mask = torch.empty(shape, dtype=torch.int32, pin_memory=self.pin_memory)
            array = mask.numpy()
        live, guided, remote = [], [], []
        for row, grammar in enumerate(grammars):
            local = isinstance(grammar, RequestGrammar)
            if not local and not isinstance(grammar, RemoteGrammar):
                guided.append(row)
                continue
            if local and len(grammar.unseen) > 1:  # (never at one token a step: after a resume, in tests)
                grammar.advance_alone(grammar.unseen[:-1])  # (a grammar process takes them all at once)
                del grammar.unseen[:-1]
            if grammar.failed:
                array[row] = -1  # a refused token was taken: the row's mask is lifted
            elif grammar.ended:
                grammar.write_stop_row(array[row])
            elif local:
                live.append(row)
                continue
            else:
                remote.append((row, grammar))
                continue
            grammar.unseen.clear()  # (a token after the end, such as EOS with ignore_eos: ignored)
        pending_remote = self._processes.start(buffer, array, remote) if remote else None
        if guided:  # llguidance's threads
            array[guided] = -1  # (its fill is not relied on to write every word)
            self._guidance.fill_rows([grammars[row] for row in guided], guided, mask)
        slices = min(len(live) // self.SLICE_ROWS, self._slice_threads) or 1
        if slices > 1 and self.THREADED_FILL:  # every row in one task of the fill thread
            whole = _SliceWork.of(grammars, live)
            future = self._fill_pool.submit(self._advance_and_fill, whole, mask, self._threaded_fill)
            return PendingBitmask(list(req_ids), mask, [whole], [future], pending_remote)
        bounds = [len(live) * i // slices for i in range(slices + 1)]
        work = [_SliceWork.of(grammars, live[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        futures = [
            self._slice_pool.submit(self._advance_and_fill, part, mask, self._one_thread_fill)
            for part in work
        ]
        return PendingBitmask(list(req_ids), mask, work, futures, pending_remote)

    @staticmethod
    def _advance_and_fill(work: _SliceWork, mask: Any, filler: Any) -> list[bool]:
        """In a pool thread: advance the matchers of ``work`` past their token (one native call, which
        lets go of the GIL), then fill their rows with ``filler`` (xgrammar's one-thread fill keeps
        the GIL while it runs; its threaded fill lets go of it)."""
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token(work.accept_matchers, work.tokens)
        if work.fill_matchers:
            filler.batch_fill_next_token_bitmask(work.fill_matchers, mask, work.fill_rows)
        return accepted

    SLICE_ROWS = 16
    """Fewest grammar rows worth a thread of their own (a row's advance and fill: tens of µs)."""

    THREADED_FILL = False
    """With enough rows for several slices, make the whole mask in one task of the fill thread:
    every matcher's advance in one native call, then xgrammar's threaded fill of every row, both
    without the GIL (one hand-over of the GIL to start, where slices need one each, and their
    one-thread fills keep it: they run one at a time and the engine loop waits meanwhile). Off
    until measured on a GPU host (docs/benchmarks.md, eighteenth session; ``--threaded-fill`` in
    benchmarks/structured_outputs.py)."""

    @functools.cached_property
    def _one_thread_fill(self) -> Any:
        """xgrammar's batched fill on the calling thread (used by one pool thread at a time)."""
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher(1)

    @functools.cached_property
    def _threaded_fill(self) -> Any:
        """xgrammar's batched fill on its own threads (used by the fill thread only)."""
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher(max(self._slice_threads, 2))

    def shutdown(self) -> None:
        with self._state_lock:
            self._closed = True
            processes = self._processes
        if processes is not None:
            processes.shutdown()
        self._slice_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._guidance_pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:  # frozen with it: collectable again (xgrammar reports leaks at exit)
            unfreeze_heap()
