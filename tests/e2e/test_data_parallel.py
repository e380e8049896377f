"""Data parallelism: ``fastdeploy serve --data-parallel-size 2`` (two engine cores behind one API server).

- The routing choice (:func:`choose_rank`) and its bookkeeping (:class:`Router`), without a server.
- One DP=2 server (``--no-exit-on-engine-death``, its own ``TMPDIR``), in this order:
  greedy tokens equal the shared DP=1 server's (completions and chat, requests on both
  ranks); eight concurrent streams split 4 / 4 over the ranks (the per-rank gauges);
  killing one engine core fails ``/health`` and the request in flight on the other rank,
  and SIGTERM then stops everything (exit 143, no process or socket file left).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from fastdeploy.config import EngineConfig
from fastdeploy.engine.dp_router import (
    PREFIX_ROUTING_SLACK,
    RankLoad,
    Route,
    Router,
    SharedRankLoads,
    choose_rank,
    prefix_block_hashes,
)
from fastdeploy.engine.engine_cores import rank_config
from tests.e2e.conftest import RemoteServer
from tests.e2e.test_failures import start_long_stream
from tests.e2e.test_lifecycle import ipc_leftovers

HEALTH_503_S = 2.0

# ---------------------------------------------------------------------------- routing, no server


def test_choose_rank_fewest_requests_then_kv_usage_then_lowest_rank():
    assert choose_rank([RankLoad()]) == 0
    assert choose_rank([RankLoad(3, 0.0), RankLoad(1, 0.9), RankLoad(2, 0.0)]) == 1
    assert choose_rank([RankLoad(2, 0.5), RankLoad(2, 0.2), RankLoad(3, 0.0)]) == 1
    assert choose_rank([RankLoad(1, 0.3), RankLoad(1, 0.3)]) == 0
    assert choose_rank([RankLoad(1, 0.3), RankLoad(0, 0.3), RankLoad(0, 0.3)]) == 1


def test_router_balances_tracks_owners_and_forgets_finished_requests():
    router = Router(2)
    routes = {f"r{i}": router.route(f"r{i}", 1) for i in range(4)}
    assert [route.rank for route in routes.values()] == [0, 1, 0, 1]
    assert router.rank_of("r1") == 1 and router.rank_of("unknown") is None

    routes["wide"] = router.route("wide", 3)  # a request of n=3 choices counts three
    assert routes["wide"].rank == 0 and [load.num_requests for load in router.loads] == [5, 2]
    routes["next"] = router.route("next", 1)
    assert routes["next"].rank == 1

    router.release("wide", routes.pop("wide"))
    router.release("r3", routes.pop("r3"))
    assert [load.num_requests for load in router.loads] == [2, 2] and router.rank_of("r3") is None
    router.on_kv_cache_usage(0, 0.4)  # equal counts: the rank with less KV cache in use
    routes["tie"] = router.route("tie", 1)
    assert routes["tie"].rank == 1

    for request_id, route in routes.items():
        router.release(request_id, route)
    assert len(router) == 0  # nothing leaks
    assert [load.num_requests for load in router.loads] == [0, 0]


def test_router_release_of_a_reused_id_keeps_the_new_owner():
    """An aborted request's generator may end after a new request took its id: that one stays routed."""
    router = Router(2)
    old = router.route("same", 1)
    new = router.route("same", 1)
    router.release("same", old)
    assert router.rank_of("same") == new.rank == 1
    router.release("same", new)
    assert len(router) == 0 and [load.num_requests for load in router.loads] == [0, 0]


def test_prefix_block_hashes_are_shared_by_common_prefixes_only():
    a = prefix_block_hashes(list(range(40)), 16)
    b = prefix_block_hashes([*range(32), 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84], 16)
    assert len(a) == 2 and len(b) == 3  # full blocks only
    assert a == b[:2]
    assert prefix_block_hashes([7, *range(1, 40)], 16)[1] != a[1]  # a later block depends on the earlier ones
    assert prefix_block_hashes(list(range(15)), 16) == []


