"""SGLang's native API: ``POST /generate`` (prompts in, text, token ids and ``meta_info`` out, streamed
as the text and ids so far), ``POST /abort_request``, ``/flush_cache``, ``GET /get_model_info`` and
``GET /get_server_info``, as SGLang's server answers them, on this server's engine.

One prompt (a string, or a flat list of token ids) with ``n`` of 1 is answered with one object, a
batch or ``n`` > 1 with a list in prompt order (a prompt's ``n`` answers together). Each answer::

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "e2e_latency", and with return_logprob
     "input_token_logprobs", "output_token_logprobs" (+ "*_top_logprobs" with top_logprobs_num)}}

``finish_reason`` is SGLang's object: ``{"type": "length", "length": N}``, ``{"type": "stop",
"matched": <stop string or token id>}`` or ``{"type": "abort", "message": ...}``. A logprob entry
is ``[logprob, token_id, text or null]``. Streamed events carry the whole text and ids so far
(SGLang's default), plus ``"index"`` (the answer's place in the list) for a batch or ``n`` > 1,
then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import fastdeploy
from fastdeploy.core.outputs import Logprob, RequestOutput
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.event_streams import (
    SSE_DONE,
    SSEResponse,
    error_event,
    run_until_disconnected,
    sse,
    to_openai_error,
)
from fastdeploy.entrypoints.openai.protocol import matched_stop, resolve_max_tokens
from fastdeploy.entrypoints.openai.protocol.generate import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerateRequest,
    sglang_sampling_params,
)
from fastdeploy.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    StartedRequests,
    abort_quietly,
)

FLUSHED = "Cache flushed.\n"
"""``/flush_cache``'s answer once the prefix cache is reset (SGLang's first line)."""
NOT_FLUSHED = (
    "Cache not flushed: requests are running or waiting (it is flushed only while the server is idle).\n"
)
"""Its answer (a 400) when it could not be reset."""


@dataclass
class _Answer:
    """One answer (a prompt's choice) as it grows."""

    rid: str
    prompt: EnginePrompt
    logprob_start: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached_tokens: int = 0
    finished: bool = False


class OpenAIServingGenerate(OpenAIServing):
    """SGLang's native routes (module docstring)."""

    def __init__(self, *args: Any, max_prompts_per_request: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_prompts_per_request = max_prompts_per_request
        self._running: dict[str, _Running] = {}
        """SGLang request id → its engine requests, while they run (``/abort_request``)."""

    async def generate(self, request: GenerateRequest, raw_request: Request) -> Response:
        """Validate, tokenize and run a ``/generate`` request; its answer(s), whole or streamed."""
        self.check_healthy()
        inputs = request.prompts()
        limit = self.max_prompts_per_request
        if limit is not None and len(inputs) > limit:
            raise BadRequestError(
                f"the request holds {len(inputs)} prompts; this server takes at most {limit}", param="text"
            )
        top = request.top_logprobs_num if request.return_logprob else None
        prompts: list[EnginePrompt] = []
        starts: list[int] = []
        for i, prompt in enumerate(inputs):
            if isinstance(prompt, str):
                token_ids = await self.encode(prompt, add_special_tokens=True, param="text")
            else:
                token_ids = list(prompt)
                self.check_token_ids(token_ids, "input_ids")
            if not token_ids:
                raise BadRequestError("input_ids cannot be empty.", param="input_ids")
            start = request.logprob_start_len if request.logprob_start_len >= 0 else len(token_ids) - 1
            if request.return_logprob and start >= len(token_ids):
                raise BadRequestError(
                    f"logprob_start_len ({start}) is higher than the number of input tokens ({len(token_ids)}). "
                    "Please use a smaller logprob_start_len.",
                    param="logprob_start_len",
                )
            raw = request.params_for(i, len(inputs))
            params = self.check_params(sglang_sampling_params(raw, top, top), "top_logprobs_num")
            max_tokens = resolve_max_tokens(
                len(token_ids),
                raw.get("max_new_tokens"),
                self.engine.max_model_len,
                default=DEFAULT_MAX_NEW_TOKENS,
            )
            text = prompt if isinstance(prompt, str) else None
            prompts.append(EnginePrompt(token_ids, params.clone(max_tokens=max_tokens), text))
            starts.append(start)
        if len({p.params.n for p in prompts}) > 1:
            raise BadRequestError("every prompt of a batch must have the same n", param="sampling_params.n")
        n = prompts[0].params.n
        single = request.is_single and n == 1
        rids = _answer_ids(request.rid, len(prompts), n, single)
        engine_ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
        answers = [
            _Answer(rids[i * n + k], prompts[i], starts[i]) for i in range(len(prompts)) for k in range(n)
        ]
        started = await self.start_requests(engine_ids, prompts)
        running = _Running(engine_ids)
        for rid in rids:
            self._running[rid] = running
        view = _View(self, request, n, time.monotonic())
        if request.stream:

            async def close() -> None:
                self._forget(rids, running)
                await started.close()

            return SSEResponse(self._stream(started, answers, view, single, running), on_close=close)
        try:
            await run_until_disconnected(raw_request, _collect(started, answers, n, running))
        finally:
            self._forget(rids, running)
            await started.close()
        results = [view.answer(a) for a in answers]
        return JSONResponse(results[0] if single else results)

    async def _stream(
        self, started: StartedRequests, answers: list[_Answer], view: _View, single: bool, running: _Running
    ) -> AsyncIterator[str]:
        def event(pos: int) -> str:
            answer = view.answer(answers[pos])
            if not single:
                answer["index"] = pos
            return sse(answer)

        try:
            async with contextlib.aclosing(started.outputs()) as outputs:
                async for i, out in outputs:
                    for pos in _take(answers, i, view.n, out):
                        yield event(pos)
        except asyncio.CancelledError:
            if not running.aborted:
                raise
            for pos in _end_aborted(answers):
                yield event(pos)
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as SGLang does
            yield error_event(exc)
        yield SSE_DONE

    def _forget(self, rids: list[str], running: _Running) -> None:
        for rid in rids:
            if self._running.get(rid) is running:
                del self._running[rid]

    async def abort(self, rid: str | None, abort_all: bool) -> None:
        """``/abort_request``: end the requests of ``rid`` (or every ``/generate`` request) now; their
        answers report what they generated and ``finish_reason`` ``{"type": "abort"}``."""
        if abort_all:
            targets = {id(r): r for r in self._running.values()}.values()
        else:
            targets = [self._running[rid]] if rid in self._running else []
        for running in list(targets):
            running.aborted = True
            await abort_quietly(self.engine, running.engine_ids)

    def model_info(self) -> dict[str, Any]:
        """``/get_model_info`` (SGLang's): where the model and tokenizer are, whether it generates."""
        source = getattr(self.engine, "source", None)
        path = str(getattr(source, "path", "") or "") or None
        config = getattr(getattr(self.engine, "config", None), "model", None)
        return {
            "model_path": path,
            "tokenizer_path": getattr(config, "tokenizer", None) or path,
            "is_generation": getattr(self.engine, "pooler", None) is None,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }

    def server_info(self) -> dict[str, Any]:
        """``/get_server_info`` (SGLang's): the version and the token capacity of the server."""
        config = getattr(self.engine, "config", None)
        block_size = getattr(getattr(config, "cache", None), "block_size", 0) or 0
        num_blocks = getattr(self.engine, "num_blocks", 0) or 0
        return {
            "version": fastdeploy.__version__,
            "model_path": self.model_info()["model_path"],
            "served_model_name": self.served_model_names[0],
            "context_length": self.engine.max_model_len,
            "max_total_num_tokens": num_blocks * block_size,
            "max_req_input_len": self.engine.max_model_len - 1,
            "internal_states": [{}],
        }


def _answer_ids(rid: str | list[str] | None, count: int, n: int, single: bool) -> list[str]:
    """``meta_info.id`` of every answer: the request's ``rid`` (one per prompt in a list), made
    unique per answer when there are several, else new ids."""
    if isinstance(rid, list):
        if len(rid) != count:
            raise BadRequestError(f"rid has {len(rid)} ids for {count} prompts", param="rid")
        bases = list(rid)
    else:
        base = rid or uuid.uuid4().hex
        bases = [base if count == 1 else f"{base}_{i}" for i in range(count)]
    if single:
        return bases
    return [bases[i] if n == 1 else f"{bases[i]}_{k}" for i in range(count) for k in range(n)]


def _take(answers: list[_Answer], i: int, n: int, out: RequestOutput) -> list[int]:
    """Add engine request ``i``'s delta output to its answers; the positions it changed."""
    changed = []
    for c in out.outputs:
        pos = i * n + c.index
        answer = answers[pos]
        answer.texts.append(c.text)
        answer.token_ids.extend(c.token_ids)
        answer.logprobs.extend(c.logprobs or [])
        answer.cached_tokens = max(answer.cached_tokens, out.num_cached_tokens or 0)
        if out.prompt_logprobs is not None:
            answer.prompt_logprobs = out.prompt_logprobs
        if c.finish_reason is not None:
            answer.finish_reason, answer.stop_reason, answer.finished = c.finish_reason, c.stop_reason, True
        changed.append(pos)
    if out.finished:  # (an aborted request ends without a finish reason of its own)
        for k in range(n):
            answers[i * n + k].finished = True
    return changed


async def _collect(started: StartedRequests, answers: list[_Answer], n: int, running: _Running) -> None:
    try:
        async with contextlib.aclosing(started.outputs()) as outputs:
            async for i, out in outputs:
                _take(answers, i, n, out)
    except asyncio.CancelledError:  # what an engine abort raises in its stream: ours, or a real cancel
        if not running.aborted:
            raise
        _end_aborted(answers)
    except Exception as exc:
        raise to_openai_error(exc) from exc


def _end_aborted(answers: list[_Answer]) -> list[int]:
    """Mark the unfinished answers aborted; their positions."""
    ended = [pos for pos, a in enumerate(answers) if not a.finished]
    for pos in ended:
        answers[pos].finish_reason, answers[pos].finished = "abort", True
    return ended


@dataclass
class _Running:
    """The engine requests of one ``/generate`` request, and whether ``/abort_request`` ended them."""

    engine_ids: list[str]
    aborted: bool = False


class _View:
    """Writes answers as SGLang's JSON objects."""

    def __init__(self, serving: OpenAIServingGenerate, request: GenerateRequest, n: int, began: float):
        self.serving = serving
        self.request = request
        self.n = n
        self.began = began
        self._texts: dict[int, str] = {}
        """Token id → its text (a stream writes every logprob again in each event: decoded once)."""

    def answer(self, a: _Answer) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": a.rid,
            "finish_reason": self._finish_reason(a),
            "prompt_tokens": len(a.prompt.token_ids),
            "completion_tokens": len(a.token_ids),
            "cached_tokens": a.cached_tokens,
        }
        if a.finished:
            meta["e2e_latency"] = time.monotonic() - self.began
        if self.request.return_logprob:
            meta.update(self._logprobs(a))
        return {"text": "".join(a.texts), "output_ids": list(a.token_ids), "meta_info": meta}

    @staticmethod
    def _finish_reason(a: _Answer) -> dict[str, Any] | None:
        if not a.finished:
            return None
        if a.finish_reason == "length":
            return {"type": "length", "length": len(a.token_ids)}
        if a.finish_reason == "stop":
            return {"type": "stop", "matched": matched_stop(a.finish_reason, a.stop_reason, a.token_ids)}
        return {"type": "abort", "message": "The request was aborted.", "status_code": None, "err_type": None}

    def _entry(self, token: int, lp: Logprob | None) -> list[Any]:
        text = None
        if self.request.return_text_in_logprobs:
            text = self._texts.get(token)
            if text is None:
                text = self._texts[token] = self.serving.tokenizer.decode([token])
        return [None if lp is None else lp.logprob, token, text]

    def _top(self, entry: dict[int, Logprob] | None) -> list[list[Any]] | None:
        if entry is None:
            return None
        k = self.request.top_logprobs_num
        ranked = sorted(
            ((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
            key=lambda item: item[0],
        )
        return [self._entry(t, lp) for _, t, lp in ranked]

    def _logprobs(self, a: _Answer) -> dict[str, Any]:
        prompt_ids = a.prompt.token_ids
        prompt_lps = a.prompt_logprobs or [None] * len(prompt_ids)
        positions = range(a.logprob_start, len(prompt_ids))
        out: dict[str, Any] = {
            "input_token_logprobs": [
                self._entry(
                    prompt_ids[p], None if prompt_lps[p] is None else prompt_lps[p].get(prompt_ids[p])
                )
                for p in positions
            ],
            "output_token_logprobs": [self._entry(t, lp.get(t)) for t, lp in zip(a.token_ids, a.logprobs)],
        }
        if self.request.top_logprobs_num > 0:
            out["input_top_logprobs"] = [self._top(prompt_lps[p]) for p in positions]
            out["output_top_logprobs"] = [self._top(lp) for lp in a.logprobs]
        return out
