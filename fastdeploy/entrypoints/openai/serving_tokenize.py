"""``POST /tokenize``, ``POST /detokenize`` and ``GET /v1/models``: answers that need no generation."""

from __future__ import annotations

from typing import Any

from fastdeploy.entrypoints.openai.errors import NotFoundError
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    parse_request,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize with the server's tokenizer (chat messages as ``chat`` renders a chat completion's
    prompt), detokenize, list models."""

    def __init__(self, *args: Any, chat: OpenAIServingChat, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chat = chat

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered by the chat template."""
        self.resolve_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            chat_request = parse_request(ChatCompletionRequest, request.chat_request())
            chat_request.check_supported()
            text = await self.chat.render_prompt_text(chat_request)
        else:
            text = request.prompt
        param = "messages" if isinstance(request, TokenizeChatRequest) else "prompt"
        tokens = await self.encode(text, add_special_tokens=request.add_special_tokens, param=param)
        token_strs = None
        if request.return_token_strs:
            token_strs = await self._run_tokenizer(self.tokenizer.convert_ids_to_tokens, tokens)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of a list of token ids (special tokens included)."""
        self.resolve_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=await self.decode(request.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """``GET /tokenizer_info`` (``--enable-tokenizer-info-endpoint``, vLLM's): the tokenizer's class
        and its configuration (special tokens, ``model_max_length``, the chat template, the added
        tokens by id), without the fields that name files on this machine."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise NotFoundError("This server has no tokenizer (--skip-tokenizer-init).")
        info: dict[str, Any] = {}
        for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items():
            if key not in _LOCAL_FIELDS and (jsonable := _jsonable(value)) is not _SKIP:
                info[key] = jsonable
        if isinstance(getattr(tokenizer, "chat_template", None), str):
            info["chat_template"] = tokenizer.chat_template
        info["tokenizer_class"] = type(tokenizer).__name__
        return info

    def list_models(self) -> ModelList:
        """The served model names, with the model path and context length."""
        return ModelList(data=[self._model_card(name) for name in self.served_model_names])

    def retrieve_model(self, name: str) -> ModelCard:
        """``GET /v1/models/{model}``: one served model's card; 404 naming the model if it is not served."""
        if name not in self.served_model_names:
            raise NotFoundError(f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return self._model_card(name)

    def _model_card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.model_path, max_model_len=self.engine.max_model_len)

    @property
    def model_path(self) -> str | None:
        """Where the served model's files are: the model folder or .gguf file the engine loaded
        (the embedded default model's file when no model was given)."""
        source = getattr(self.engine, "source", None)
        path = getattr(source, "path", None)
        if path:
            return str(path)
        config = getattr(getattr(self.engine, "config", None), "model", None)
        return getattr(config, "model", None) or None


_LOCAL_FIELDS = frozenset(
    {
        "name_or_path",
        "vocab_file",
        "merges_file",
        "tokenizer_file",
        "is_local",
        "local_files_only",
        "cache_dir",
    }
)
"""Tokenizer settings that describe this machine's files, not the tokenizer: left out of its info."""
_SKIP = object()


def _jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it (an added token as its text, or as its settings inside
    ``added_tokens_decoder``); ``_SKIP`` for what has no JSON form."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "content") and hasattr(value, "special"):  # tokenizers.AddedToken
        return value.content
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return [v for v in items if v is not _SKIP]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if hasattr(item, "content") and hasattr(item, "special"):
                out[str(key)] = {name: getattr(item, name, None) for name in _ADDED_TOKEN_FIELDS}
            elif (jsonable := _jsonable(item)) is not _SKIP:
                out[str(key)] = jsonable
        return out
    return _SKIP


_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