def test_router_sends_a_known_prefix_to_its_rank_unless_that_rank_is_overloaded():
    system = list(range(100, 132))  # two full blocks shared by every prompt below
    router = Router(2, prefix_block_size=16)
    ranks = [router.route(f"r{i}", 1, [*system, 1000 + i]).rank for i in range(6)]
    # rank 0 served the prefix first and keeps it while it is at most SLACK (2) requests ahead; then
    # the least-loaded rank gets one, owns the prefix from then on, and keeps it likewise
    assert PREFIX_ROUTING_SLACK == 2 and ranks == [0, 0, 0, 1, 1, 1]
    assert [load.num_requests for load in router.loads] == [3, 3]
    # a conversation goes on where it started, though another rank is less loaded by now
    conversation = list(range(500, 548))
    turn1 = router.route("turn1", 1, conversation)
    assert turn1.rank == 0
    router.release("turn1", turn1)
    router.route("busy", 1)  # no prompt blocks: least-loaded (rank 0 of two equal)
    assert choose_rank(router.loads) == 1
    assert router.route("turn2", 1, [*conversation, *range(900, 920)]).rank == 0
    # prompts without a full block, or a single rank, or prefix caching off: plain least-loaded
    assert Router(1, prefix_block_size=16).route("x", 1, system).rank == 0
    plain = Router(2)
    assert [plain.route(f"p{i}", 1, system).rank for i in range(4)] == [0, 1, 0, 1]


def test_api_servers_balance_the_ranks_together(tmp_path):
    """Four API servers, each with an odd share of a 512-request burst over two ranks of 256
    sequences: balanced together the ranks get 256 each; alone, each API server's odd request went
    to rank 0 (ties go to the lowest rank), and rank 0's 258th request waited a whole generation."""
    shares = [129, 127, 129, 127]

    def burst(routers: list[Router]) -> list[int]:
        for turn in range(max(shares)):  # the API servers' requests interleaved, as in a burst
            for index, (router, share) in enumerate(zip(routers, shares)):
                if turn < share:
                    router.route(f"s{index}-r{turn}", 1)
        return [sum(r.loads[rank].num_requests for r in routers) for rank in range(2)]

    assert burst([Router(2) for _ in shares]) == [258, 254]
    path = str(tmp_path / "loads")
    shared = [Router(2, shared=SharedRankLoads(path, len(shares), i, 2)) for i in range(len(shares))]
    assert burst(shared) == [256, 256]
    assert shared[3].shared.totals() == [256, 256]
    rank = shared[1].rank_of("s1-r0")
    shared[1].release("s1-r0", Route(rank, 1))  # finished: off every API server's view
    assert shared[0].shared.totals()[rank] == 255
    for router in shared:
        router.shared.close()


def test_rank_config_copies_only_the_rank():
    config = EngineConfig.from_kwargs(data_parallel_size=2, max_num_seqs=7)
    copy = rank_config(config, 1)
    assert copy.parallel.data_parallel_rank == 1 and config.parallel.data_parallel_rank == 0
    assert dataclasses.replace(copy.parallel, data_parallel_rank=0) == config.parallel
    assert copy.scheduler == config.scheduler and copy.model == config.model


# ---------------------------------------------------------------------------- one DP=2 server


@pytest.fixture(scope="module")
def dp_tmpdir() -> Iterator[Path]:
    """A fresh (short: socket paths are limited) ``TMPDIR`` for the DP=2 server, so leftovers show."""
    path = Path(tempfile.mkdtemp(prefix="fd-dp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, dp_tmpdir) -> Iterator[RemoteServer]:
    """``--data-parallel-size 2``; the last test of this file kills an engine core and stops it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(dp_tmpdir))
        srv = RemoteServer(
            tmp_path_factory.mktemp("dp") / "server.log",
            "--data-parallel-size",
            "2",
            "--no-exit-on-engine-death",
        )
    try:
        yield srv
    finally:
        if srv.proc.poll() is None or not srv._log.closed:
            srv.stop(check=False)


def engine_cores(srv: RemoteServer) -> list[psutil.Process]:
    """The server's engine core processes, by rank (from the process names in their command lines)."""
    cores = {}
    for child in psutil.Process(srv.proc.pid).children():
        name = child.cmdline()[-1]
        if name.startswith("fastdeploy-engine-core-"):
            cores[int(name.rsplit("-", 1)[1])] = child
    return [cores[rank] for rank in sorted(cores)]


def per_engine(metrics: dict[str, float], name: str) -> list[float]:
    """``fastdeploy:<name>{engine=0}``, ``{engine=1}`` of a scrape."""
    return [metrics[f"fastdeploy:{name}{{engine={rank}}}"] for rank in (0, 1)]


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colors:",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky color?"}],
]
GREEDY = {"max_tokens": 24, "temperature": 0, "extra_body": {"return_token_ids": True}}


