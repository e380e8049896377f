"""The engine core's step outputs survive their wire form (rows of fields through msgpack) unchanged."""

from __future__ import annotations

import dataclasses

from fastdeploy.core.request import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from fastdeploy.engine.ipc import decode, encode


def test_outputs_round_trip_every_field():
    outputs = [
        EngineCoreOutput(
            "a",
            [5, 6],
            None,
            None,
            16,
            queue_time=0.25,
            logprobs=[[[1, 2], [-0.5, -1.5], -0.25, 1], [[3], [-0.1], -0.1, 1]],
            prompt_logprobs=[[[7], [-2.0], -3.0, 4]],
        ),  # fmt: skip
        EngineCoreOutput("b#1", [9], "stop", 9, 0),
        EngineCoreOutput("c", [], "abort", None, 0, error="boom"),
        EngineCoreOutput("d", [1, 2, 3], "stop", "END", 3),
    ]
    stats = SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.5, prefix_cache_queries=64)
    message = EngineCoreOutputs(outputs=outputs, stats=stats, timestamp=123.5)
    back = EngineCoreOutputs.from_wire(decode(encode(message.to_wire())))
    assert back == message
    assert [dataclasses.asdict(o) for o in back.outputs] == [dataclasses.asdict(o) for o in outputs]


def test_every_field_is_in_the_row():
    """A field added to EngineCoreOutput travels without touching the wire code."""
    names = [f.name for f in dataclasses.fields(EngineCoreOutput)]
    row = EngineCoreOutputs([EngineCoreOutput("x", [1])]).to_wire()["outputs"][0]
    assert len(row) == len(names)
    assert EngineCoreOutputs.from_wire({"outputs": [], "stats": None, "timestamp": 0.0}).outputs == []
