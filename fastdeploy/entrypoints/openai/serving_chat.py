"""``POST /v1/chat/completions``: messages through the chat template, assistant text out.

Streaming follows OpenAI's chunk sequence, one choice per chunk: a chunk per
choice with ``delta.role = "assistant"`` first, then content deltas, the finish
reason, an optional usage chunk with no choices, and ``data: [DONE]``.

``prompt_logprobs`` and ``prompt_token_ids`` (vLLM's extensions) sit at the top
level of the response, as in vLLM; when streaming, ``prompt_token_ids`` in the
first chunk and ``prompt_logprobs`` in the first chunk after they arrive.

With a reasoning parser (``--reasoning-parser``), the answer's reasoning goes to
``reasoning_content`` and ``reasoning`` (message and deltas alike) and the rest to
``content``; an answer cut inside its reasoning has ``content: null``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.core.outputs import CompletionOutput
from fastdeploy.engine.protocol import EngineClient
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
from fastdeploy.entrypoints.openai.reasoning import ReasoningParser, ReasoningStream
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
from fastdeploy.entrypoints.openai.tokenizer_lanes import TokenizerLanes

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Marks the end of the final message in the rendered text, for ``continue_final_message``."""


@dataclass
class ChatOptions:
    """What a chat answer reports besides its text, from the request."""

    include_usage: bool = False
    """Streaming: end with a usage chunk (and ``"usage": null`` in the other chunks)."""
    continuous_usage: bool = False
    """Streaming: the usage so far in every chunk (vLLM's ``continuous_usage_stats``)."""
    num_prompt_logprobs: int | None = None
    """The ``prompt_logprobs`` the client asked for (None: leave the field out)."""
    echo_text: str = ""
    """The text every choice starts with (``echo``)."""
    return_token_ids: bool = False
    """Report ``prompt_token_ids`` and each choice's ``token_ids``."""
    reasoning: ReasoningParser | None = None
    """Splits each answer's reasoning from its content (None: all content)."""

    @classmethod
    def of(cls, request: ChatCompletionRequest) -> ChatOptions:
        """The options ``request`` asks for."""
        return cls(
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            num_prompt_logprobs=request.prompt_logprobs,
            echo_text=request.echo_text,
            return_token_ids=bool(request.return_token_ids),
        )


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat completions endpoint (text, and image / video feature parts).

    ``reasoning_parser`` (the class ``--reasoning-parser`` names) splits reasoning out of answers.
    """

    def __init__(
        self,
        engine_client: EngineClient,
        served_model_names: list[str],
        tokenizers: TokenizerLanes | None = None,
        shutdown_event: asyncio.Event | None = None,
        reasoning_parser: type[ReasoningParser] | None = None,
    ):
        super().__init__(engine_client, served_model_names, tokenizers, shutdown_event)
        self.reasoning_parser = reasoning_parser

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
        text = await self._render(request, conversation)
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
        options = ChatOptions.of(request)
        if self.reasoning_parser is not None:
            options.reasoning = self.reasoning_parser(text, request.chat_template_kwargs)
        if request.stream:
            return SSEResponse(self._stream(request_id, model, prompts, options))
        response = await run_until_disconnected(
            raw_request, self._collect(request_id, model, prompts, options)
        )
        return JSONResponse(response.model_dump())

    async def _render(self, request: ChatCompletionRequest, conversation: list[dict[str, Any]] | None) -> str:
        """The prompt text: the chat template applied with ``add_generation_prompt``, or, with
        ``continue_final_message``, cut right after the final message's content.

        The cut works as ``transformers``' ``apply_chat_template(continue_final_message=True)``: a
        tag appended to the final message marks where its content ends in the rendered text.
        """
        if not request.continue_final_message:
            return await self.render_chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                conversation=conversation,
                template_kwargs=request.chat_template_kwargs,
            )
        conversation = [dict(m) for m in (conversation or request.template_messages())]
        final = conversation[-1]
        if not isinstance(final.get("content"), str):
            raise BadRequestError(
                "continue_final_message needs a final message with text content", param="messages"
            )
        final["content"] += _CONTINUE_TAG
        text = await self.render_chat(
            request.messages,
            add_generation_prompt=False,
            conversation=conversation,
            template_kwargs=request.chat_template_kwargs,
        )
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise BadRequestError(
                "continue_final_message is set but the chat template drops the final message's content",
                param="continue_final_message",
            )
        at = text.rindex(tag)
        if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing space

    def _stream_choice(
        self, c: CompletionOutput, num_top: int | None, options: ChatOptions, delta: DeltaMessage
    ) -> ChatCompletionStreamChoice:
        return ChatCompletionStreamChoice(
            index=c.index,
            delta=delta,
            logprobs=chat_logprobs(c.token_ids, c.logprobs, num_top)
            if c.logprobs and num_top is not None
            else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if options.return_token_ids else None,
        )

    async def _stream(
        self, request_id: str, model: str, prompts: list[EnginePrompt], options: ChatOptions
    ) -> AsyncIterator[str]:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        tracker = UsageTracker([request_id], prompts)
        exclude = None if options.include_usage else {"usage"}
        pending_prompt_lps = None  # sent with the next chunk after they arrive
        pending_prompt_ids = list(prompts[0].token_ids) if options.return_token_ids else None
        splits = [options.reasoning.stream() for _ in range(n)] if options.reasoning else None

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            nonlocal pending_prompt_lps, pending_prompt_ids
            body = ChatCompletionStreamResponse(
                id=request_id,
                model=model,
                choices=[choice],
                prompt_logprobs=pending_prompt_lps,
                prompt_token_ids=pending_prompt_ids,
                usage=tracker.usage() if options.continuous_usage else None,
            )
            pending_prompt_lps = pending_prompt_ids = None
            return f"data: {body.model_dump_json(exclude=exclude)}\n\n"

        try:
            for k in range(n):
                yield chunk(
                    ChatCompletionStreamChoice(index=k, delta=DeltaMessage(role="assistant", content=""))
                )
            if options.echo_text:
                for k in range(n):
                    yield chunk(
                        ChatCompletionStreamChoice(index=k, delta=DeltaMessage(content=options.echo_text))
                    )
            async with contextlib.aclosing(self.iterate_outputs([request_id], prompts, tracker)) as outputs:
                async for _, out in outputs:
                    if out.prompt_logprobs is not None and options.num_prompt_logprobs is not None:
                        pending_prompt_lps = prompt_logprobs_json(
                            prompts[0].token_ids, out.prompt_logprobs, options.num_prompt_logprobs
                        )
                    for c in out.outputs:
                        has_ids = options.return_token_ids and bool(c.token_ids)
                        delta = _delta(c, splits[c.index] if splits else None)
                        has_text = delta.content is not None or delta.reasoning_content is not None
                        if has_text or c.finish_reason is not None or c.logprobs or has_ids:
                            yield chunk(self._stream_choice(c, num_top, options, delta))
            if options.include_usage:
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id, model=model, choices=[], usage=tracker.usage()
                )
                yield sse(usage_chunk)
        except Exception as exc:
            yield error_event(exc)
        yield SSE_DONE

    async def _collect(
        self, request_id: str, model: str, prompts: list[EnginePrompt], options: ChatOptions
    ) -> ChatCompletionResponse:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        texts: list[list[str]] = [[options.echo_text] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop_reason: list[int | str | None] = [None] * n
        prompt_lps = None
        tracker = UsageTracker([request_id], prompts)
        try:
            async with contextlib.aclosing(self.iterate_outputs([request_id], prompts, tracker)) as outputs:
                async for _, out in outputs:
                    if out.prompt_logprobs is not None and options.num_prompt_logprobs is not None:
                        prompt_lps = prompt_logprobs_json(
                            prompts[0].token_ids, out.prompt_logprobs, options.num_prompt_logprobs
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
                message=_message("".join(texts[k][1:]), options),
                logprobs=None if num_top is None else chat_logprobs(token_ids[k], logprobs[k], num_top),
                finish_reason=finish[k] or "abort",
                stop_reason=stop_reason[k],
                token_ids=token_ids[k] if options.return_token_ids else None,
            )
            for k in range(n)
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=tracker.usage(),
            prompt_logprobs=prompt_lps,
            prompt_token_ids=list(prompts[0].token_ids) if options.return_token_ids else None,
        )


def _delta(c: CompletionOutput, split: ReasoningStream | None) -> DeltaMessage:
    """The delta message of a streamed piece of one answer, its reasoning split out by ``split``
    (the end of the answer releases whatever ``split`` held back)."""
    if split is None:
        return DeltaMessage(content=c.text) if c.text else DeltaMessage()
    reasoning, content = split.feed(c.text)
    if c.finish_reason is not None:
        last_reasoning, last_content = split.finish()
        reasoning, content = reasoning + last_reasoning, content + last_content
    return DeltaMessage(
        content=content or None, reasoning_content=reasoning or None, reasoning=reasoning or None
    )


def _message(text: str, options: ChatOptions) -> ChatMessageOut:
    """The assistant message of a whole answer: ``echo`` text first, reasoning split out."""
    if options.reasoning is None:
        return ChatMessageOut(content=options.echo_text + text)
    reasoning, content = options.reasoning.extract(text)
    if options.echo_text:
        content = options.echo_text + (content or "")
    return ChatMessageOut(content=content, reasoning_content=reasoning, reasoning=reasoning)
