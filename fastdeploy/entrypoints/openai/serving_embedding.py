"""``POST /v1/embeddings``: pooled vectors of the inputs, batched through the engine like any request."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.protocol import EngineClient
from fastdeploy.entrypoints.openai.errors import BadRequestError, InternalServerError
from fastdeploy.entrypoints.openai.event_streams import run_until_disconnected
from fastdeploy.entrypoints.openai.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from fastdeploy.entrypoints.openai.request_ids import api_request_id
from fastdeploy.entrypoints.openai.serving_engine import EnginePrompt, OpenAIServing, sub_request_ids


def check_generation_model(engine: EngineClient) -> None:
    """400 for a completions or chat request to an embedding model (pooling runner)."""
    if getattr(engine, "pooler", None) is not None:
        raise BadRequestError(
            "This model is served for embeddings (--runner pooling); it answers /v1/embeddings only.",
            param="model",
            code="model_not_supported",
        )


class OpenAIServingEmbedding(OpenAIServing):
    """Tokenize the inputs, run one pooling request per input, answer the vectors in input order.

    A generation model answers 400 (``model_not_supported``; vLLM answers the same kind of
    error): embeddings need a server started with an embedding model (``--runner pooling``).
    """

    def __init__(self, *args: Any, max_prompts_per_request: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_prompts_per_request = max_prompts_per_request
        """Most inputs one request may carry (None: no limit)."""

    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        """Validate, tokenize, run and answer one embeddings request."""
        model = self.resolve_model(request.model)
        pooler = getattr(self.engine, "pooler", None)
        if pooler is None:
            raise BadRequestError(
                f"The model `{model}` is served for generation and does not support the embeddings API "
                "(serve an embedding model, with --runner pooling).",
                param="model",
                code="model_not_supported",
            )
        if request.dimensions is not None:
            error = pooler.dimensions_error(request.dimensions, self.engine.arch.hidden_size)
            if error is not None:
                raise BadRequestError(error, param="dimensions")
        self.check_healthy()
        limit = self.max_prompts_per_request
        if limit is not None and len(request.input) > limit:
            raise BadRequestError(
                f"input holds {len(request.input)} inputs; this server takes at most {limit} per request",
                param="input",
            )
        max_len = self.engine.max_model_len
        self.keep_last([], request.truncate_prompt_tokens)  # (a 400 before any tokenizing if too large)
        params = pooler.params()
        if request.normalize is not None:
            params = dataclasses.replace(params, normalize=request.normalize)
        prompts = []
        for item in request.input:
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise BadRequestError(
                        "no tokenizer is loaded (--skip-tokenizer-init, or a model without one); send token ids",
                        param="input",
                    )
                text: str | None = item
                token_ids = await self.encode(
                    item, add_special_tokens=request.add_special_tokens, param="input"
                )
                if not token_ids:
                    raise BadRequestError("input must not be empty", param="input")
            else:
                text, token_ids = None, list(item)
                self.check_token_ids(token_ids, "input")
            token_ids = self.keep_last(token_ids, request.truncate_prompt_tokens, request.truncation_side)
            if len(token_ids) > max_len:
                raise BadRequestError(
                    f"an input has {len(token_ids)} tokens, more than this model's maximum context length "
                    f"of {max_len} tokens (truncate_prompt_tokens keeps the last N)",
                    param="input",
                    code="context_length_exceeded",
                )
            prompts.append(
                EnginePrompt(token_ids=token_ids, params=SamplingParams(), text=text, pooling=params)
            )
        request_id, engine_id = api_request_id("embd", raw_request)
        request_ids = sub_request_ids(engine_id, len(prompts))
        vectors = await run_until_disconnected(raw_request, self._collect(request_ids, prompts))
        data = [
            EmbeddingData(
                embedding=self._encode(v, request.dimensions, request.encoding_format, params.normalize),
                index=i,
            )
            for i, v in enumerate(vectors)
        ]
        total = sum(len(p.token_ids) for p in prompts)
        response = EmbeddingResponse(
            id=request_id,
            model=model,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=total, total_tokens=total),
        )
        return JSONResponse(response.model_dump())

    async def _collect(self, request_ids: list[str], prompts: list[EnginePrompt]) -> list[list[float]]:
        """Every input's pooled vector, in input order."""
        vectors: list[list[float] | None] = [None] * len(prompts)
        started = await self.start_requests(request_ids, prompts)
        async with contextlib.aclosing(started.outputs()) as outputs:
            async for i, out in outputs:
                if out.embedding is not None:
                    vectors[i] = out.embedding
        if any(v is None for v in vectors):
            raise InternalServerError("the engine finished an embedding request without its vector")
        return vectors  # type: ignore[return-value]

    @staticmethod
    def _encode(
        vector: list[float], dimensions: int | None, encoding_format: str, normalize: bool
    ) -> list[float] | str:
        """The vector as the response carries it: cut to ``dimensions`` (renormalised when the model
        normalises), then floats or base64 of its float32 little-endian bytes."""
        values = np.asarray(vector, dtype=np.float32)
        if dimensions is not None:
            values = values[:dimensions]
            if normalize:
                values = values / max(float(np.linalg.norm(values)), 1e-12)
        if encoding_format == "base64":
            return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
        return values.tolist()
