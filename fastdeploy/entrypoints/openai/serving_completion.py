"""``POST /v1/completions``: prompts in, text out (streamed as SSE or in one response).

A request may carry several prompts; each becomes one engine request, and
choice ``k`` of prompt ``i`` is reported as index ``i * n + k``. Streaming sends
one choice per chunk, as OpenAI does.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.core.outputs import Logprob
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.event_streams import (
    SSE_DONE,
    SSEResponse,
    error_event,
    run_until_disconnected,
    sse,
    to_openai_error,
)
from fastdeploy.entrypoints.openai.logprobs import completion_logprobs, prompt_logprobs_json
from fastdeploy.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptLogprobs,
    matched_stop,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.request_ids import api_request_id
from fastdeploy.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    StartedRequests,
    sub_request_ids,
)
from fastdeploy.entrypoints.openai.stream_chunks import completion_text_chunk
from fastdeploy.entrypoints.openai.timeline_log import TimelineRecorder


@dataclass
class CompletionExtras:
    """What a completion adds around the generated text: the echoed prompt, the prompt logprobs."""

    echo_texts: list[str] | None = None
    """Per prompt, the text that starts each of its choices (``echo``); None: no echo."""
    num_prompt_logprobs: int | None = None
    """The ``prompt_logprobs`` the client asked for (None: leave the field out)."""
    return_token_ids: bool = False
    """Report each choice's ``prompt_token_ids`` and ``token_ids`` (vLLM's extension)."""
    continuous_usage: bool = False
    """Streaming: the usage so far in every chunk (vLLM's ``continuous_usage_stats``)."""
    tokens_as_ids: bool = False
    """Logprobs tokens as ``token_id:N`` (``return_tokens_as_token_ids``)."""


class OpenAIServingCompletion(OpenAIServing):
    """Handler of the completions endpoint.

    With ``echo`` each choice's text (and, with ``logprobs``, its logprobs, the
    first prompt token's being null) starts with the prompt; the engine is asked
    for prompt logprobs for that. Streaming sends the prompt in a choice's first
    chunk, as it sends ``prompt_logprobs``.
    """

    def __init__(self, *args: Any, max_prompts_per_request: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_prompts_per_request = max_prompts_per_request
        """Most prompts one request may carry (None: no limit)."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Validate, tokenize, run and answer one completions request."""
        model = self.resolve_model(request.model)
        params = request.to_sampling_params(self.sampling_defaults)
        params = self.check_params(params)
        self.check_healthy()
        limit = self.max_prompts_per_request
        if limit is not None and len(request.prompt) > limit:
            raise BadRequestError(
                f"prompt holds {len(request.prompt)} prompts; this server takes at most {limit} per request",
                param="prompt",
            )

        prompts: list[EnginePrompt] = []
        for prompt in request.prompt:
            if isinstance(prompt, str):
                text: str | None = prompt
                token_ids = await self.encode(prompt, add_special_tokens=True)
                if not token_ids:
                    raise BadRequestError("prompt must not be empty", param="prompt")
            else:
                text, token_ids = None, list(prompt)
                self.check_token_ids(token_ids, "prompt")
            kept = self.keep_last(token_ids, request.truncate_prompt_tokens, request.truncation_side)
            if len(kept) < len(token_ids):  # cut: the prompt is its kept tokens (echo decodes them)
                text, token_ids = None, kept
            max_tokens = resolve_max_tokens(
                len(token_ids),
                params.max_tokens,
                self.engine.max_model_len,
                default=CompletionRequest.DEFAULT_MAX_TOKENS,
                prompt_kind="prompt",
            )
            prompts.append(
                EnginePrompt(token_ids=token_ids, params=params.clone(max_tokens=max_tokens), text=text)
            )

        tokenized = time.monotonic()
        include_usage, continuous_usage = request.usage_in_stream(self.force_include_usage)
        extras = CompletionExtras(
            num_prompt_logprobs=request.prompt_logprobs,
            return_token_ids=bool(request.return_token_ids),
            continuous_usage=continuous_usage,
            tokens_as_ids=self.tokens_as_ids(request),
        )
        if request.echo:  # token-id prompts echo as their decoded text
            extras.echo_texts = [
                p.text if p.text is not None else await self.decode(p.token_ids) for p in prompts
            ]
        request_id, engine_id = api_request_id("cmpl", raw_request)
        started = await self.start_requests(sub_request_ids(engine_id, len(prompts)), prompts)
        if request.stream:
            recorder = TimelineRecorder(getattr(raw_request.state, "received", None), tokenized)
            return SSEResponse(
                self._stream(request_id, model, started, prompts, include_usage, extras, recorder),
                on_close=started.close,
            )
        try:
            response = await run_until_disconnected(
                raw_request, self._collect(request_id, model, started, prompts, extras)
            )
        finally:
            await started.close()
        return JSONResponse(response.model_dump())

    def _decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    @staticmethod
    def _prompt_logprobs_field(
        prompt: EnginePrompt, prompt_lps: list[dict[int, Logprob] | None] | None, extras: CompletionExtras
    ) -> PromptLogprobs | None:
        if extras.num_prompt_logprobs is None or prompt_lps is None:
            return None
        return prompt_logprobs_json(prompt.token_ids, prompt_lps, extras.num_prompt_logprobs)

    @staticmethod
    def _echo(
        prompt: EnginePrompt,
        echo_text: str,
        prompt_lps: list[dict[int, Logprob] | None] | None,
        text: str,
        token_ids: list[int],
        logprobs: list,
        want_logprobs: bool,
    ) -> tuple[str, list[int], list]:
        """Text, token ids and logprob entries of a choice with its prompt in front."""
        if want_logprobs:
            logprobs = list(prompt_lps or [None] * len(prompt.token_ids)) + list(logprobs)
        return echo_text + text, list(prompt.token_ids) + list(token_ids), logprobs

    async def _stream(
        self,
        request_id: str,
        model: str,
        started: StartedRequests,
        prompts: list[EnginePrompt],
        include_usage: bool,
        extras: CompletionExtras,
        recorder: TimelineRecorder | None = None,
    ) -> AsyncIterator[str | bytes]:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        offsets = [0] * (len(prompts) * n)
        begun = [False] * (len(prompts) * n)
        prompt_lps: list[list | None] = [None] * len(prompts)
        tracker = started.tracker
        exclude = None if include_usage else {"usage"}
        first_has_extras = (
            extras.echo_texts is not None or extras.num_prompt_logprobs is not None or extras.return_token_ids
        )
        created = int(time.time())  # one creation time for every chunk of the stream, as OpenAI's
        plain = num_top is None and not extras.continuous_usage
        """Chunks carry text only (and token ids when asked), past each choice's first: the fast encoder."""

        def logprobs_of(k: int, token_ids: list[int], logprobs: list) -> object:
            if num_top is None or not logprobs:
                return None
            lp = completion_logprobs(
                token_ids, logprobs, num_top, offsets[k], self._decode_token, extras.tokens_as_ids
            )
            offsets[k] += sum(len(t) for t in lp.tokens)
            return lp

        try:
            async with contextlib.aclosing(started.outputs()) as outputs:
                async for i, out in outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        k = i * n + c.index
                        first = not begun[k]
                        text, token_ids, logprobs = c.text, c.token_ids, c.logprobs or []
                        if first and extras.echo_texts is not None:
                            text, token_ids, logprobs = self._echo(
                                prompts[i], extras.echo_texts[i], prompt_lps[i], text, token_ids, logprobs,
                                num_top is not None,
                            )  # fmt: skip
                        # every step with tokens is a chunk, even one whose text is still held
                        # back (a character's first bytes): clients time tokens by chunks
                        if not (
                            text
                            or c.token_ids
                            or c.finish_reason is not None
                            or logprobs
                            or (first and first_has_extras)
                        ):
                            continue
                        begun[k] = True
                        if plain and not (first and first_has_extras):
                            yield completion_text_chunk(
                                request_id, created, model, k, text, c.finish_reason, c.stop_reason,
                                list(c.token_ids) if extras.return_token_ids else None, include_usage,
                            )  # fmt: skip
                            if recorder is not None and c.token_ids:
                                recorder.written(out)
                            continue
                        choice = CompletionStreamChoice(
                            index=k,
                            text=text,
                            logprobs=logprobs_of(k, token_ids, logprobs),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=list(c.token_ids) if extras.return_token_ids else None,
                            prompt_logprobs=self._prompt_logprobs_field(prompts[i], prompt_lps[i], extras)
                            if first
                            else None,
                            prompt_token_ids=list(prompts[i].token_ids)
                            if first and extras.return_token_ids
                            else None,
                        )
                        chunk = CompletionStreamResponse(
                            id=request_id,
                            created=created,
                            model=model,
                            choices=[choice],
                            usage=tracker.usage() if extras.continuous_usage else None,
                        )
                        yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
                        if recorder is not None and c.token_ids:
                            recorder.written(out)
            if include_usage:
                yield sse(
                    CompletionStreamResponse(
                        id=request_id, created=created, model=model, choices=[], usage=tracker.usage()
                    )
                )
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE
        if recorder is not None:
            recorder.finish()

    async def _collect(
        self,
        request_id: str,
        model: str,
        started: StartedRequests,
        prompts: list[EnginePrompt],
        extras: CompletionExtras,
    ) -> CompletionResponse:
        n = prompts[0].params.n
        num_choices = len(prompts) * n
        num_top = prompts[0].params.logprobs
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        logprobs: list[list] = [[] for _ in range(num_choices)]
        finish: list[str | None] = [None] * num_choices
        stop_reason: list[int | str | None] = [None] * num_choices
        prompt_lps: list[list | None] = [None] * len(prompts)
        tracker = started.tracker
        try:
            async with contextlib.aclosing(started.outputs()) as outputs:
                async for i, out in outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[i] = out.prompt_logprobs
                    for c in out.outputs:
                        k = i * n + c.index
                        texts[k].append(c.text)
                        token_ids[k].extend(c.token_ids)
                        logprobs[k].extend(c.logprobs or [])
                        if c.finish_reason is not None:
                            finish[k], stop_reason[k] = c.finish_reason, c.stop_reason
        except Exception as exc:
            raise to_openai_error(exc) from exc
        choices = []
        for k in range(num_choices):
            i = k // n
            text, ids, lps = "".join(texts[k]), token_ids[k], logprobs[k]
            if extras.echo_texts is not None:
                text, ids, lps = self._echo(
                    prompts[i], extras.echo_texts[i], prompt_lps[i], text, ids, lps, num_top is not None
                )
            choices.append(
                CompletionResponseChoice(
                    index=k,
                    text=text,
                    logprobs=None
                    if num_top is None
                    else completion_logprobs(ids, lps, num_top, 0, self._decode_token, extras.tokens_as_ids),
                    finish_reason=finish[k] or "abort",
                    stop_reason=stop_reason[k],
                    matched_stop=matched_stop(finish[k], stop_reason[k], token_ids[k]),
                    token_ids=token_ids[k] if extras.return_token_ids else None,
                    prompt_logprobs=self._prompt_logprobs_field(prompts[i], prompt_lps[i], extras),
                    prompt_token_ids=list(prompts[i].token_ids) if extras.return_token_ids else None,
                )
            )
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=tracker.usage())
