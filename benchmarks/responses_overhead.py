"""``/v1/responses`` against ``/v1/chat/completions`` on the same work: N requests at once, each the
same chat with a fixed output length (``ignore_eos``), whole and streamed, through a server this
script starts (the default model unless ``--model``). Prints output tokens/s per endpoint and mode,
and the ratio responses / chat (the cost of the translation, the events and the store).

    python benchmarks/responses_overhead.py --num-requests 64 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
from server_health import free_port, wait_healthy


async def _one(client: httpx.AsyncClient, endpoint: str, stream: bool, prompt: str, out_len: int) -> None:
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": out_len}
    else:
        path = "/v1/responses"
        body = {"input": prompt, "max_output_tokens": out_len, "store": True}
    body.update({"temperature": 0, "ignore_eos": True, "stream": stream})
    if not stream:
        response = await client.post(path, json=body)
        response.raise_for_status()
        return
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def _run(url: str, endpoint: str, stream: bool, n: int, out_len: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=n)) as client:
        started = time.perf_counter()
        await asyncio.gather(
            *[_one(client, endpoint, stream, f"Tell me story number {i}.", out_len) for i in range(n)]
        )
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is kept")
    parser.add_argument("serve_args", nargs="*", help="extra arguments for fastdeploy serve (after --)")
    args = parser.parse_args()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "fastdeploy.entrypoints.cli.main",
        "serve",
        "--port",
        str(port),
        *args.serve_args,
    ]
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout_s=600)
        asyncio.run(_run(url, "chat", False, 4, 4))  # warm up
        best: dict[tuple[str, bool], float] = {}
        for _ in range(args.rounds):
            for stream in (False, True):
                for endpoint in ("chat", "responses"):
                    elapsed = asyncio.run(_run(url, endpoint, stream, args.num_requests, args.output_len))
                    key = (endpoint, stream)
                    best[key] = min(best.get(key, elapsed), elapsed)
        tokens = args.num_requests * args.output_len
        print("| mode | chat tok/s | responses tok/s | responses / chat |")
        print("| --- | ---: | ---: | ---: |")
        for stream in (False, True):
            chat, responses = tokens / best[("chat", stream)], tokens / best[("responses", stream)]
            print(
                f"| {'streamed' if stream else 'whole'} | {chat:,.0f} | {responses:,.0f} | {responses / chat:.3f} |"
            )
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
