"""What the completions, chat and tokenize handlers share.

Model-name checks, tokenization off the event loop, engine calls with usage
accounting, and the plumbing that guarantees an abandoned request is aborted in
the engine (:class:`StartedRequests`); the SSE responses and the disconnect watch
they rely on are in :mod:`.event_streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

from fastdeploy.core.outputs import RequestOutput
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    resolve_logprobs,
)
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.content_format import apply_content_format, resolve_content_format
from fastdeploy.entrypoints.openai.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    ServiceUnavailableError,
)
from fastdeploy.entrypoints.openai.protocol import ChatMessage, UsageInfo
from fastdeploy.entrypoints.openai.tokenizer_lanes import TokenizerLanes
from fastdeploy.entrypoints.openai.tool_template import template_text

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set."""


async def abort_quietly(engine: EngineClient, request_ids: Sequence[str]) -> None:
    """Abort engine requests, shielded from cancellation, ignoring failures (dead engine)."""
    if not request_ids:
        return
    with anyio.CancelScope(shield=True):
        for request_id in request_ids:
            try:
                await engine.abort(request_id)
            except Exception:  # a dead engine has nothing left to abort
                logger.debug("abort of %s failed", request_id, exc_info=True)


class ServerShuttingDownError(ServiceUnavailableError):
    """503: the server is stopping; requests in flight are ended with this error."""


