"""Per-platform defaults of the scheduler limits: the token budget by device and card memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastdeploy.config import EngineConfig
from fastdeploy.engine.core import resolve_scheduler_limits
from fastdeploy.platforms.device import default_max_num_batched_tokens

GIB = 1 << 30


@pytest.mark.parametrize(
    "total_gib, budget, offline_budget",
    [(80, 4096, 16384), (141, 4096, 16384), (70, 4096, 16384), (40, 2048, 8192), (24, 2048, 8192)],
)
def test_gpu_budget_by_card_memory(monkeypatch, total_gib, budget, offline_budget):
    seen = []

    def props(index):
        seen.append(index)
        return SimpleNamespace(total_memory=total_gib * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert default_max_num_batched_tokens(torch.device("cuda")) == budget
    assert default_max_num_batched_tokens(torch.device("cuda", 3)) == budget
    assert default_max_num_batched_tokens(torch.device("cuda", 1), offline=True) == offline_budget
    assert seen == [0, 3, 1]


def test_cpu_budget():
    assert default_max_num_batched_tokens(torch.device("cpu")) == 2048
    assert default_max_num_batched_tokens(torch.device("cpu"), offline=True) == 2048


def test_offline_llm_takes_the_offline_default_and_keeps_an_explicit_one(monkeypatch):
    """The ``LLM`` class resolves the budget with ``offline=True`` before its engine starts."""
    from fastdeploy.entrypoints import llm as llm_module

    calls = []

    class Engine:
        def __init__(self, config):
            calls.append(config.scheduler.max_num_batched_tokens)

    monkeypatch.setattr(llm_module, "LLMEngine", Engine)
    monkeypatch.setattr(llm_module, "freeze_startup_heap", lambda name: None)
    monkeypatch.setattr(
        "fastdeploy.platforms.device.default_max_num_batched_tokens",
        lambda device, offline=False: 16384 if offline else 4096,
    )
    llm_module.LLM(model="m", device="cpu")
    llm_module.LLM(model="m", device="cpu", max_num_batched_tokens=96)
    assert calls == [16384, 96]


def test_resolve_fills_only_what_is_unset():
    config = EngineConfig.from_kwargs(device="cpu")
    assert config.scheduler.max_num_batched_tokens is None
    resolved = resolve_scheduler_limits(config)
    assert resolved.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.max_num_batched_tokens is None  # a copy, the caller's config untouched
    assert resolved.scheduler.max_num_seqs == config.scheduler.max_num_seqs
    explicit = EngineConfig.from_kwargs(device="cpu", max_num_batched_tokens=96)
    assert resolve_scheduler_limits(explicit) is explicit
