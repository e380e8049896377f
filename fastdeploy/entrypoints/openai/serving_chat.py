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

With tools, the content (after the reasoning split) goes through the request's tool-call
parser (``tool_calling.py``): calls go to ``tool_calls`` (streamed as OpenAI's deltas: id,
type and name first, then the arguments in pieces) and the finish reason of an answer that
called tools and stopped is ``tool_calls``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.core.outputs import CompletionOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.chat_choices import (
    ChatOptions,
    ChoiceSplit,
    assistant_message,
    chat_finish_reason,
    names_a_function,
)
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.event_streams import (
    SSE_DONE,
    SSEResponse,
    error_event,
    run_until_disconnected,
    sse,
    to_openai_error,
)
from fastdeploy.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    matched_stop,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.protocol.chat import refuse_request_chat_template
from fastdeploy.entrypoints.openai.reasoning import ReasoningParser
from fastdeploy.entrypoints.openai.request_ids import api_request_id
from fastdeploy.entrypoints.openai.serving_engine import (
    EnginePrompt,
    OpenAIServing,
    ServerStop,
    StartedRequests,
)
from fastdeploy.entrypoints.openai.serving_mm import MultimodalChatInputs
from fastdeploy.entrypoints.openai.stream_chunks import chat_content_chunk
from fastdeploy.entrypoints.openai.timeline_log import TimelineRecorder
from fastdeploy.entrypoints.openai.tokenizer_lanes import TokenizerLanes
from fastdeploy.entrypoints.openai.tool_calling import ToolCalling, ToolPlan
from fastdeploy.structured_output.grammar import reasoning_prefix_ebnf

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Marks the end of the final message in the rendered text, for ``continue_final_message``."""


@dataclass
class PreparedChat:
    """A chat request validated, rendered and tokenized: ready to start on the engine."""

    model: str
    """The served model name the answer reports."""
    prompts: list[EnginePrompt]
    """The one engine prompt (its ``params.n`` choices)."""
    options: ChatOptions
    tokenized: float
    """``time.monotonic()`` when the prompt was tokenized (the request timeline)."""


class OpenAIServingChat(OpenAIServing):
    """Handler of the chat completions endpoint (text, and image / video feature parts).

    ``reasoning_parser`` (the class ``--reasoning-parser`` names) splits reasoning out of answers;
    ``tool_call_parser`` (``--tool-call-parser``; None: the chat template's default) reads tool calls.
    """

    def __init__(
        self,
        engine_client: EngineClient,
        served_model_names: list[str],
        tokenizers: TokenizerLanes | None = None,
        stop: ServerStop | None = None,
        reasoning_parser: type[ReasoningParser] | None = None,
        tool_call_parser: str | None = None,
        return_tokens_as_token_ids: bool = False,
        force_include_usage: bool = False,
        exclude_tools_when_tool_choice_none: bool = False,
        chat_template_content_format: str = "auto",
        trust_request_chat_template: bool = False,
    ):
        super().__init__(
            engine_client,
            served_model_names,
            tokenizers,
            stop,
            return_tokens_as_token_ids,
            force_include_usage,
            chat_template_content_format,
        )
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.trust_request_chat_template = trust_request_chat_template
        """Render a request's own ``chat_template`` (``--trust-request-chat-template``); else a 400."""
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        """``tool_choice: "none"`` renders the prompt without the tools (vLLM's flag of that name)."""
        self._tool_calling: ToolCalling | None = None

    @property
    def tool_calling(self) -> ToolCalling:
        """The tool-call set-up of this model (created on first use: it reads the chat template)."""
        if self._tool_calling is None:
            self._tool_calling = ToolCalling(
                self.tokenizer, self.tool_call_parser, self.exclude_tools_when_tool_choice_none
            )
        return self._tool_calling

    @property
    def mm_inputs(self) -> MultimodalChatInputs:
        """Feature-part handling (created on first use)."""
        if getattr(self, "_mm_inputs", None) is None:
            self._mm_inputs = MultimodalChatInputs(self.engine)
        return self._mm_inputs

    async def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """Validate, render and tokenize one chat request (a 400 naming the field if it is wrong):
        the engine prompt and what the answer reports besides its text. ``/v1/responses`` runs
        its requests through here too."""
        model = self.resolve_model(request.model)
        params = request.to_sampling_params(self.sampling_defaults)
        tools = self.tool_calling.plan(request)
        params = tools.sampling_params(params)
        params = self.check_params(params, "top_logprobs")
        self.check_healthy()

        conversation, items = await self.mm_inputs.split(request.messages, self._run_tokenizer)
        conversation = tools.conversation(conversation or request.template_messages())
        text = await self._render(request, conversation, tools)
        token_ids = await self.encode(text, add_special_tokens=False, param="messages")
        if not token_ids:
            raise BadRequestError("The chat template produced an empty prompt", param="messages")
        kept = self.keep_last(token_ids, request.truncate_prompt_tokens, request.truncation_side)
        if len(kept) < len(token_ids):
            if items:
                raise BadRequestError(
                    "truncate_prompt_tokens would cut a prompt with image or video parts",
                    param="truncate_prompt_tokens",
                )
            token_ids = kept
        token_ids, mm_items = await self.mm_inputs.place(token_ids, items)
        tokenized = time.monotonic()
        max_tokens = resolve_max_tokens(
            len(token_ids),
            params.max_tokens,
            self.engine.max_model_len,
            default=self.sampling_defaults.get("max_new_tokens"),
            prompt_kind="messages",
        )
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_parser(text, request.chat_template_kwargs)
            params = _constrain_after_reasoning(params, reasoning)
        prompt = EnginePrompt(
            token_ids=token_ids,
            params=params.clone(max_tokens=max_tokens),
            text=text,
            mm_items=mm_items or None,
        )
        options = ChatOptions.of(request, self.force_include_usage)
        options.reasoning = reasoning
        options.tokens_as_ids = self.tokens_as_ids(request)
        if tools.parser is not None:
            options.tools = tools
        return PreparedChat(model=model, prompts=[prompt], options=options, tokenized=tokenized)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Validate, render, tokenize, run and answer one chat request."""
        chat = await self.prepare(request)
        model, prompts, options = chat.model, chat.prompts, chat.options
        request_id, engine_id = api_request_id("chatcmpl", raw_request)
        started = await self.start_requests([engine_id], prompts)
        if request.stream:
            recorder = TimelineRecorder(getattr(raw_request.state, "received", None), chat.tokenized)
            return SSEResponse(
                self._stream(request_id, model, started, prompts, options, recorder), on_close=started.close
            )
        try:
            response = await run_until_disconnected(
                raw_request, self._collect(request_id, model, started, prompts, options)
            )
        finally:
            await started.close()
        return JSONResponse(response.model_dump())

    async def render_prompt_text(self, request: ChatCompletionRequest) -> str:
        """The prompt text of a chat request as a chat completion renders it (tools, chat template
        variables, ``continue_final_message``), without image or video parts: ``/tokenize`` counts
        the tokens a chat completion would see."""
        tools = self.tool_calling.plan(request)
        return await self._render(request, tools.conversation(request.template_messages()), tools)

    async def _render(
        self,
        request: ChatCompletionRequest,
        conversation: list[dict[str, Any]],
        tools: ToolPlan,
    ) -> str:
        """The prompt text: the chat template applied with ``add_generation_prompt``, or, with
        ``continue_final_message``, cut right after the final message's content. The template's
        extra variables are the request's ``chat_template_kwargs`` and the ``tools`` of a template
        that renders them (``tools``' plan).

        The cut works as ``transformers``' ``apply_chat_template(continue_final_message=True)``: a
        tag appended to the final message marks where its content ends in the rendered text.
        """
        if request.chat_template is not None and not self.trust_request_chat_template:
            refuse_request_chat_template(request.chat_template)
        template_kwargs = dict(request.chat_template_kwargs or {})
        if tools.template_tools:
            template_kwargs["tools"] = tools.template_tools
        if not request.continue_final_message:
            return await self.render_chat(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                conversation=conversation,
                template_kwargs=template_kwargs,
                chat_template=request.chat_template,
            )
        conversation = [dict(m) for m in conversation]
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
            template_kwargs=template_kwargs,
            chat_template=request.chat_template,
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

    def _reasoning_tokens(self, options: ChatOptions, answers: list[tuple[list[int], str]]) -> int | None:
        """The reasoning tokens of every choice's answer (its token ids and text); None without a
        reasoning parser."""
        if options.reasoning is None:
            return None
        return sum(
            options.reasoning.count_reasoning_tokens(ids, text, self.tokenizer) for ids, text in answers
        )

    def _stream_choice(
        self,
        c: CompletionOutput,
        num_top: int | None,
        options: ChatOptions,
        delta: DeltaMessage,
        finish_reason: str | None,
    ) -> ChatCompletionStreamChoice:
        return ChatCompletionStreamChoice(
            index=c.index,
            delta=delta,
            logprobs=chat_logprobs(c.token_ids, c.logprobs, num_top, options.tokens_as_ids)
            if c.logprobs and num_top is not None
            else None,
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if options.return_token_ids else None,
        )

    async def _stream(
        self,
        request_id: str,
        model: str,
        started: StartedRequests,
        prompts: list[EnginePrompt],
        options: ChatOptions,
        recorder: TimelineRecorder | None = None,
    ) -> AsyncIterator[str | bytes]:
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        tracker = started.tracker
        exclude = None if options.include_usage else {"usage"}
        pending_prompt_lps = None  # sent with the next chunk after they arrive
        pending_prompt_ids = list(prompts[0].token_ids) if options.return_token_ids else None
        splits = [ChoiceSplit(options) for _ in range(n)]
        created = int(time.time())  # one creation time for every chunk of the stream, as OpenAI's
        plain = (
            options.reasoning is None
            and options.tools is None
            and num_top is None
            and not options.continuous_usage
            and options.num_prompt_logprobs is None
        )
        """Content deltas carry text only (and token ids when asked): the fast encoder."""

        def chunk(choice: ChatCompletionStreamChoice, opening: bool = False) -> str:
            """``opening``: a role or echo chunk, sent before any output token (its continuous usage
            counts none, as vLLM's)."""
            nonlocal pending_prompt_lps, pending_prompt_ids
            usage = None
            if options.continuous_usage:
                usage = (
                    UsageInfo.build(tracker.prompt_tokens, 0, tracker.total_cached_tokens)
                    if opening
                    else tracker.usage()
                )
            body = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[choice],
                prompt_logprobs=pending_prompt_lps,
                prompt_token_ids=pending_prompt_ids,
                usage=usage,
            )
            pending_prompt_lps = pending_prompt_ids = None
            return f"data: {body.model_dump_json(exclude=exclude)}\n\n"

        try:
            opened = False
            async with contextlib.aclosing(started.outputs()) as outputs:
                async for _, out in outputs:
                    if out.prompt_logprobs is not None and options.num_prompt_logprobs is not None:
                        pending_prompt_lps = prompt_logprobs_json(
                            prompts[0].token_ids, out.prompt_logprobs, options.num_prompt_logprobs
                        )
                    if not opened:  # the role chunk comes with the first output, as vLLM's does: a
                        opened = True  # client timing its first chunk measures the first token
                        for k in range(n):
                            yield chunk(
                                ChatCompletionStreamChoice(
                                    index=k, delta=DeltaMessage(role="assistant", content="")
                                ),
                                opening=True,
                            )
                        if options.echo_text:
                            for k in range(n):
                                yield chunk(
                                    ChatCompletionStreamChoice(
                                        index=k, delta=DeltaMessage(content=options.echo_text)
                                    ),
                                    opening=True,
                                )
                    for c in out.outputs:
                        has_ids = options.return_token_ids and bool(c.token_ids)
                        if plain and pending_prompt_ids is None:
                            # every step with tokens is a chunk, even one whose text is still held
                            # back (a character's first bytes): clients time tokens by chunks
                            if c.token_ids or c.text or c.finish_reason is not None:
                                yield chat_content_chunk(
                                    request_id, created, model, c.index,
                                    c.text if c.text or c.token_ids else None, c.finish_reason,
                                    c.stop_reason, list(c.token_ids) if options.return_token_ids else None,
                                    options.include_usage,
                                )  # fmt: skip
                                if recorder is not None and c.token_ids:
                                    recorder.written(out)
                            continue
                        split = splits[c.index]
                        delta = split.delta(c)
                        has_text = delta.content is not None or delta.reasoning_content is not None
                        if (
                            has_text
                            or delta.tool_calls
                            or delta.function_call is not None
                            or c.finish_reason is not None
                            or c.logprobs
                            or has_ids
                        ):
                            finish_reason = split.finish_reason(c.finish_reason)
                            yield chunk(self._stream_choice(c, num_top, options, delta, finish_reason))
                            if recorder is not None and c.token_ids:
                                recorder.written(out)
            if options.include_usage:
                usage_chunk = ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=tracker.usage(
                        self._reasoning_tokens(options, [(s.token_ids, "".join(s.texts)) for s in splits])
                    ),
                )
                yield sse(usage_chunk)
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
        options: ChatOptions,
    ) -> ChatCompletionResponse:
        """The whole answer of started chat requests (every choice)."""
        n = prompts[0].params.n
        num_top = prompts[0].params.logprobs
        texts: list[list[str]] = [[options.echo_text] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        stop_reason: list[int | str | None] = [None] * n
        prompt_lps = None
        tracker = started.tracker
        try:
            async with contextlib.aclosing(started.outputs()) as outputs:
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
        messages = [assistant_message("".join(texts[k][1:]), options) for k in range(n)]
        choices = [
            ChatCompletionResponseChoice(
                index=k,
                message=messages[k],
                logprobs=None
                if num_top is None
                else chat_logprobs(token_ids[k], logprobs[k], num_top, options.tokens_as_ids),
                finish_reason=chat_finish_reason(
                    finish[k] or "abort",
                    bool(messages[k].tool_calls or messages[k].function_call),
                    names_a_function(options),
                    options.legacy_functions,
                ),
                stop_reason=stop_reason[k],
                matched_stop=matched_stop(finish[k], stop_reason[k], token_ids[k]),
                token_ids=token_ids[k] if options.return_token_ids else None,
            )
            for k in range(n)
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=tracker.usage(
                self._reasoning_tokens(options, [(token_ids[k], "".join(texts[k][1:])) for k in range(n)])
            ),
            prompt_logprobs=prompt_lps,
            prompt_token_ids=list(prompts[0].token_ids) if options.return_token_ids else None,
        )


def _constrain_after_reasoning(params: SamplingParams, reasoning: ReasoningParser) -> SamplingParams:
    """``params`` whose structured-output constraint (if any) applies to the answer after the model's
    reasoning (which the grammar leaves free), when this request can have reasoning."""
    constraint = params.structured_outputs
    if constraint is None or not reasoning.enabled():
        return params
    prefix = reasoning_prefix_ebnf(reasoning.start_tag, reasoning.end_tag, reasoning.starts_in_reasoning())
    return params.clone(structured_outputs=dataclasses.replace(constraint, reasoning_prefix=prefix))
