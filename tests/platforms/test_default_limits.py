"""Per-platform defaults of the scheduler limits: the token budget by device and card memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastdeploy.config import EngineConfig
from fastdeploy.engine.core import resolve_scheduler_limits
from fastdeploy.platforms.device import default_max_num_batched_tokens

GIB = 1 << 30


@pytest.mark.parametrize("total_gib, budget", [(80, 4096), (141, 4096), (70, 4096), (40, 2048), (24, 2048)])
def test_gpu_budget_by_card_memory(monkeypatch, total_gib, budget):
    seen = []

    def props(index):
        seen.append(index)
        return SimpleNamespace(total_memory=total_gib * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert default_max_num_batched_tokens(torch.device("cuda")) == budget
    assert default_max_num_batched_tokens(torch.device("cuda", 3)) == budget
    assert seen == [0, 3]


def test_cpu_budget():
    assert default_max_num_batched_tokens(torch.device("cpu")) == 2048


def test_resolve_fills_only_what_is_unset():
    config = EngineConfig.from_kwargs(device="cpu")
    assert config.scheduler.max_num_batched_tokens is None
    resolved = resolve_scheduler_limits(config)
    assert resolved.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.max_num_batched_tokens is None  # a copy, the caller's config untouched
    assert resolved.scheduler.max_num_seqs == config.scheduler.max_num_seqs
    explicit = EngineConfig.from_kwargs(device="cpu", max_num_batched_tokens=96)
    assert resolve_scheduler_limits(explicit) is explicit
