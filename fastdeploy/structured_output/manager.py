"""The engine core's structured-output state: grammars compiled off the engine loop (once per distinct
constraint, an LRU of futures), one matcher per request, and the token bitmask of each step.

Backends (``FD_STRUCTURED_OUTPUTS_BACKEND``): ``xgrammar`` compiles every constraint and its
requests wait for the compile (the default); ``guidance`` (llguidance) builds matchers at once
and computes masks lazily; ``auto`` gives a request whose constraint has no compiled xgrammar
grammar yet an llguidance matcher right away and compiles the constraint with xgrammar in the
background, so later requests with the same constraint take xgrammar's faster masks. Without
llguidance installed, or for a model whose end-of-sequence ids lie outside its tokenizer's
vocabulary (llguidance could not stop), ``auto`` is ``xgrammar``. docs/benchmarks.md has why
``xgrammar`` is the default.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastdeploy import envs
from fastdeploy.core.sampling_params import StructuredOutputsParams
from fastdeploy.core.step_io import GrammarBitmask
from fastdeploy.platforms.gc_heap import freeze_late_heap, unfreeze_heap
from fastdeploy.structured_output import guidance
from fastdeploy.structured_output.grammar import build_grammar, constraint_key

logger = logging.getLogger(__name__)


BACKENDS = ("auto", "xgrammar", "guidance")
"""Values of ``FD_STRUCTURED_OUTPUTS_BACKEND``."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit ``t % 32`` of word ``t // 32`` allows token t)."""
    return (vocab_size + 31) // 32


class RequestGrammar:
    """The grammar matcher of one request (one choice), advanced with each of its output tokens.

    Implements the scheduler's ``core.request.GrammarState`` protocol.
    """

    def __init__(self, matcher: Any, stop_token_ids: list[int]):
        self.matcher = matcher
        self.stop_token_ids = list(stop_token_ids)
        """What may follow once the grammar has ended (sampled on only with ``ignore_eos``)."""
        self.failed = False
        """A token the grammar refused was accepted anyway (never expected: it is logged once)."""
        self.unseen: list[int] = []
        """Output tokens the matcher has not advanced past yet: the manager feeds them to the
        matchers in parallel slices before it fills their rows (:meth:`StructuredOutputManager.bitmask`)."""

    def accept_token(self, token_id: int) -> None:
        """Record an output token; the matcher advances past it before its next bitmask."""
        self.unseen.append(token_id)