async def greedy_tokens(client: openai.AsyncOpenAI, model: str) -> list[list[int]]:
    """Every prompt's and chat's greedy tokens, all requests in flight at once (so both ranks serve)."""
    completions = [client.completions.create(model=model, prompt=p, **GREEDY) for p in PROMPTS]
    chats = [client.chat.completions.create(model=model, messages=m, **GREEDY) for m in CHATS]
    responses = await asyncio.gather(*completions, *chats)
    return [r.choices[0].token_ids for r in responses]


def test_greedy_tokens_equal_those_of_one_engine(dp_server, server, model_name):
    expected = asyncio.run(greedy_tokens(server.async_openai(), model_name))
    got = asyncio.run(greedy_tokens(dp_server.async_openai(), dp_server.model_name()))
    assert all(len(tokens) > 0 for tokens in expected), expected
    assert got == expected
    # the requests ran on both ranks: each rank looked up prompts in its prefix cache
    assert dp_server.metrics()["fastdeploy:prefix_cache_queries_total"] > 0


def test_concurrent_requests_are_spread_over_both_ranks(dp_server):
    """Eight streams in flight at once: four on each rank (the per-rank gauges), then both idle."""
    model = dp_server.model_name()
    idle = dp_server.metrics()
    assert per_engine(idle, "num_requests_running") == [0, 0]

    async def run() -> dict[str, float]:
        client = dp_server.async_openai(timeout=120)
        streams = await asyncio.gather(
            *[
                client.completions.create(
                    model=model,
                    prompt=f"Request {i}: write a long story about the number {i}.",
                    max_tokens=96,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                for i in range(8)
            ]
        )
        iterators = [aiter(stream) for stream in streams]
        await asyncio.gather(*[anext(it) for it in iterators])  # every request has its first token
        during = await asyncio.to_thread(dp_server.metrics)
        await asyncio.gather(*[_drain(it) for it in iterators])
        return during

    during = asyncio.run(run())
    # none can have finished (96 tokens each): every one is running on the rank it was routed to
    assert per_engine(during, "num_requests_running") == [4, 4], during
    assert all(0 < usage < 1 for usage in per_engine(during, "kv_cache_usage_perc")), during

    deadline = time.monotonic() + 10
    while (after := dp_server.metrics()) and per_engine(after, "kv_cache_usage_perc") != [0, 0]:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert per_engine(after, "num_requests_running") == [0, 0]
    assert per_engine(after, "num_requests_waiting") == [0, 0]


async def _drain(iterator) -> None:
    async for _ in iterator:
        pass


def test_a_dead_engine_core_fails_health_and_sigterm_stops_everything(dp_server, dp_tmpdir):
    """Killing rank 1's engine core: /health 503, the stream on rank 0 ends with the error; SIGTERM cleans up."""
    cores = engine_cores(dp_server)
    assert len(cores) == 2, dp_server.descendants()
    assert all(len(core.children()) == 1 for core in cores)  # one worker each
    assert ipc_leftovers(dp_tmpdir), "the server keeps no sockets in TMPDIR: the check below is void"
    thread, result = start_long_stream(dp_server)  # alone, so on rank 0 (the lowest of equal ranks)
    assert result["started"].wait(60), "the stream did not start"
    assert result["error"] is None, result["error"]

    killed_at = time.monotonic()
    cores[1].send_signal(signal.SIGKILL)
    while httpx.get(dp_server.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed_at < HEALTH_503_S, "/health still 200 after an engine core died"
        time.sleep(0.05)
    thread.join(10)
    assert not thread.is_alive(), "the stream on the surviving rank hangs after the other rank died"
    assert isinstance(result["error"], openai.APIError), (result["error"], result["finish_reason"])
    assert result["error"].body["code"] == "engine_dead", result["error"].body
    with dp_server.http(timeout=5) as client:
        body = {"model": dp_server.model_name(), "prompt": "Hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 503
    assert cores[0].is_running()  # the server stays up (--no-exit-on-engine-death) ...

    code = dp_server.send_signal_and_wait(signal.SIGTERM)  # ... until SIGTERM; asserts no process is left
    assert code == 128 + signal.SIGTERM, dp_server.log()
    assert ipc_leftovers(dp_tmpdir) == []
    assert "Traceback" not in dp_server.log(tail=1_000_000)
