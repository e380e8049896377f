"""``to_wire`` of the step hand-offs builds exactly ``dataclasses.asdict``'s form, without its copies."""

from __future__ import annotations

import dataclasses

from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.step_io import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerSamplingParams,
)
from fastdeploy.engine.ipc import decode, encode


def scheduler_output() -> SchedulerOutput:
    sampling = WorkerSamplingParams(temperature=0.5, logit_bias={3: 1.5}, bad_words_token_ids=[[1, 2]])
    return SchedulerOutput(
        step_id=9,
        new_reqs=[
            NewRequestData("a", [1, 2], 2, sampling, [0], 0, mm_items=[{"mm_hash": "h", "offset": 1}]),
            NewRequestData("e", [5, 6, 7], 3, WorkerSamplingParams(), [1], 0, pooling=PoolingParams("mean")),
        ],
        cached_reqs=CachedRequestData(["c"], [[4]], [8]),
        num_scheduled_tokens={"a": 2, "e": 3, "c": 1},
        total_num_scheduled_tokens=6,
        finished_req_ids=["z"],
        evicted_mm_hashes=["old"],
        structured_req_ids=["c"],
        grammar=GrammarBitmask(["c"], b"\x01\x00\x00\x00", 1),
    )


def test_scheduler_output_wire_is_asdict_form_and_round_trips():
    so = scheduler_output()
    expected = dataclasses.asdict(so)
    del expected["grammar"]["tensor"]  # the in-process host tensor never travels
    assert so.to_wire() == expected
    back = SchedulerOutput.from_wire(decode(encode(so.to_wire())))
    assert back == so
    assert back.new_reqs[1].pooling == PoolingParams("mean") and back.grammar == so.grammar


def test_a_grammar_mask_array_travels_as_its_bytes_without_its_tensor():
    import numpy as np
    import torch

    tensor = torch.tensor([[1, -1], [0, 7]], dtype=torch.int32)
    mask = GrammarBitmask(["a", "b"], tensor.numpy(), 2, tensor=tensor)
    back = GrammarBitmask(**decode(encode(mask.to_wire())))
    assert back.tensor is None and isinstance(back.bitmask, bytes)
    np.testing.assert_array_equal(back.array(), tensor.numpy())


def test_runner_output_wire_is_asdict_form_and_round_trips():
    out = ModelRunnerOutput(3, ["a", "b"], [5, 6], [0, 1], logprobs=[None, [[1], [-0.5], -0.5, 1]],
                            prompt_logprobs={"a": [1, [[[2], [-1.0], -1.0, 1]]]}, moe_load_imbalance=1.25,
                            pooled={"e": b"\x00\x00\x80?"})  # fmt: skip
    assert out.to_wire() == dataclasses.asdict(out)
    assert ModelRunnerOutput.from_wire(decode(encode(out.to_wire()))) == out
