"""Pydantic models of the OpenAI HTTP protocol, and their translation to engine terms.

Requests are validated strictly (``"max_tokens": "10"`` is a 400, not silently
coerced). Every field of OpenAI's request schemas is declared: the engine uses
it, or ignores it with a logged warning where it cannot apply, or (for what is
not implemented yet and cannot be ignored, such as ``functions``) accepts only its
"off" value and answers a 400 that says so otherwise. A field outside the
protocol and its supported extensions is dropped with a warning, as vLLM does,
or refused with ``--strict-request-fields``.

The models live in modules by concern, all re-exported here:

- :mod:`.common`: model bases, request parsing, ids, error bodies, usage, prompt logprobs;
- :mod:`.sampling`: the fields shared by completions and chat, ``SamplingParams``, ``max_tokens``;
- :mod:`.completion`: ``/v1/completions``;
- :mod:`.chat`: ``/v1/chat/completions``; :mod:`.chat_messages`: its messages and their content parts;
- :mod:`.tools`: tools, ``tool_choice``, tool calls in messages and answers, the forced-call schema;
- :mod:`.responses`: ``/v1/responses`` (OpenAI's Responses API), served as a chat request;
  :mod:`.responses_objects`: its response object and output items;
- :mod:`.embeddings`: ``/v1/embeddings``;
- :mod:`.tokenization`: ``/tokenize`` and ``/detokenize``;
- :mod:`.models`: ``/v1/models``.
"""

from fastdeploy.entrypoints.openai.protocol.chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
)
from fastdeploy.entrypoints.openai.protocol.chat_messages import ChatMessage, TextContentPart
from fastdeploy.entrypoints.openai.protocol.common import (
    ErrorInfo,
    ErrorResponse,
    OpenAIModel,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ResponseModel,
    UsageInfo,
    WithExtensions,
    WithPromptLogprobs,
    matched_stop,
    parse_request,
    random_id,
    warn_once,
)
from fastdeploy.entrypoints.openai.protocol.completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from fastdeploy.entrypoints.openai.protocol.embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from fastdeploy.entrypoints.openai.protocol.models import ModelCard, ModelList
from fastdeploy.entrypoints.openai.protocol.responses import ResponsesRequest
from fastdeploy.entrypoints.openai.protocol.responses_objects import ResponseObject
from fastdeploy.entrypoints.openai.protocol.sampling import (
    MAX_N,
    SamplingRequest,
    StreamOptions,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.protocol.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    parse_tokenize_request,
)
from fastdeploy.entrypoints.openai.protocol.tools import (
    ChatCompletionTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallOut,
    FunctionDefinition,
    ToolCallIn,
    ToolCallOut,
    ToolChoice,
    forced_call_schema,
    resolve_tool_choice,
    strict_calls_tag,
)

__all__ = [
    "resolve_tool_choice",
    "forced_call_schema",
    "strict_calls_tag",
    "ToolChoice",
    "ToolCallOut",
    "ToolCallIn",
    "FunctionDefinition",
    "FunctionCallOut",
    "DeltaToolCall",
    "DeltaFunctionCall",
    "ChatCompletionTool",
    "MAX_N",
    "ChatCompletionLogProb",
    "ChatCompletionLogProbs",
    "ChatCompletionLogProbsContent",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatMessage",
    "ChatMessageOut",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionResponseChoice",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "OpenAIModel",
    "PromptLogprob",
    "PromptLogprobs",
    "PromptTokensDetails",
    "ResponseModel",
    "ResponseObject",
    "ResponsesRequest",
    "SamplingRequest",
    "StreamOptions",
    "TextContentPart",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeResponse",
    "UsageInfo",
    "WithExtensions",
    "WithPromptLogprobs",
    "matched_stop",
    "parse_request",
    "parse_tokenize_request",
    "random_id",
    "resolve_max_tokens",
    "warn_once",
]
