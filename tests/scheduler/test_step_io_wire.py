"""The step hand-offs survive the ZMQ wire (``to_wire`` → msgpack → ``from_wire``), and what the scheduler puts in them."""

from __future__ import annotations

from fastdeploy.core.request import EngineCoreRequest, Request
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.step_io import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StopCode,
    WorkerSamplingParams,
)
from fastdeploy.engine.ipc import decode, encode
from fastdeploy.scheduler.scheduler import worker_sampling


def over_the_wire(message):
    return type(message).from_wire(decode(encode(message.to_wire())))


def test_scheduler_output_with_every_sampling_field_round_trips():
    sampling = WorkerSamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=3,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={7: 2.5, 11: -100.0},
        bad_words_token_ids=[[4], [5, 6]],
        min_tokens=2,
        max_tokens=9,
        eos_token_ids=[2],
        stop_token_ids=[13, 198],
        logprobs=3,
        prompt_logprobs=0,
    )
    so = SchedulerOutput(
        step_id=4,
        new_reqs=[
            NewRequestData("a", [1, 2, 3], 2, sampling, [0, 1], 0),
            NewRequestData(
                "b", [4], 1, WorkerSamplingParams(), [2], 0, mm_items=[{"mm_hash": "h", "offset": 0}]
            ),
        ],
        cached_reqs=CachedRequestData(["c"], [[3]], [5]),
        num_scheduled_tokens={"a": 3, "b": 1, "c": 1},
        total_num_scheduled_tokens=5,
        finished_req_ids=["d"],
        evicted_mm_hashes=["x"],
    )
    back = over_the_wire(so)
    assert back == so
    assert all(isinstance(new.sampling, WorkerSamplingParams) for new in back.new_reqs)
    assert list(back.new_reqs[0].sampling.logit_bias) == [7, 11]  # int token ids, not strings


def test_model_runner_output_round_trips_with_its_stop_codes():
    output = ModelRunnerOutput(
        7,
        ["a", "b", "c"],
        [5, 2, 9],
        [StopCode.RUNNING, StopCode.EOS, StopCode.LENGTH],
        logprobs=[None, [[2], [-0.1], -0.1, 1], None],
        prompt_logprobs={"a": [1, [[[3], [-1.0], -1.0, 1]]]},
    )
    back = over_the_wire(output)
    assert back == output
    assert [StopCode(code) for code in back.stopped] == [StopCode.RUNNING, StopCode.EOS, StopCode.LENGTH]


def test_worker_sampling_carries_the_stop_controls_the_worker_decides_with():
    def sent(eos: list[int], **params) -> WorkerSamplingParams:
        return worker_sampling(Request(EngineCoreRequest("r", [1, 2], SamplingParams(**params), eos), 4))

    plain = sent([2, 0], stop_token_ids=[13], min_tokens=1, max_tokens=5, top_k=-1)
    assert (plain.eos_token_ids, plain.stop_token_ids) == ([0, 2], [13])
    assert (plain.min_tokens, plain.max_tokens, plain.top_k) == (1, 5, -1)
    assert sent([2], ignore_eos=True).eos_token_ids == []
    assert sent([2], max_tokens=None).max_tokens is None
    assert sent([2], prompt_logprobs=2).prompt_logprobs == 2
    assert sent([2]) == WorkerSamplingParams(temperature=1.0, max_tokens=16, eos_token_ids=[2])
