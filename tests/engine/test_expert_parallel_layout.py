"""Layouts with ``enable_expert_parallel`` that cannot run are refused up front, naming the problem."""

from __future__ import annotations

import pytest

from fastdeploy.config import EngineConfig
from fastdeploy.engine.core import resolve_async_scheduling
from fastdeploy.engine.parallel_layout import ParallelLayoutError, check_parallel_layout
from fastdeploy.transformers_utils.config import ModelArchConfig

MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


def config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(device="cpu", enable_expert_parallel=True, **kwargs)


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        (
            {"architectures": ["Qwen3ForCausalLM"], "num_experts": 0},
            {"tensor_parallel_size": 2},
            "no experts",
        ),
        ({}, {}, "tensor_parallel_size or data_parallel_size > 1"),
        ({"num_experts": 6}, {"tensor_parallel_size": 2, "data_parallel_size": 2}, "6 experts"),
    ],
    ids=["dense-model", "one-worker", "uneven-experts"],
)
def test_impossible_expert_parallel_layouts_are_refused(arch, kwargs, message):
    with pytest.raises(ParallelLayoutError, match=message):
        check_parallel_layout(config(**kwargs), ModelArchConfig.from_dict({**MOE, **arch}))


def test_possible_layouts_pass_and_replicas_may_overlap_their_steps():
    arch = ModelArchConfig.from_dict(MOE)
    check_parallel_layout(config(tensor_parallel_size=2), arch)
    dp = config(data_parallel_size=2)
    check_parallel_layout(dp, arch)
    assert dp.parallel.expert_parallel_spans_replicas
    assert not config(tensor_parallel_size=2).parallel.expert_parallel_spans_replicas
    assert resolve_async_scheduling(dp) is False  # a CPU's default
    check_parallel_layout(config(data_parallel_size=2, async_scheduling=True), arch)
    assert resolve_async_scheduling(config(data_parallel_size=2, async_scheduling=True)) is True
