"""``POST /v1/chat/completions``: the chat request and its (streamed) responses (the messages:
:mod:`.chat_messages`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from fastdeploy.core.sampling_params import ALL_LOGPROBS
from fastdeploy.entrypoints.openai.errors import BadRequestError
from fastdeploy.entrypoints.openai.protocol.chat_messages import (
    ChatMessage,
    check_messages,
    refuse_message_extensions,
)
from fastdeploy.entrypoints.openai.protocol.common import (
    ResponseModel,
    UsageInfo,
    WithExtensions,
    WithPromptLogprobs,
    _now,
)
from fastdeploy.entrypoints.openai.protocol.sampling import SamplingRequest
from fastdeploy.entrypoints.openai.protocol.tools import (
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
    ToolChoice,
    resolve_tool_choice,
)

# --------------------------------------------------------------------------- request


_NOT_STORED = "requests are not stored by this server"

UNTRUSTED_CHAT_TEMPLATE = (
    "Chat template is passed with request, but this server does not run chat templates sent with "
    "requests (start it with --chat-template to change its template). Refused request with "
    "untrusted chat template."
)
"""vLLM's refusal of a request's ``chat_template`` (vLLM runs one only with
``--trust-request-chat-template``): a template is code run by the server."""


def refuse_request_chat_template(chat_template: str | None) -> None:
    """A 400 for a request that sends its own ``chat_template``, as vLLM's default answers it
    (ignoring it would render the prompt with another template than the client asked for)."""
    if chat_template is not None:
        raise BadRequestError(UNTRUSTED_CHAT_TEMPLATE, param="chat_template")


_PREFIX_CACHE = "the prefix cache is automatic and shared; its keys and lifetime cannot be set"


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``.

        Every field of OpenAI's chat request is declared (the ignored ones in
        :attr:`IGNORED_FIELDS`), plus vLLM's extensions ``add_generation_prompt``,
        ``continue_final_message`` (exclusive with it), ``chat_template_kwargs``, ``echo`` and
        ``return_token_ids``; vLLM's ``chat_template`` (the server refuses it unless started with
    ``--trust-request-chat-template``, as vLLM's does).
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Any = None
    """``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per answer (default: any number)."""
    functions: Any = None
    """OpenAI's deprecated form of ``tools``: a list of function definitions (read as ``tools``; the
    answer then reports its call as ``message.function_call``, the deprecated shape)."""
    function_call: Any = None
    """OpenAI's deprecated form of ``tool_choice``: ``"none"``, ``"auto"`` or ``{"name": ...}``."""
    _legacy_functions: bool = PrivateAttr(default=False)
    # accepted and ignored (IGNORED_FIELDS says why)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    # extensions (vLLM's names)
    add_generation_prompt: bool = True
    """End the rendered prompt with the template's assistant header (a chat template variable)."""
    continue_final_message: bool = False
    """Leave the final message open so that the answer continues it (HF ``apply_chat_template``'s
    option; exclusive with ``add_generation_prompt``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables of the chat template (e.g. ``{"enable_thinking": false}`` for Qwen3); the
    reasoning parser reads them too."""
    include_reasoning: bool = True
    """vLLM's: with a reasoning parser, return the reasoning it splits out (false: the answer's
    reasoning is dropped, its content kept; ``reasoning_tokens`` are still counted)."""
    chat_template: str | None = None
    """vLLM's per-request Jinja template: declared only to be refused (400), as vLLM refuses it
    without ``--trust-request-chat-template``."""
    echo: bool = False
    """Start the answer with the last message's content when that message is the one the answer
    continues (an assistant message, or any with ``add_generation_prompt: false``), as vLLM does."""

    IGNORED_FIELDS: ClassVar[dict[str, tuple[str, tuple[Any, ...]]]] = {
        **SamplingRequest.IGNORED_FIELDS,
        "metadata": (_NOT_STORED, (None,)),
        "store": (_NOT_STORED, (None, False)),
        "service_tier": ("this server has a single service tier", (None, "auto", "default")),
        "reasoning_effort": ("the reasoning effort of the served model cannot be set", (None,)),
        "verbosity": ("the verbosity of the served model cannot be set", (None,)),
        "modalities": ("text is the only output modality", (None, ["text"])),
        "audio": ("audio output is not supported", (None,)),
        "prediction": ("predicted outputs are not used", (None,)),
        "web_search_options": ("this server has no web search", (None,)),
        "moderation": ("this server does no moderation", (None,)),
        "prompt_cache_key": (_PREFIX_CACHE, (None,)),
        "prompt_cache_retention": (_PREFIX_CACHE, (None,)),
        "prompt_cache_options": (_PREFIX_CACHE, (None,)),
        "safety_identifier": ("end-user ids are not used by this server", (None,)),
    }

    @field_validator("messages")
    @classmethod
    def _validate_messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        return check_messages(v)

    def refuse_extensions(self) -> None:
        refuse_message_extensions(self.messages)

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and self.top_logprobs < ALL_LOGPROBS:
            raise BadRequestError(
                f"top_logprobs must be at least 0 (or -1: the whole vocabulary), got {self.top_logprobs}",
                param="top_logprobs",
            )
        if not self.logprobs:
            if self.top_logprobs:
                raise BadRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    @model_validator(mode="after")
    def _continue_without_generation_prompt(self) -> ChatCompletionRequest:
        # continue_final_message alone: no generation prompt (SGLang's reading; both set true
        # explicitly stays vLLM's 400 below)
        if self.continue_final_message and "add_generation_prompt" not in self.model_fields_set:
            self.add_generation_prompt = False
        return self

    def check_supported(self) -> None:
        self._functions_as_tools()
        super().check_supported()
        self.tool_choice_mode()
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequestError(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true "
                "(set add_generation_prompt to false to continue the final message)",
                param="continue_final_message",
            )

    @property
    def legacy_functions(self) -> bool:
        """Whether the request gave ``functions`` (deprecated): its call is reported as
        ``function_call``, one call at most, finishing with ``function_call``."""
        return self._legacy_functions

    def _functions_as_tools(self) -> None:
        """``functions`` / ``function_call`` (OpenAI's deprecated fields) as ``tools`` /
        ``tool_choice``, one call at most; a 400 naming the field if they are wrong or come with the
        new ones."""
        if self.functions not in (None, []):
            if self.tools:
                raise BadRequestError("give 'tools' or 'functions' (deprecated), not both", param="functions")
            if not isinstance(self.functions, list):
                raise BadRequestError("functions must be a list of function definitions", param="functions")
            tools = []
            for i, function in enumerate(self.functions):
                try:
                    tools.append(ChatCompletionTool(type="function", function=function))
                except ValidationError as exc:
                    error = exc.errors()[0]
                    where = ".".join(str(part) for part in error["loc"][1:])
                    raise BadRequestError(
                        f"functions[{i}]{'.' + where if where else ''}: {error['msg']}",
                        param=f"functions[{i}]",
                    ) from None
            self.tools, self.functions, self._legacy_functions = tools, None, True
            if self.parallel_tool_calls is None:
                self.parallel_tool_calls = False  # (the deprecated shape holds one call)
        if self.function_call not in (None, "none"):
            if self.tool_choice is not None:
                raise BadRequestError(
                    "give 'tool_choice' or 'function_call' (deprecated), not both", param="function_call"
                )
            call = self.function_call
            if call == "auto":
                self.tool_choice = "auto"
            elif isinstance(call, dict) and isinstance(call.get("name"), str) and set(call) == {"name"}:
                self.tool_choice = {"type": "function", "function": {"name": call["name"]}}
            else:
                raise BadRequestError(
                    'function_call must be "none", "auto" or {"name": FUNCTION}', param="function_call"
                )
            self.function_call = None
        elif self.function_call == "none":
            self.tool_choice, self.function_call = self.tool_choice or "none", None

    def response_format_applies(self) -> bool:
        """``response_format`` shapes the assistant's text answer; under a forced tool call (``tool_choice``
        ``required`` or a named function) the answer is the call, generated under the call's grammar, so
        ``response_format`` has nothing to constrain in this turn. OpenAI accepts both together (the OpenAI
        Agents SDK sends them with an ``output_type`` agent whose tool use is required), and vLLM lets the
        tool's schema replace ``response_format``'s."""
        return not self.tool_choice_mode().forced

    def tool_choice_mode(self) -> ToolChoice:
        """What ``tools`` and ``tool_choice`` ask for (a 400 naming the field if they are wrong)."""
        return resolve_tool_choice(self.tools, self.tool_choice)

    @property
    def echo_text(self) -> str:
        """The text an ``echo`` answer starts with: the last message's content when the answer
        continues that message (vLLM's rule), else nothing."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return ""
        if isinstance(last.content, list):  # feature parts: their text parts
            return "\n".join(p["text"] for p in last.content if p.get("type") == "text")
        return last.content or ""

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as a list of dicts for ``tokenizer.apply_chat_template``."""
        return [m.to_template_dict() for m in self.messages]


