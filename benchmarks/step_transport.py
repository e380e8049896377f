"""How a step's input reaches two workers: the multi-host design choice of docs/parallelism.md, measured.

Round trip of one step frame (msgpack bytes of the given size) from an "engine core" to two
"worker" processes and a small reply from each, three ways:

* ``ipc``: one ZMQ PAIR socket per worker over ``ipc://`` (one host, today's path);
* ``tcp``: the same over ``tcp://127.0.0.1`` (the multi-host path: the engine core sends to every
  rank directly);
* ``gloo``: the frame to rank 0 over ``ipc://``, which broadcasts its size and then its bytes to
  rank 1 over a CPU gloo group (the alternative that was not taken).

::

    python benchmarks/step_transport.py                 # sizes 512 B, 8 KiB, 128 KiB; 2000 steps each
    python benchmarks/step_transport.py --steps 200 --sizes 512   # quick

Loopback only: on two hosts each network hop adds the link's latency, once for ``tcp``
(the hops to the ranks run in parallel) and once more for ``gloo`` (IPC, then the broadcast).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch.multiprocessing as mp
import zmq


def _worker(rank: int, mode: str, address: str, init_method: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ctx = zmq.Context()
    socket = ctx.socket(zmq.PAIR)
    if mode != "gloo" or rank == 0:
        socket.connect(address)
    if mode == "gloo":
        dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=rank)
    for _ in range(steps):
        if mode != "gloo":
            socket.recv()
            socket.send(b"ok")
            continue
        if rank == 0:
            frame = socket.recv()
            size = torch.tensor([len(frame)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if rank == 0 else None
        if rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0)
        if rank == 0:
            dist.barrier()  # rank 1 has the frame: the step can start everywhere
            socket.send(b"ok")
        else:
            dist.barrier()
    if mode == "gloo":
        dist.destroy_process_group()
    socket.close(linger=0)
    ctx.term()


def measure(mode: str, size: int, steps: int) -> list[float]:
    """Microseconds per step round trip (send the frame, every reply back), ``steps`` times."""
    from fastdeploy.distributed import free_port_init_method

    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="fd-transport-")
    sockets, addresses = [], []
    for rank in range(2 if mode != "gloo" else 1):
        socket = ctx.socket(zmq.PAIR)
        if mode == "tcp":
            socket.bind("tcp://127.0.0.1:*")
        else:
            socket.bind(f"ipc://{os.path.join(tmp, f'w{rank}')}")
        sockets.append(socket)
        addresses.append(socket.getsockopt_string(zmq.LAST_ENDPOINT))
    init_method = free_port_init_method()
    procs = [
        mp.get_context("spawn").Process(
            target=_worker, args=(rank, mode, addresses[min(rank, len(addresses) - 1)], init_method, steps)
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    frame = os.urandom(size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        for socket in sockets:
            socket.send(frame)
        for socket in sockets:
            socket.recv()
        times.append((time.perf_counter() - start) * 1e6)
    for proc in procs:
        proc.join()
    for socket in sockets:
        socket.close(linger=0)
    ctx.term()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 8192, 131072])
    args = parser.parse_args()
    print("| frame | ipc (one host) µs | tcp direct (multi-host) µs | ipc + gloo broadcast µs |")
    print("| --- | --- | --- | --- |")
    for size in args.sizes:
        cells = []
        for mode in ("ipc", "tcp", "gloo"):
            times = measure(mode, size, args.steps)[args.steps // 10 :]  # drop the warm-up
            cells.append(f"{statistics.median(times):.0f} (p90 {statistics.quantiles(times, n=10)[-1]:.0f})")
        print(f"| {size} B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
