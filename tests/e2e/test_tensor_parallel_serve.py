"""``fastdeploy serve --tensor-parallel-size 2``: two worker processes, the same greedy tokens as one."""

from __future__ import annotations

import pytest

PROMPTS = ["Hello, my name is", "The best way to learn Python is", "List three colors:"]


def greedy_completions(srv, model: str) -> list[str]:
    client = srv.openai()
    return [
        client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in PROMPTS
    ]


def greedy_chat(srv, model: str) -> str:
    response = srv.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12, temperature=0
    )
    return response.choices[0].message.content


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    from tests.e2e.conftest import API_KEY, RemoteServer

    srv = RemoteServer(
        tmp_path_factory.mktemp("tp2") / "server.log", "--tensor-parallel-size", "2", api_key=API_KEY
    )
    try:
        yield srv
    finally:
        srv.stop()  # checks that both workers and the engine core are gone


def test_tp2_server_runs_two_workers(tp_server):
    assert len(tp_server.engine_core().children()) == 2


def test_tp2_greedy_tokens_equal_tp1(server, tp_server, model_name):
    assert greedy_completions(tp_server, model_name) == greedy_completions(server, model_name)
    assert greedy_chat(tp_server, model_name) == greedy_chat(server, model_name)


def test_tp2_streams(tp_server, model_name):
    stream = tp_server.openai().completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == greedy_completions(tp_server, model_name)[0][: len(text)] and text


@pytest.mark.slow
def test_dp2_x_tp2_greedy_tokens_equal_tp1(server, server_factory, model_name):
    """Two replicas of two tensor-parallel workers each (four workers): the same tokens as one worker."""
    from tests.e2e.conftest import API_KEY

    srv = server_factory("--tensor-parallel-size", "2", "--data-parallel-size", "2", api_key=API_KEY)
    cores = [p for p in srv.descendants() if len(p.children()) == 2]
    assert len(cores) == 2, srv.descendants()  # two engine cores, each with two workers
    assert greedy_completions(srv, model_name) == greedy_completions(server, model_name)
    assert greedy_chat(srv, model_name) == greedy_chat(server, model_name)
    srv.stop()
