"""Multi-host flags: which node runs which worker, the errors for flags that disagree, the headless node's
wait for node 0, and the check of its options against node 0's."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from fastdeploy.config import EngineConfig, ParallelConfig
from fastdeploy.distributed.multinode import NodeLayout, NodeLayoutError, host_store, node_layout
from fastdeploy.engine.headless import config_differences, workers_config
from fastdeploy.entrypoints.cli.main import main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_node_r_runs_its_run_of_world_ranks():
    parallel = ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2, nnodes=2, node_rank=1, master_addr="10.0.0.1"
    )
    layout = node_layout(parallel)
    assert layout == NodeLayout(2, 1, "10.0.0.1", 29500, 4)
    assert list(layout.local_ranks()) == [2, 3]
    assert [layout.node_of(g) for g in range(4)] == [0, 0, 1, 1]
    assert [layout.local_index(g) for g in range(4)] == [0, 1, 0, 1]
    assert node_layout(ParallelConfig(tensor_parallel_size=2)) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "node_rank (2) must lie in [0, nnodes = 2)"),
        ({"nnodes": 0}, "nnodes (0) must be >= 1"),
        ({"nnodes": 4, "master_addr": "h"}, "2 workers cannot be split evenly over nnodes = 4"),
        ({"nnodes": 2}, "nnodes > 1 needs master_addr"),
        ({"nnodes": 2, "master_addr": "0.0.0.0"}, "master_addr '0.0.0.0': give node 0's address"),
        ({"nnodes": 2, "master_addr": "h", "master_port": 70000}, "master_port (70000)"),
    ],
)
def test_inconsistent_flags_are_named(fields, message):
    with pytest.raises(
        NodeLayoutError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        node_layout(ParallelConfig(tensor_parallel_size=2, **fields))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [
                "--tensor-parallel-size",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--headless",
            ],
            "node_rank (2) must lie in [0, nnodes = 2)",
        ),
        (
            ["--tensor-parallel-size", "3", "--nnodes", "2", "--master-addr", "127.0.0.1"],
            "3 workers cannot be split evenly over nnodes = 2",
        ),
        (["--tensor-parallel-size", "2", "--nnodes", "2"], "nnodes > 1 needs master_addr"),
        (
            [
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--tensor-parallel-size",
                "2",
            ],
            "argument --node-rank: node 1 runs no API server: add --headless",
        ),
        (["--headless"], "argument --headless: runs a node other than node 0"),
        (["--headless", "--node-rank", "1"], "argument --headless: runs a node other than node 0"),
    ],
)
def test_serve_refuses_inconsistent_flags_in_one_line(capsys, args, message):
    assert main(["serve", "--dtype", "float32", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_headless_node_gives_up_when_node_0_never_appears(capsys, monkeypatch):
    monkeypatch.setenv("FD_NODE_JOIN_TIMEOUT_S", "1")
    port = _free_port()  # nothing listens there
    args = ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--headless"]
    code = main(
        ["serve", "--dtype", "float32", *args, "--master-addr", "127.0.0.1", "--master-port", str(port)]
    )
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fastdeploy serve: error: node 0 did not appear at master_addr:master_port 127.0.0.1:{port} "
        "within 1 s (FD_NODE_JOIN_TIMEOUT_S)"
    )


def test_store_listens_on_the_given_address_only():
    layout = node_layout(
        ParallelConfig(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=_free_port())
    )
    store = host_store(layout)
    try:
        store.set("k", b"v")
        with socket.create_connection(("127.0.0.1", layout.master_port), timeout=2):
            pass
        addresses = [a for a in _local_ipv4_addresses() if not a.startswith("127.")]
        for address in addresses:  # another interface of this host: nothing listens there
            with pytest.raises(OSError), socket.create_connection((address, layout.master_port), timeout=2):
                pass
        with pytest.raises(OSError, match="cannot listen on master_addr:master_port"):
            host_store(layout)  # the port is taken
    finally:
        del store


def _local_ipv4_addresses() -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)})
    except OSError:
        return []


def test_headless_options_must_equal_node_0s():
    base = EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2, master_addr="h", dtype="float32")
    master = dataclasses.asdict(base)
    here = EngineConfig.from_kwargs(
        tensor_parallel_size=2, nnodes=2, master_addr="h", dtype="bfloat16", node_rank=1, num_threads=4
    )
    assert config_differences(here, master) == ["--dtype (node 0: float32, here: bfloat16)"]
    same = EngineConfig.from_kwargs(
        tensor_parallel_size=2, nnodes=2, master_addr="h", dtype="float32", node_rank=1
    )
    assert config_differences(same, master) == []
    unset = EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2, master_addr="h", dtype="float32")
    resolved = dataclasses.asdict(base)
    resolved["scheduler"]["max_num_batched_tokens"] = 8192  # node 0 resolved its default
    assert config_differences(unset, resolved) == []  # left unset here: node 0's value holds


def test_headless_workers_run_node_0s_resolved_config():
    master = dataclasses.asdict(EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2, master_addr="h"))
    master["scheduler"]["max_num_batched_tokens"] = 8192
    here = EngineConfig.from_kwargs(
        tensor_parallel_size=2, nnodes=2, master_addr="h", node_rank=1, num_threads=3
    )
    config = workers_config(here, master)
    assert config.scheduler.max_num_batched_tokens == 8192
    assert (config.parallel.node_rank, config.device.num_threads) == (1, 3)
