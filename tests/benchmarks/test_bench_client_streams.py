"""``bench serve``'s client against small stand-in servers on 127.0.0.1 (aiohttp) that behave as other
servers do: tokens that decode to no text, no ``usage``, no ``/tokenize``, chat streams."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from fastdeploy.benchmarks.datasets import SampleRequest
from fastdeploy.benchmarks.serve import ServeConfig, run_benchmark
from fastdeploy.entrypoints.cli.main import main

MODEL = "stand-in"


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def completion_chunks(texts: list[str], ids: list[list[int]], with_ids: bool, usage: bool) -> list[bytes]:
    """A completions stream: one chunk per entry, the last with ``finish_reason``, then usage and DONE."""
    out = []
    for k, (text, tok) in enumerate(zip(texts, ids)):
        choice = {"index": 0, "text": text, "finish_reason": "length" if k == len(texts) - 1 else None}
        if with_ids:
            choice["token_ids"] = tok
        out.append(_event({"id": "c", "object": "text_completion", "choices": [choice], "usage": None}))
    if usage:
        total = sum(len(t) for t in ids)
        out.append(
            _event({"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": total}})
        )
    return [*out, b"data: [DONE]\n\n"]


def chat_chunks(texts: list[str], ids: list[list[int]]) -> list[bytes]:
    """A chat stream as OpenAI sends it: a role chunk with empty content first, then content deltas."""
    out = [_event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    for text, tok in zip(texts, ids):
        out.append(
            _event({"id": "x", "choices": [{"index": 0, "delta": {"content": text}, "token_ids": tok}]})
        )
    out.append(_event({"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    return [*out, b"data: [DONE]\n\n"]


class StandIn:
    """An aiohttp server in a thread; ``stream`` is what every POST to a generation endpoint answers."""

    def __init__(self, stream: list[bytes], tokenize: bool = False):
        self.stream = stream
        self.bodies: list[dict] = []
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        if tokenize:
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/detokenize", self._detokenize)
        self._app = app
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self._app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": list(range(len(body["prompt"].split())))})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join("w" for _ in body["tokens"])})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in self.stream:
            await response.write(chunk)
            await asyncio.sleep(0.002)
        await response.write_eof()
        return response


@pytest.fixture
def stand_in() -> Iterator[type[StandIn]]:
    servers: list[StandIn] = []

    def make(*args, **kwargs) -> StandIn:
        servers.append(StandIn(*args, **kwargs))
        return servers[-1]

    yield make  # type: ignore[misc]
    for s in servers:
        s.close()


def bench(server: StandIn, cfg_kwargs: dict | None = None, n: int = 2):
    cfg = ServeConfig(server.url, MODEL, disable_tqdm=True, **(cfg_kwargs or {}))
    return asyncio.run(run_benchmark(cfg, [SampleRequest("a b c", 3, 5)] * n))


@pytest.mark.parametrize("usage", [True, False])
def test_tokens_without_text_count(stand_in, usage):
    """Five tokens, three of which decode to nothing (a character split over tokens): a success with
    five output tokens and one TTFT + four ITL gaps, with or without the usage chunk."""
    texts, ids = ["", "", "é", "", "x"], [[1], [2], [3], [4], [5]]
    server = stand_in(completion_chunks(texts, ids, with_ids=True, usage=usage))
    metrics, results = bench(server)
    assert (metrics.completed, metrics.failed) == (2, 0)
    for r in results:
        assert r.success and r.output_tokens == 5 and len(r.itl) == 4 and r.generated_text == "éx"
        assert 0 < r.ttft < r.latency
    assert metrics.total_output_tokens == 10
    assert all(b["return_token_ids"] is True and b["stream"] is True for b in server.bodies)


def test_all_tokens_empty_text_still_succeed(stand_in):
    server = stand_in(completion_chunks(["", ""], [[1, 2], [3]], with_ids=True, usage=False))
    metrics, results = bench(server)
    assert metrics.completed == 2 and all(r.output_tokens == 3 and len(r.itl) == 1 for r in results)


def test_without_token_ids_text_chunks_count(stand_in):
    """A server that ignores return_token_ids and sends no usage: one token per non-empty chunk."""
    server = stand_in(completion_chunks(["a", "", "b"], [[1], [2], [3]], with_ids=False, usage=False))
    metrics, results = bench(server, {"return_token_ids": False})
    assert metrics.completed == 2 and all(r.output_tokens == 2 for r in results)
    assert all("return_token_ids" not in b for b in server.bodies)


def test_nothing_at_all_is_a_failure(stand_in):
    server = stand_in(completion_chunks([""], [[]], with_ids=True, usage=False))
    metrics, results = bench(server)
    assert metrics.failed == 2 and all(r.error == "no token received" for r in results)


def test_chat_stream_role_chunk_is_not_the_first_token(stand_in):
    """The role chunk (empty content, no ids) starts nothing: TTFT is the first content chunk's."""
    server = stand_in(chat_chunks(["Hel", "", "lo"], [[1], [2], [3]]))
    metrics, results = bench(server, {"endpoint": "/v1/chat/completions"})
    assert metrics.completed == 2
    for r in results:
        assert r.output_tokens == 3 and len(r.itl) == 2 and r.generated_text == "Hello"
    assert all(b["messages"] == [{"role": "user", "content": "a b c"}] for b in server.bodies)


def test_no_tokenize_endpoint_prints_one_line_hint(stand_in, capsys, tmp_path):
    server = stand_in(completion_chunks(["a"], [[1]], with_ids=True, usage=True))
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len", "4",
                 "--output-len", "2", "--disable-tqdm"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer" in err and "HTTP 404" in err, err
    assert "Traceback" not in err and not server.bodies


def test_backend_openai_chat_with_server_tokenizer(stand_in, tmp_path):
    """``--backend openai-chat`` picks the chat endpoint; prompts are sized through /tokenize."""
    server = stand_in(chat_chunks(["a", "b"], [[1], [2]]), tokenize=True)
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", server.url, "--backend", "openai-chat", "--num-prompts", "3",
                 "--input-len", "6", "--output-len", "2", "--disable-tqdm", "--save-result", str(out)])  # fmt: skip
    assert code == 0
    r = json.loads(out.read_text())
    assert (r["endpoint"], r["backend"], r["completed"], r["total_output_tokens"]) == (
        "/v1/chat/completions", "openai-chat", 3, 6,
    )  # fmt: skip
    assert len(server.bodies) == 3 and all("messages" in b for b in server.bodies)
