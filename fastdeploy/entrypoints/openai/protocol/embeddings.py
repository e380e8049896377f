"""``POST /v1/embeddings``: the request and response of OpenAI's embeddings API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator

from fastdeploy.entrypoints.openai.protocol.common import OpenAIModel, ResponseModel, _now
from fastdeploy.entrypoints.openai.protocol.completion import PROMPT_FORMS_SCHEMA, normalize_prompts
from fastdeploy.entrypoints.openai.protocol.sampling import check_truncate_prompt_tokens


class EmbeddingRequest(OpenAIModel):
    """``POST /v1/embeddings`` (an embedding model only: ``--runner pooling``).

    ``input`` is normalised to a list of inputs, each a string or a list of token ids.
    """

    model: str | None = None
    input: Annotated[list[str | list[int]], WithJsonSchema(PROMPT_FORMS_SCHEMA)]
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    encoding_format: Literal["float", "base64"] = "float"
    """``float``: a list of numbers; ``base64``: the float32 little-endian bytes, base64-encoded."""
    dimensions: int | None = None
    """Keep the first N values (then L2-normalise again when the model normalises); only for models
    that declare Matryoshka support (config.json ``is_matryoshka`` / ``matryoshka_dimensions``)."""
    user: str | None = None
    """Accepted and ignored."""
    add_special_tokens: bool = True
    """Extension (vLLM): let the tokenizer add its special tokens (e.g. BOS) to text inputs."""
    truncate_prompt_tokens: int | None = None
    """Extension (vLLM): embed only the last N tokens of each input (-1: the last ``max_model_len``)."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's: which end ``truncate_prompt_tokens`` cuts (left, the default: the first tokens go)."""
    normalize: bool | None = None
    """Extension (vLLM): L2-normalise the vectors or not (None: as the model / ``--pooler-config`` says)."""

    @field_validator("input", mode="before")
    @classmethod
    def _normalize_input(cls, value: Any) -> list[str | list[int]]:
        return normalize_prompts(value)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate(cls, value: int | None) -> int | None:
        return check_truncate_prompt_tokens(value)

    @field_validator("dimensions")
    @classmethod
    def _check_dimensions(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value


class EmbeddingData(ResponseModel):
    """One input's vector."""

    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    """The vectors of a request's inputs, in input order."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