# --------------------------------------------------------------------------- responses


class ChatCompletionLogProb(ResponseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(ResponseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessageOut(WithExtensions):
    """The assistant's answer; with ``--reasoning-parser``, its reasoning in ``reasoning_content`` and
    ``reasoning`` (the newer name, the same text), left out when there is none; the calls it makes in
    ``tool_calls`` (left out when none)."""

    OMIT_IF_NULL = ("tool_calls", "function_call", "reasoning_content", "reasoning")

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None
    """The call, in the deprecated shape, of a request that gave ``functions`` (then no ``tool_calls``)."""
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionResponseChoice(WithExtensions):
    """One answer; ``token_ids`` (vLLM's ``return_token_ids``) only when asked."""

    OMIT_IF_NULL = ("token_ids",)

    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None
    """SGLang's: what ended the answer (:func:`~.common.matched_stop`)."""
    token_ids: list[int] | None = None


class ChatCompletionResponse(WithPromptLogprobs):
    """A chat answer; vLLM's extensions at this level as in vLLM: ``prompt_logprobs`` (null when not
    asked, as vLLM's clients read it) and, only when asked, ``prompt_token_ids``."""

    OMIT_IF_NULL = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    """A streamed piece of the assistant message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    """A piece of the reasoning (with ``--reasoning-parser``)."""
    reasoning: str | None = None
    """The same piece under its newer name."""
    tool_calls: list[DeltaToolCall] | None = None
    """Pieces of the calls the answer makes."""
    function_call: DeltaFunctionCall | None = None
    """A piece of the call in the deprecated shape (a request that gave ``functions``)."""

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        fields = ("role", "content", "reasoning_content", "reasoning")
        out = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        if self.tool_calls:
            out["tool_calls"] = [call.to_json() for call in self.tool_calls]
        if self.function_call is not None:
            out["function_call"] = self.function_call.model_dump(exclude_none=True)
        return out


class ChatCompletionStreamChoice(WithExtensions):
    """A streamed piece of one answer; ``token_ids`` (the delta's, with ``return_token_ids``) only when asked."""

    OMIT_IF_NULL = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(WithPromptLogprobs):
    """One SSE chunk of a streamed chat completion: one choice, or none in the final usage chunk.

    ``prompt_token_ids``, when asked, come in the first chunk; ``prompt_logprobs`` once,
    in the first chunk after the role chunks.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
