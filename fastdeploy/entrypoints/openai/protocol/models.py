"""``GET /v1/models``: the model listing."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import Field

from fastdeploy.entrypoints.openai.protocol.common import ResponseModel, _now


class ModelPermission(ResponseModel):
    """vLLM's (and OpenAI's former) permission object of a model: everything but fine-tuning allowed."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=_now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(ResponseModel):
    """One served model, with vLLM's fields: ``root`` (the model's path), ``parent`` (the base model
    of an adapter; null, as vLLM's base models have it: no adapters here), ``max_model_len`` and
    ``permission`` (vLLM's one default permission object)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "fastdeploy"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
