"""``fastdeploy serve --headless``: a host of a multi-host launch that runs only workers, no API server.

It waits for node 0 (``master_addr:master_port``, :data:`~fastdeploy.envs.FD_NODE_JOIN_TIMEOUT_S`),
checks that its engine options are node 0's, starts one worker process per world rank of this
node (``NodeLayout.local_ranks``), each connected over TCP to its engine core on node 0, and
waits: it exits 0 once node 0 has shut its workers down, 1 if a worker fails or node 0 goes
away (its workers then are stopped), 130 / 143 on SIGINT / SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from typing import Any

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.distributed.multinode import (
    CONFIG_KEY,
    MasterNotFoundError,
    NodeLayout,
    connect_store,
    master_reachable,
    node_error_key,
    node_layout,
    wait_for_master,
    worker_address_key,
)
from fastdeploy.engine.ipc import ChildProcess, decode
from fastdeploy.engine.multiproc_executor import (
    LOST_ENGINE_EXIT_CODE,
    WORKER_STOP_GRACE_S,
    WorkerPlace,
    worker_main,
)

logger = logging.getLogger(__name__)

NODE_LOCAL_FIELDS = frozenset({"node_rank", "data_parallel_rank", "data_parallel_init_method", "num_threads"})
"""Engine options that may differ between the nodes (every other one must equal node 0's)."""

MASTER_MISSES = 3
"""Consecutive failed probes of node 0 (one per health-check interval) after which it counts as gone."""


def config_differences(here: EngineConfig, master: dict[str, Any]) -> list[str]:
    """``--flag (node 0: X, here: Y)`` for every engine option of ``here`` that differs from node 0's
    (an option unset here, None, is node 0's as resolved there)."""
    diffs = []
    mine = dataclasses.asdict(here)
    for section, fields in mine.items():
        for key, value in fields.items():
            theirs = master.get(section, {}).get(key)
            if key not in NODE_LOCAL_FIELDS and value is not None and theirs != value:
                diffs.append(f"--{key.replace('_', '-')} (node 0: {theirs}, here: {value})")
    return diffs


def workers_config(here: EngineConfig, master: dict[str, Any]) -> EngineConfig:
    """The config this node's workers run: node 0's (its defaults resolved), with this node's node-local
    options."""
    flat = {key: value for fields in master.values() for key, value in fields.items()}
    config = EngineConfig.from_kwargs(**flat)
    for section in EngineConfig.SECTIONS:
        for key in NODE_LOCAL_FIELDS & {f.name for f in dataclasses.fields(getattr(config, section))}:
            setattr(getattr(config, section), key, getattr(getattr(here, section), key))
    return config


def _report(store: Any, node_rank: int, message: str) -> None:
    """Tell node 0 why this node gives up, so that its start fails with this line rather than a timeout."""
    with contextlib.suppress(RuntimeError):
        store.set(node_error_key(node_rank), message.encode())


def _fail(message: str, code: int) -> int:
    print(f"fastdeploy serve: error: {message}", file=sys.stderr)
    return code


def run_headless(config: EngineConfig) -> int:
    """Run this node's workers until node 0 stops them; returns the exit status."""
    layout = node_layout(config.parallel)
    assert layout is not None and layout.node_rank > 0
    logging.basicConfig(
        level=envs.FD_LOG_LEVEL, format=f"%(asctime)s %(levelname)s [node {layout.node_rank}] %(message)s"
    )
    timeout_s = envs.FD_NODE_JOIN_TIMEOUT_S
    logger.info("waiting for node 0 at %s:%d", layout.master_addr, layout.master_port)
    try:
        wait_for_master(layout, timeout_s)
        store = connect_store(layout, timeout_s)
        master_config = decode(store.get(CONFIG_KEY))
    except MasterNotFoundError as exc:
        return _fail(str(exc), 1)
    except RuntimeError as exc:  # torch.distributed's DistError: the store went away or did not answer
        return _fail(f"node 0 at {layout.master_addr}:{layout.master_port} did not answer: {exc}", 1)
    diffs = config_differences(config, master_config)
    if diffs:
        message = f"node {layout.node_rank}'s engine options differ from node 0's: " + "; ".join(diffs)
        _report(store, layout.node_rank, message)
        return _fail(message, 2)
    config = workers_config(config, master_config)
    from fastdeploy.engine.core import resolve_max_model_len
    from fastdeploy.model_executor.model_loader import resolve_model

    try:
        source = resolve_model(config.model)
        max_model_len = resolve_max_model_len(config, source)
    except (OSError, ValueError) as exc:
        message = f"node {layout.node_rank} cannot load the model: {exc}"
        _report(store, layout.node_rank, message)
        return _fail(message, 1)
    procs: list[ChildProcess] = []
    try:
        tp = config.parallel.tensor_parallel_size
        for world_rank in layout.local_ranks():
            address = store.get(worker_address_key(world_rank)).decode()
            parallel = dataclasses.replace(config.parallel, data_parallel_rank=world_rank // tp)
            place = WorkerPlace(world_rank % tp, None, address)
            procs.append(
                ChildProcess(
                    worker_main,
                    (dataclasses.replace(config, parallel=parallel), source, max_model_len, place),
                    name=f"fastdeploy-worker-{world_rank}",
                )
            )
        logger.info("started workers %s; engine cores on %s", list(layout.local_ranks()), layout.master_addr)
        return _watch(procs, layout)
    finally:
        for proc in procs:
            proc.stop(WORKER_STOP_GRACE_S)


def _watch(procs: list[ChildProcess], layout: NodeLayout) -> int:
    """Wait until every worker has left (0 when all left cleanly), or one failed or node 0 went away (1)."""
    misses = 0
    while True:
        codes = [proc.exitcode for proc in procs]
        if all(code == 0 for code in codes):
            logger.info("node 0 shut the workers down")
            return 0
        failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            index, code = failed[0]
            if code == LOST_ENGINE_EXIT_CODE:
                return _fail(
                    f"node 0's engine core went away (worker {layout.local_ranks()[index]} lost it)", 1
                )
            return _fail(f"worker {layout.local_ranks()[index]} exited (exit code {code})", 1)
        misses = 0 if master_reachable(layout) else misses + 1
        if misses >= MASTER_MISSES:
            return _fail(f"node 0 at {layout.master_addr}:{layout.master_port} went away", 1)
        time.sleep(envs.FD_HEALTH_CHECK_INTERVAL_S)
