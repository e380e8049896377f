"""``POST /v1/chat/completions``: messages through the chat template, assistant text out.

Streaming follows OpenAI's chunk sequence: one chunk per choice with
``delta.role = "assistant"`` first, then content deltas, the finish reason, an
optional usage chunk with no choices, and ``data: [DONE]``.

``prompt_logprobs`` (vLLM's extension) sits at the top level of the response,
as in vLLM; when streaming, in the first chunk after they arrive.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
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
    to_openai_error,
)
from fastdeploy.entrypoints.openai.serving_mm import MultimodalChatInputs


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat completions endpoint (text, and image / video feature parts)."""

    @property
    def mm_inputs(self) -> MultimodalChatInputs:
        """Feature-part handling (created on first use)."""
        if getattr(self, "_mm_inputs", None) is None:
            self._mm_inputs = MultimodalChatInputs(self.engine)
        return self._mm_inputs

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Validate, render, tokenize, run and answer one chat request."""
        model = self.resolve_model(request.model)
        params = request.to_sampling_params()
        self.check_params(params)
        self.check_healthy()

        conversation, items = await self.mm_inputs.split(request.messages, self._run_tokenizer)
        text = await self.render_chat(request.messages, conversation=conversation)
        token_ids = await self.encode(text, add_special_tokens=False, param="messages")
        if not token_ids:
            raise BadRequestError("The chat template produced an empty prompt", param="messages")
        token_ids, mm_items = await self.mm_inputs.place(token_ids, items)
        max_tokens = resolve_max_tokens(
            len(token_ids), params.max_tokens, self.engine.max_model_len, prompt_kind="messages"
        )
        prompts = [
            EnginePrompt(
                token_ids=token_ids,
                params=params.clone(max_tokens=max_tokens),
                text=text,
                mm_items=mm_items or None,
            )
        ]

        request_id = random_id("chatcmpl")
        num_prompt_lps = request.prompt_logprobs
        if request.stream:
            return SSEResponse(
                self._stream(request_id, model, prompts, request.include_usage, num_prompt_lps)
            )
        response = await run_until_disconnected(
            raw_request, self._collect(request_id, model, prompts, num_prompt_lps)
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        model: str,
        prompts: list[EnginePrompt],
        include_usage: bool,
        num_prompt_lps: int | None = None,
    ) -> AsyncIterator[str]:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        tracker = UsageTracker([request_id], prompts)
        exclude = None if include_usage else {"usage"}
        pending_prompt_lps = None  # sent with the next chunk after they arrive

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            nonlocal pending_prompt_lps
            body = ChatCompletionStreamResponse(
                id=request_id, model=model, choices=choices, prompt_logprobs=pending_prompt_lps
            )
            pending_prompt_lps = None
            return f"data: {body.model_dump_json(exclude=exclude)}\n\n"

        try:
            for k in range(n):
                yield chunk(
                    [ChatCompletionStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=""))]
                )
            async with contextlib.aclosing(self.iterate_outputs([request_id], prompts, tracker)) as outputs:
                async for _, out in outputs:
                    if out.prompt_logprobs is not None and num_prompt_lps is not None:
                        pending_prompt_lps = prompt_logprobs_json(
                            prompts[0].token_ids, out.prompt_logprobs, num_prompt_lps
                        )
                    choices = [
                        ChatCompletionStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                            logprobs=chat_logprobs(c.token_ids, c.logprobs, num_top) if c.logprobs else None,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                        for c in out.outputs
                        if c.text or c.finish_reason is not None or c.logprobs
                    ]
                    if choices:
                        yield chunk(choices)
            if include_usage:
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id, model=model, choices=[], usage=tracker.usage()
                )
                yield sse(usage_chunk)
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE

    async def _collect(
        self, request_id: str, model: str, prompts: list[EnginePrompt], num_prompt_lps: int | None = None
    ) -> ChatCompletionResponse:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop_reason: list[int | str | None] = [None] * n
        prompt_lps = None
        tracker = UsageTracker([request_id], prompts)
        try:
            async with contextlib.aclosing(self.iterate_outputs([request_id], prompts, tracker)) as outputs:
                async for _, out in outputs:
                    if out.prompt_logprobs is not None and num_prompt_lps is not None:
                        prompt_lps = prompt_logprobs_json(
                            prompts[0].token_ids, out.prompt_logprobs, num_prompt_lps
                        )
                    for c in out.outputs:
                        texts[c.index].append(c.text)
                        token_ids[c.index].extend(c.token_ids)
                        logprobs[c.index].extend(c.logprobs or [])
                        if c.finish_reason is not None:
                            finish[c.index], stop_reason[c.index] = c.finish_reason, c.stop_reason
        except Exception as exc:
            raise to_openai_error(exc) from exc
        choices = [
            ChatCompletionResponseChoice(
                index=k,
                message=ChatMessageOut(content="".join(texts[k])),
                logprobs=None if num_top is None else chat_logprobs(token_ids[k], logprobs[k], num_top),
                finish_reason=finish[k] or "abort",
                stop_reason=stop_reason[k],
            )
            for k in range(n)
        ]
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=tracker.usage(), prompt_logprobs=prompt_lps
        )
