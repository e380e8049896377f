"""The engine core's outbox with several API servers: each request's outputs go to the client that added it,
the scheduler stats to every client, ``dead`` to all; owners are forgotten when their request finishes."""

from __future__ import annotations

import socket

import pytest

from fastdeploy.core.request import EngineCoreOutput, SchedulerStats, outputs_from_rows
from fastdeploy.engine.core_proc import _Outbox
from fastdeploy.engine.ipc import decode
from fastdeploy.entrypoints.openai.api_server_procs import bind_shared_sockets
from fastdeploy.entrypoints.openai.http_server import BindError


class FakeSocket:
    def __init__(self):
        self.messages = []

    def send(self, frame: bytes) -> None:
        self.messages.append(decode(frame))


def ids(message) -> list[str]:
    return [o.request_id for o in outputs_from_rows(message["outputs"])]


def test_outputs_go_to_the_client_that_added_the_request():
    sockets = [FakeSocket(), FakeSocket(), FakeSocket()]
    outbox = _Outbox(sockets, rank=1)
    outbox.own("a", 0)
    outbox.own("b", 2)
    outbox.own("c", 2)
    outbox.send_outputs(
        [EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2]), EngineCoreOutput("c", [3])], None
    )
    assert [ids(m) for m in sockets[0].messages] == [["a"]]
    assert sockets[1].messages == []  # no outputs and no stats: nothing
    assert [ids(m) for m in sockets[2].messages] == [["b", "c"]]
    assert all(m["rank"] == 1 and m["stats"] is None for s in sockets for m in s.messages)

    # stats reach every client, with or without outputs; a finished request's owner is forgotten
    stats = SchedulerStats(num_running=1, kv_cache_usage=0.5)
    outbox.send_outputs([EngineCoreOutput("b", [4], finish_reason="length")], stats)
    assert [ids(s.messages[-1]) for s in sockets] == [[], [], ["b"]]
    assert all(s.messages[-1]["stats"]["kv_cache_usage"] == 0.5 for s in sockets)
    assert outbox._owners == {"a": 0, "c": 2}

    outbox.send({"type": "dead", "error": "gone"})
    assert all(s.messages[-1] == {"type": "dead", "error": "gone", "rank": 1} for s in sockets)


def test_one_client_keeps_no_owner_map():
    sock = FakeSocket()
    outbox = _Outbox([sock], rank=0)
    outbox.own("a", 0)
    outbox.send_outputs([EngineCoreOutput("a", [1])], None)
    assert outbox._owners == {} and [ids(m) for m in sock.messages] == [["a"]]


def test_shared_sockets_bind_one_port_and_refuse_a_busy_one():
    sockets = bind_shared_sockets("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1
        for s in sockets:
            s.listen()
        # another server's bind of the port (SO_REUSEPORT or not) fails before anything loads
        with pytest.raises(BindError):
            bind_shared_sockets("127.0.0.1", ports.pop(), 2)
    finally:
        for s in sockets:
            s.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(BindError):
            bind_shared_sockets("127.0.0.1", taken.getsockname()[1], 2)
