"""``POST /v1/completions``: prompts in, text out (streamed as SSE or in one response).

A request may carry several prompts; each becomes one engine request, and
choice ``k`` of prompt ``i`` is reported as index ``i * n + k``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.logprobs import completion_logprobs
from fastdeploy.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    random_id,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EnginePrompt,
    OpenAIServing,
    SSEResponse,
    UsageTracker,
    error_event,
    run_until_disconnected,
    sse,
    sub_request_ids,
    to_openai_error,
)


class OpenAIServingCompletion(OpenAIServing):
    """Handler of the completions endpoint."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Validate, tokenize, run and answer one completions request."""
        model = self.resolve_model(request.model)
        params = request.to_sampling_params()
        self.check_params(params)
        self.check_healthy()

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

        request_id = random_id("cmpl")
        request_ids = sub_request_ids(request_id, len(prompts))
        if request.stream:
            return SSEResponse(self._stream(request_id, model, request_ids, prompts, request.include_usage))
        response = await run_until_disconnected(
            raw_request, self._collect(request_id, model, request_ids, prompts)
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        model: str,
        request_ids: list[str],
        prompts: list[EnginePrompt],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        offsets = [0] * (len(prompts) * n)
        tracker = UsageTracker(request_ids, prompts)
        exclude = None if include_usage else {"usage"}

        def logprobs_of(k: int, c) -> object:
            if num_top is None or not c.logprobs:
                return None
            lp = completion_logprobs(c.token_ids, c.logprobs, num_top, offsets[k])
            offsets[k] += sum(len(t) for t in lp.tokens)
            return lp

        try:
            async with contextlib.aclosing(self.iterate_outputs(request_ids, prompts, tracker)) as outputs:
                async for i, out in outputs:
                    choices = [
                        CompletionResponseChoice(
                            index=i * n + c.index,
                            text=c.text,
                            logprobs=logprobs_of(i * n + c.index, c),
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        for c in out.outputs
                        if c.text or c.finish_reason is not None or c.logprobs
                    ]
                    if choices:
                        chunk = CompletionStreamResponse(id=request_id, model=model, choices=choices)
                        yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
            if include_usage:
                yield sse(
                    CompletionStreamResponse(id=request_id, model=model, choices=[], usage=tracker.usage())
                )
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE

    async def _collect(
        self, request_id: str, model: str, request_ids: list[str], prompts: list[EnginePrompt]
    ) -> CompletionResponse:
        n = prompts[0].params.n
        num_choices = len(prompts) * n
        num_top = prompts[0].params.logprobs
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        logprobs: list[list] = [[] for _ in range(num_choices)]
        finish: list[str | None] = [None] * num_choices
        stop_reason: list[int | str | None] = [None] * num_choices
        tracker = UsageTracker(request_ids, prompts)
        try:
            async with contextlib.aclosing(self.iterate_outputs(request_ids, prompts, tracker)) as outputs:
                async for i, out in outputs:
                    for c in out.outputs:
                        k = i * n + c.index
                        texts[k].append(c.text)
                        token_ids[k].extend(c.token_ids)
                        logprobs[k].extend(c.logprobs or [])
                        if c.finish_reason is not None:
                            finish[k], stop_reason[k] = c.finish_reason, c.stop_reason
        except Exception as exc:
            raise to_openai_error(exc) from exc
        choices = [
            CompletionResponseChoice(
                index=k,
                text="".join(texts[k]),
                logprobs=None
                if num_top is None
                else completion_logprobs(token_ids[k], logprobs[k], num_top, 0),
                finish_reason=finish[k] or "abort",
                stop_reason=stop_reason[k],
            )
            for k in range(num_choices)
        ]
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=tracker.usage())