class StructuredOutputManager:
    """Compiles grammars in threads (a slow compile delays only its own requests) and builds bitmasks.

    ``load_tokenizer`` is called once, in a compile thread, when the first grammar is needed.
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        """The model's vocabulary (the logits' width, maybe padded past the tokenizer's)."""
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._hf_tokenizer: Any = None
        self._init_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(envs.FD_GRAMMAR_COMPILE_THREADS, 1), "fd-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.cache_size = envs.FD_GRAMMAR_CACHE_SIZE
        self._slice_threads = max(envs.FD_GRAMMAR_COMPILE_THREADS - 1, 1)
        self._slice_pool = ThreadPoolExecutor(self._slice_threads, "fd-grammar-mask")
        """Advances and fills slices of the matchers next to the calling thread."""
        self._local = threading.local()
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

    # ---- compiling -----------------------------------------------------------------

    def compiler(self) -> Any:
        """xgrammar's compiler for this model's tokenizer (built on first use)."""
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
                )
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
        if future is not None and not (future.done() and future.exception() is not None):
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
                        envs.FD_GRAMMAR_COMPILE_THREADS,
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
        compiler = self.compiler()
        self.num_compiles += 1
        return compiler.compile_grammar(build_grammar(kind, text, reasoning_prefix))

    def new_request_grammar(
        self, compiled: Any, eos_token_ids: list[int]
    ) -> RequestGrammar | guidance.GuidanceRequestGrammar:
        """A fresh matcher for one request; the grammar's end lets only ``eos_token_ids`` through
        (llguidance: the model's end-of-sequence tokens)."""
        if isinstance(compiled, guidance.GuidanceGrammar):
            return self._guidance.new_request_grammar(compiled)
        import xgrammar as xgr

        stop = list(eos_token_ids) or self.eos_token_ids
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop or None), stop)

    # ---- bitmasks ------------------------------------------------------------------

    def bitmask(self, req_ids: list[str], grammars: list[Any]) -> GrammarBitmask:
        """The allowed next tokens of each request (rows in ``req_ids`` order), once every matcher
        has advanced past the tokens recorded since its last bitmask."""
        import numpy as np
        import torch

        # Uninitialised: xgrammar's fill writes its rows whole; every other row is set explicitly.
        # (numpy, not torch: torch's ops wake its thread pool, milliseconds on a busy host; and no
        # 2 MB memset a step at 128 rows of a 128k vocabulary.)
        array = np.empty((len(grammars), bitmask_words(self.vocab_size)), dtype=np.int32)
        mask = torch.from_numpy(array)
        xgrammar_rows, guided = [], []
        for row, grammar in enumerate(grammars):
            if grammar.failed:
                array[row] = -1  # a refused token was taken: the row's mask is lifted
            elif isinstance(grammar, RequestGrammar):
                xgrammar_rows.append(row)
            else:
                guided.append(row)
        if guided:  # llguidance's threads
            array[guided] = -1  # (its fill is not relied on to write every word)
            self._guidance.fill_rows([grammars[row] for row in guided], guided, mask)
        self._in_slices(xgrammar_rows, lambda rows: self._advance_and_fill(grammars, rows, mask))
        return GrammarBitmask(req_ids=list(req_ids), bitmask=array.tobytes(), words=array.shape[1])

    def _advance_and_fill(self, grammars: list[Any], rows: list[int], mask: Any) -> None:
        """Advance the matchers of ``rows`` past their unseen tokens, then write their rows of
        ``mask``: the grammar's next tokens, or only the stop tokens once it has ended (its stop token
        was taken and ignored: ``ignore_eos``), or everything after a refused token."""
        import numpy as np

        self._advance_slice([grammars[row] for row in rows if grammars[row].unseen])
        array = mask.numpy()
        fill_rows, fill_matchers = [], []
        for row in rows:
            grammar = grammars[row]
            if grammar.failed:
                array[row] = -1
            elif grammar.matcher.is_terminated():
                bits = array[row].view(np.uint32)
                bits[:] = 0
                for token in grammar.stop_token_ids:
                    bits[token // 32] |= np.uint32(1 << (token % 32))
            else:
                fill_rows.append(row)
                fill_matchers.append(grammar.matcher)
        if fill_matchers:  # xgrammar's fill on this thread (its own thread pool costs more than it saves)
            self._fill_matcher().batch_fill_next_token_bitmask(fill_matchers, mask, fill_rows)

    def _advance(self, grammars: list[RequestGrammar]) -> None:
        """Advance the matchers past their unseen tokens (in parallel slices), without filling."""
        self._in_slices(
            list(range(len(grammars))), lambda rows: self._advance_slice([grammars[i] for i in rows])
        )

    def _advance_slice(self, grammars: list[RequestGrammar]) -> None:
        """Feed each matcher its unseen tokens, one token of every matcher per batched call (a token
        after the grammar ended, such as EOS, is ignored; a refused one lifts the row's mask)."""
        import xgrammar as xgr

        while grammars:
            live, tokens = [], []
            for grammar in grammars:
                token = grammar.unseen.pop(0)
                if not grammar.failed and not grammar.matcher.is_terminated():
                    live.append(grammar)
                    tokens.append(token)
            accepted = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in live], tokens)
            for grammar, token, ok in zip(live, tokens, accepted):
                if not ok:
                    grammar.failed = True
                    logger.error(
                        "structured output: token %d does not follow the grammar; the mask is lifted", token
                    )
            grammars = [g for g in grammars if g.unseen]

    SLICE_ROWS = 16
    """Fewest grammar rows worth a thread of their own (advance and fill: ~10 µs a row on one core)."""

    def _in_slices(self, rows: list[int], work: Callable[[list[int]], None]) -> None:
        """``work`` over slices of ``rows``: one in the calling thread, the others in the pool of
        ``FD_GRAMMAR_COMPILE_THREADS - 1`` threads (xgrammar releases the GIL in its calls)."""
        slices = min(len(rows) // self.SLICE_ROWS, self._slice_threads + 1)
        if slices <= 1:
            if rows:
                work(rows)
            return
        bounds = [len(rows) * i // slices for i in range(slices + 1)]
        futures = [self._slice_pool.submit(work, rows[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
        work(rows[: bounds[1]])
        for future in futures:
            future.result()

    def _fill_matcher(self) -> Any:
        """xgrammar's batched fill on the calling thread (one per thread: they run at once)."""
        matcher = getattr(self._local, "fill", None)
        if matcher is None:
            import xgrammar as xgr

            matcher = self._local.fill = xgr.BatchGrammarMatcher(1)
        return matcher

    def shutdown(self) -> None:
        self._slice_pool.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._guidance_pool.shutdown(wait=False, cancel_futures=True)
        if self._compiler is not None:  # frozen with it: collectable again (xgrammar reports leaks at exit)
            unfreeze_heap()
