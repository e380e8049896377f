"""The interface the API server uses to talk to an engine.

``AsyncLLM`` (engine core in another process) implements it; the API server
depends only on this, so it never learns how the engine is laid out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from fastdeploy.config import EngineConfig
from fastdeploy.core.outputs import RequestOutput
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core or a worker died; requests cannot be served."""


class EngineRequestRejected(ValueError):
    """The engine core refused one request's input (its own checks when the request arrives, e.g. a
    prompt longer than the context): a 400 for that request; the server stays up for the others."""


class EngineClient(ABC):
    """Asynchronous generation API of a running engine."""

    config: EngineConfig
    tokenizer: Any
    """A Hugging Face tokenizer: ``encode``, ``decode``, ``apply_chat_template``."""
    max_model_len: int
    eos_token_ids: list[int]
    arch: Any = None
    """The model's ``ModelArchConfig`` (hidden size, multimodal token ids), or None if unknown."""
    pooler: Any = None
    """The ``PoolerConfig`` when the model is served for embeddings (pooling runner), else None."""
    generation_defaults: dict[str, Any] = {}
    """The model's sampling defaults for requests that leave them unset (``--generation-config``)."""

    @abstractmethod
    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        mm_items: list[Any] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's progress.

        ``mm_items`` are the prompt's placed multimodal items (``MMItem``, features included).
        ``pooling_params`` makes it an embedding request (pooling runner only): one finished
        output carries the pooled vector in ``embedding``.

        Each yielded ``RequestOutput`` carries the *delta* since the previous one
        (new text and token ids per choice); the last one has ``finished=True``
        and every choice's ``finish_reason`` set. Raises ``EngineDeadError`` if
        the engine dies. Cancelling the iterator (client gone) aborts the request.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV cache blocks."""

    async def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes (only while no request runs); whether it was done. Engines
        without a prefix cache have nothing to forget."""
        return True

    @property
    @abstractmethod
    def is_healthy(self) -> bool:
        """False once the engine core or a worker has died."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine processes."""
