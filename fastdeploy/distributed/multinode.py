"""Workers spread over several hosts: which node runs which worker rank, and where the nodes meet.

With ``--nnodes N`` the ``tensor_parallel_size x data_parallel_size`` workers form one
``torch.distributed`` world (world rank ``dp_rank * tp + tp_rank``; with several replicas each
one's ranks are a TP subgroup), cut into N equal runs of ranks: node r runs world ranks
``[r * local, (r + 1) * local)`` on its local GPUs ``0 .. local - 1``. Node 0 (the API server,
the engine cores and their local workers) hosts a ``torch.distributed`` TCP store on
``master_addr:master_port``, bound to that address only; every worker meets the others through
it, and the engine cores publish there the ``tcp://`` ZMQ address on which each remote worker
receives its steps. Only byte strings (msgpack) go through the store: nothing is unpickled.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from fastdeploy.config import ParallelConfig

CONFIG_KEY = "fastdeploy/engine-config"
"""Store key of node 0's engine config (msgpack of its fields), which headless nodes compare with theirs."""
WORLD_PREFIX = "fastdeploy/world/"
"""Store prefix under which the workers' process group meets."""


class NodeLayoutError(ValueError):
    """The multi-host flags are inconsistent (node rank, node count, master address)."""


class MasterNotFoundError(RuntimeError):
    """Node 0 did not appear at ``master_addr:master_port`` in time."""


@dataclass(frozen=True)
class NodeLayout:
    """The hosts of a multi-host launch and this one's place among them."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    world_size: int
    """All workers: tensor_parallel_size x data_parallel_size."""

    @property
    def local_size(self) -> int:
        """Workers per node."""
        return self.world_size // self.nnodes

    def node_of(self, world_rank: int) -> int:
        """The node that runs worker ``world_rank``."""
        return world_rank // self.local_size

    def local_ranks(self) -> range:
        """The world ranks this node runs."""
        return range(self.node_rank * self.local_size, (self.node_rank + 1) * self.local_size)

    def local_index(self, world_rank: int) -> int:
        """The local GPU index of worker ``world_rank`` on its node."""
        return world_rank % self.local_size


def node_layout(parallel: ParallelConfig) -> NodeLayout | None:
    """The layout of a multi-host launch (None with one node); :class:`NodeLayoutError` if inconsistent."""
    check_node_flags(parallel)
    if parallel.nnodes == 1:
        return None
    world = parallel.tensor_parallel_size * parallel.data_parallel_size
    assert parallel.master_addr is not None
    return NodeLayout(parallel.nnodes, parallel.node_rank, parallel.master_addr, parallel.master_port, world)


def check_node_flags(parallel: ParallelConfig) -> None:
    """Raise :class:`NodeLayoutError` naming the flag unless ``--nnodes`` and its companions agree."""
    nnodes, node_rank = parallel.nnodes, parallel.node_rank
    if nnodes < 1:
        raise NodeLayoutError(f"nnodes ({nnodes}) must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise NodeLayoutError(f"node_rank ({node_rank}) must lie in [0, nnodes = {nnodes})")
    if nnodes == 1:
        return
    world = parallel.tensor_parallel_size * parallel.data_parallel_size
    if world % nnodes:
        raise NodeLayoutError(
            f"tensor_parallel_size x data_parallel_size = {world} workers cannot be split evenly over "
            f"nnodes = {nnodes} hosts"
        )
    if not parallel.master_addr:
        raise NodeLayoutError("nnodes > 1 needs master_addr: the address of node 0 that every node can reach")
    if parallel.master_addr in ("0.0.0.0", "::", "*"):
        raise NodeLayoutError(
            f"master_addr {parallel.master_addr!r}: give node 0's address that the other nodes reach (node 0 "
            "listens on that address only)"
        )
    if not 0 < parallel.master_port < 65536:
        raise NodeLayoutError(f"master_port ({parallel.master_port}) must lie in [1, 65535]")


def resolve_ip(host: str) -> str:
    """``host``'s IPv4 address (an IP is returned as is); ZMQ and the store bind to it."""
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise NodeLayoutError(f"master_addr {host!r} does not resolve: {exc}") from None


def host_store(layout: NodeLayout) -> dist.TCPStore:
    """Node 0's store, listening on ``master_addr:master_port`` only (not every interface)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((resolve_ip(layout.master_addr), layout.master_port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise OSError(
            exc.errno,
            f"cannot listen on master_addr:master_port {layout.master_addr}:{layout.master_port}: "
            f"{exc.strerror}",
        ) from None
    return dist.TCPStore(
        layout.master_addr,
        layout.master_port,
        None,
        True,
        datetime.timedelta(seconds=60),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from now on
    )


def master_reachable(layout: NodeLayout, timeout_s: float = 1.0) -> bool:
    """Whether something listens on ``master_addr:master_port`` (a plain TCP connect, closed at once)."""
    try:
        with socket.create_connection((layout.master_addr, layout.master_port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_master(layout: NodeLayout, timeout_s: float) -> None:
    """Return once node 0 listens; :class:`MasterNotFoundError` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not master_reachable(layout):
        if time.monotonic() > deadline:
            raise MasterNotFoundError(
                f"node 0 did not appear at master_addr:master_port {layout.master_addr}:{layout.master_port} "
                f"within {timeout_s:.0f} s (FD_NODE_JOIN_TIMEOUT_S)"
            )
        time.sleep(0.2)


def connect_store(layout: NodeLayout, timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store; its ``get`` waits up to ``timeout_s`` seconds for a key."""
    return dist.TCPStore(
        layout.master_addr, layout.master_port, None, False, datetime.timedelta(seconds=timeout_s)
    )


def world_store(layout: NodeLayout, timeout_s: float) -> dist.Store:
    """Where the workers' process group meets: node 0's store, under :data:`WORLD_PREFIX`."""
    return dist.PrefixStore(WORLD_PREFIX, connect_store(layout, timeout_s))


def worker_address_key(world_rank: int) -> str:
    """Store key of the ``tcp://`` address on which remote worker ``world_rank`` receives its steps."""
    return f"fastdeploy/worker-address/{world_rank}"


def node_error_key(node_rank: int) -> str:
    """Store key of the line with which a headless node gave up (node 0's start then fails with it)."""
    return f"fastdeploy/node-error/{node_rank}"
