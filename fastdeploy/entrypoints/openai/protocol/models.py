"""``GET /v1/models``: the model listing."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fastdeploy.entrypoints.openai.protocol.common import ResponseModel, _now


class ModelCard(ResponseModel):
    """One served model, with vLLM's fields: ``root`` (the model's path), ``parent`` (the base model
    of an adapter; null, as vLLM's base models have it: no adapters here) and ``max_model_len``
    (not vLLM's ``permission`` list: its fresh ids would make two listings of one model differ)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fastdeploy"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
