"""Two "hosts" on 127.0.0.1: ``serve --nnodes 2 --node-rank 0 --tensor-parallel-size 2`` (API server, engine
core, worker 0) and ``serve --nnodes 2 --node-rank 1 --headless`` (worker 1, which gets its steps over TCP
and meets worker 0 in node 0's store): the same greedy tokens as one worker; a headless node whose options
differ is refused; a dead remote worker fails the engine (no hang) and both nodes exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.conftest import API_KEY, SERVER_ARGS, RemoteServer, free_port
from tests.e2e.test_tensor_parallel_serve import greedy_chat, greedy_completions

pytestmark = pytest.mark.slow


def _headless(log_path, *args: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.cli.main",
        "serve",
        *SERVER_ARGS,
        *args,
        "--headless",
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodes")
    node_args = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    node_args += ["--master-port", str(free_port())]
    node0 = RemoteServer(tmp / "node0.log", *node_args, api_key=API_KEY, wait=False)
    node1 = _headless(tmp / "node1.log", *node_args, "--node-rank", "1")
    try:
        node0.wait_healthy()
        yield node0, node1, node_args, tmp
    finally:
        node0.stop(check=False)
        try:
            node1.wait(15)
        except subprocess.TimeoutExpired:
            node1.kill()
            node1.wait()


def test_two_nodes_greedy_tokens_equal_tp1(server, two_nodes, model_name):
    node0, node1, _, _ = two_nodes
    assert len(node0.engine_core().children()) == 1  # worker 0 here, worker 1 under the headless node
    assert len(psutil.Process(node1.pid).children()) == 1
    assert greedy_completions(node0, model_name) == greedy_completions(server, model_name)
    assert greedy_chat(node0, model_name) == greedy_chat(server, model_name)


def test_headless_node_with_other_options_is_refused(two_nodes):
    _, _, node_args, tmp = two_nodes
    proc = _headless(tmp / "bad.log", *node_args, "--node-rank", "1", "--max-num-seqs", "7")
    assert proc.wait(60) == 2
    err = (tmp / "bad.log").read_text().strip().splitlines()
    assert err[-1] == (
        "fastdeploy serve: error: node 1's engine options differ from node 0's: "
        "--max-num-seqs (node 0: 256, here: 7)"
    )


def test_dead_remote_worker_fails_the_engine(two_nodes, model_name):
    node0, node1, _, _ = two_nodes
    psutil.Process(node1.pid).children()[0].kill()
    start = time.monotonic()
    assert node0.wait_exit(30) == 1  # the engine core saw the connection drop: engine dead, server exits
    assert time.monotonic() - start < 15
    assert "lost the connection to the worker of rank 1 on node 1" in node0.log(20000)
    assert node1.wait(15) == 1  # the headless node noticed its worker's death (and node 0's)