async def merge_async_iterators(
    iterators: Sequence[AsyncIterator[T]], interrupt: asyncio.Event | None = None
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive, yielding ``(iterator index, item)``.

    An exception from any iterator propagates after the others are cancelled.
    When ``interrupt`` is set, iteration stops with :class:`ServerShuttingDownError`.
    """
    if len(iterators) == 1 and interrupt is None:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose_all(iterators)
        return

    async def next_of(it: AsyncIterator[T]) -> T:
        return await it.__anext__()

    pending: dict[asyncio.Future[Any], int] = {
        asyncio.ensure_future(next_of(it)): i for i, it in enumerate(iterators)
    }
    num_sources = len(pending)
    if interrupt is not None:
        pending[asyncio.ensure_future(interrupt.wait())] = -1
    try:
        while num_sources:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                if i == -1:
                    raise ServerShuttingDownError("The server is shutting down.", code="shutting_down")
                try:
                    item = task.result()
                except StopAsyncIteration:
                    num_sources -= 1
                    continue
                pending[asyncio.ensure_future(next_of(iterators[i]))] = i
                yield i, item
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        await _aclose_all(iterators)


async def _aclose_all(iterators: Sequence[AsyncIterator[Any]]) -> None:
    """Close async generators (running their cleanup), shielded from cancellation."""
    with anyio.CancelScope(shield=True):
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


@dataclass
class EnginePrompt:
    """One engine request behind an API request: the prompt and its sampling parameters."""

    token_ids: list[int]
    params: SamplingParams
    text: str | None = None
    mm_items: list[Any] | None = None
    """Placed multimodal items (``MMItem``) of the prompt, features included."""
    pooling: PoolingParams | None = None
    """Set for an embedding request (pooling runner): the prompt is pooled, not sampled."""


class UsageTracker:
    """Token counts and finish state of the engine requests behind one API request."""

    def __init__(self, request_ids: list[str], prompts: list[EnginePrompt]):
        self.request_ids = request_ids
        self.prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.completion_tokens = 0
        self.cached_tokens = [0] * len(prompts)
        self.finished = [False] * len(prompts)

    def update(self, i: int, out: RequestOutput) -> None:
        """Account one delta output of engine request ``i``."""
        self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens or 0)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if out.finished:
            self.finished[i] = True

    def unfinished_request_ids(self) -> list[str]:
        return [rid for rid, done in zip(self.request_ids, self.finished) if not done]

    @property
    def total_cached_tokens(self) -> int:
        return sum(self.cached_tokens)

    def usage(self, reasoning_tokens: int | None = None) -> UsageInfo:
        return UsageInfo.build(
            self.prompt_tokens, self.completion_tokens, self.total_cached_tokens, reasoning_tokens
        )


class StartedRequests:
    """The engine requests behind one API request, sent to the engine as soon as the request is
    validated and tokenized (:meth:`OpenAIServing.start_requests`, in the handler, before any
    response starts), so that a burst's prefills do not wait for each stream to begin.

    :meth:`outputs` yields ``(prompt index, delta output)`` as they arrive; :meth:`close`
    aborts the unfinished ones (idempotent; also when :meth:`outputs` ends, however it ends).
    Whoever starts them closes them: a streaming response through ``SSEResponse(on_close=...)``
    even if its body never runs, the other handlers in a ``finally``.
    """

    def __init__(
        self,
        engine: EngineClient,
        request_ids: list[str],
        prompts: list[EnginePrompt],
        shutdown_event: asyncio.Event | None,
    ):
        self.engine = engine
        self.tracker = UsageTracker(request_ids, prompts)
        self._shutdown_event = shutdown_event
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._closed = False

    def send(self, prompts: list[EnginePrompt]) -> None:
        """Hand every prompt to the engine (``EngineClient.generate``; ``AsyncLLM`` sends it now)."""
        for rid, p in zip(self.tracker.request_ids, prompts):
            self._streams.append(
                self.engine.generate(
                    p.token_ids,
                    p.params,
                    rid,
                    prompt=p.text,
                    **({"mm_items": p.mm_items} if p.mm_items else {}),
                    **({"pooling_params": p.pooling} if p.pooling else {}),
                )
            )

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(prompt index, delta output)`` as they arrive, until every request has finished."""
        try:
            merged = merge_async_iterators(self._streams, self._shutdown_event)
            async with contextlib.aclosing(merged):
                async for i, out in merged:
                    self.tracker.update(i, out)
                    yield i, out
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the unfinished requests and release their streams (shielded from cancellation)."""
        if self._closed:
            return
        self._closed = True
        await abort_quietly(self.engine, self.tracker.unfinished_request_ids())
        await _aclose_all(self._streams)


@dataclass
class ServerStop:
    """How a stopping server treats requests. ``refusing`` set: new requests get a 503
    (``shutting_down``) while those in flight go on (``serve --shutdown-timeout``'s drain);
    ``ending`` set: the requests in flight end with a 503 too."""

    refusing: asyncio.Event = field(default_factory=asyncio.Event)
    ending: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def stopping(self) -> bool:
        """Whether new requests are refused (either stage)."""
        return self.refusing.is_set() or self.ending.is_set()


class OpenAIServing:
    """Base of the endpoint handlers: the engine client, served names and the tokenizer threads.

    Tokenization runs off the event loop on :class:`TokenizerLanes` (long
    texts apart from short ones), and a text that cannot fit the model's
    context is refused before it is tokenized (:meth:`check_text_length`).
    """

    def __init__(
        self,
        engine_client: EngineClient,
        served_model_names: list[str],
        tokenizers: TokenizerLanes | None = None,
        stop: ServerStop | None = None,
        return_tokens_as_token_ids: bool = False,
        force_include_usage: bool = False,
        chat_template_content_format: str = "auto",
    ):
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine_client
        self.served_model_names = list(served_model_names)
        self.tokenizers = tokenizers or TokenizerLanes()
        self.stop = stop or ServerStop()
        """The server's stop stages: new requests refused, then requests in flight ended."""
        self.sampling_defaults: dict[str, Any] = dict(
            getattr(engine_client, "generation_defaults", None) or {}
        )
        """The model's sampling defaults for unset request fields (``--generation-config``)."""
        self.force_include_usage = force_include_usage
        """Streams end with a usage chunk whether or not the client asked (``--enable-force-include-usage``)."""
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        """Every request's logprobs tokens as ``token_id:N`` (``--return-tokens-as-token-ids``)."""
        self._vocab_size: int | None = None
        self._max_token_chars: int | None = None
        self.content_format_setting = chat_template_content_format
        """``--chat-template-content-format``: auto, string or openai."""
        self._content_format: str | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """Largest valid token id + 1 (the engine's ``vocab_size`` if it has one, else the tokenizer's)."""
        if self._vocab_size is None:
            size = getattr(self.engine, "vocab_size", None)
            self._vocab_size = int(size) if size else len(self.tokenizer)
        return self._vocab_size

    @property
    def content_format(self) -> str:
        """How message text reaches the chat template: ``string`` or ``openai`` (``auto`` resolved
        against the tokenizer's template, :mod:`.content_format`)."""
        if self._content_format is None:
            self._content_format = resolve_content_format(
                self.content_format_setting, template_text(self.tokenizer)
            )
        return self._content_format

    def resolve_model(self, name: str | None) -> str:
        """The served name a request addresses; 404 if unknown. None means the first served name."""
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return name

    def check_healthy(self) -> None:
        """503 if the engine has died or the server is stopping."""
        if self.stop.stopping:
            raise ServerShuttingDownError("The server is shutting down.", code="shutting_down")
        if not self.engine.is_healthy:
            raise ServiceUnavailableError(
                "The engine is not healthy; it cannot serve requests.", code="engine_dead"
            )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """400 if a token id is outside the vocabulary (it would crash the model)."""
        vocab = self.vocab_size
        for t in token_ids:
            if t >= vocab:
                raise BadRequestError(
                    f"token id {t} is out of vocabulary (vocabulary size {vocab})", param=param
                )

    def check_params(self, params: SamplingParams, logprobs_field: str = "logprobs") -> SamplingParams:
        """400 if a token id in ``stop_token_ids`` or ``logit_bias`` is outside the vocabulary, or the
        logprobs asked are more than ``--max-logprobs`` (named as the request names them:
        ``logprobs_field``); the params with a logprobs count of -1 made the vocabulary size."""
        if params.stop_token_ids:
            self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        max_logprobs = getattr(self.engine, "max_logprobs", MAX_LOGPROBS)
        try:
            return resolve_logprobs(params, max_logprobs, self.vocab_size, {"logprobs": logprobs_field})
        except SamplingParamsError as exc:
            raise BadRequestError(str(exc), param=exc.param) from None

    async def _run_tokenizer(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the tokenizer thread of short texts."""
        return await self.tokenizers.call(lambda: fn(*args, **kwargs))

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary entry)."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            self._max_token_chars = max((len(token) for token in vocab), default=1) or 1
        return self._max_token_chars

    def check_text_length(self, num_chars: int, param: str) -> None:
        """400 for a text that must be more tokens than the model's context, before tokenizing it.

        No token stands for more than :attr:`max_token_chars` characters, so a
        text longer than ``max_model_len`` times that is certainly too long;
        this bounds the tokenizer's work per request by the context length.
        """
        limit = self.engine.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise BadRequestError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, "
                f"{param} has {num_chars} characters, more than fit in that many tokens, so the input is "
                f"longer than the model's context length allows. Please reduce the length of the {param}.",
                param=param,
                code="context_length_exceeded",
            )

    def tokens_as_ids(self, request: Any) -> bool:
        """Whether ``request``'s logprobs name their tokens ``token_id:N``: it asks
        (``return_tokens_as_token_ids``) or the server does for every request."""
        return bool(request.return_tokens_as_token_ids) or self.return_tokens_as_token_ids

    def keep_last(
        self, token_ids: list[int], truncate_prompt_tokens: int | None, truncation_side: str | None = None
    ) -> list[int]:
        """``token_ids`` cut to ``truncate_prompt_tokens`` (-1: ``max_model_len``; None: all): the last
        ones (vLLM's default, ``truncation_side`` left) or the first (``right``); a 400 if it asks for
        more than the context."""
        if truncate_prompt_tokens is None:
            return token_ids
        max_len = self.engine.max_model_len
        keep = max_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep > max_len:
            raise BadRequestError(
                f"truncate_prompt_tokens is {keep}, more than this model's maximum context length of {max_len}",
                param="truncate_prompt_tokens",
            )
        return token_ids[:keep] if truncation_side == "right" else token_ids[-keep:]

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of ``text`` (a 400 naming ``param`` if it cannot fit the context)."""
        self.check_text_length(len(text), param)
        return await self.tokenizers.encode(self.tokenizer, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.tokenizers.run(self.tokenizer, lambda tok: tok.decode(token_ids), len(token_ids))

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        conversation: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The chat template applied to ``messages``, as text; 400 if the template rejects them.

        The text already holds the template's special tokens (BOS and role
        markers), so it must be encoded with ``add_special_tokens=False``.
        ``conversation`` replaces the messages' own template dicts (the chat
        handler's, with image / video parts rendered as placeholder text).
        ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g.
        ``enable_thinking``) become variables of the template; names that are
        ``apply_chat_template``'s own arguments are a 400. ``chat_template``: a template to use
        instead of the tokenizer's (a request's own, where the server trusts them).
        """
        template_kwargs = template_kwargs or {}
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs))
        if reserved:
            raise BadRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
            )
        if conversation is None:
            conversation = [m.to_template_dict() for m in messages]
        if any(isinstance(m.get("content"), list) for m in conversation):
            raise BadRequestError(
                "image and video content parts are only accepted by /v1/chat/completions", param="messages"
            )
        content_format = (
            self.content_format
            if chat_template is None
            else resolve_content_format(self.content_format_setting, chat_template)
        )
        conversation = apply_content_format(conversation, content_format)
        if chat_template is not None:
            template_kwargs = {**template_kwargs, "chat_template": chat_template}
        self.check_text_length(_text_chars(conversation), "messages")

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
            )

        try:
            text = await self._run_tokenizer(render)
        except Exception as exc:  # jinja2 TemplateError, ValueError (no template), ...
            raise BadRequestError(
                f"The chat template could not be applied: {exc}", param="messages"
            ) from None
        if not isinstance(text, str):
            raise InternalServerError("The chat template did not return text")
        return text

    async def start_requests(self, request_ids: list[str], prompts: list[EnginePrompt]) -> StartedRequests:
        """Send the engine requests of one API request now; the caller closes what this returns
        (:class:`StartedRequests`). If a send fails, those already sent are aborted."""
        started = StartedRequests(self.engine, request_ids, prompts, self.stop.ending)
        try:
            started.send(prompts)
        except BaseException:
            await started.close()
            raise
        return started


def _text_chars(value: Any) -> int:
    """Characters in every string inside ``value`` (chat messages as template dicts). Iterative:
    a message's own fields may nest as deep as the JSON decoder allows."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def sub_request_ids(request_id: str, count: int) -> list[str]:
    """Engine request ids for the prompts of one API request (the id itself for one prompt)."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]
