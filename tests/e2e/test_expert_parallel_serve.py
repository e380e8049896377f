"""Attention data-parallel + MoE expert-parallel through ``fastdeploy serve`` and the ``openai`` client.

``--data-parallel-size 2 --enable-expert-parallel`` on a tiny random Qwen3-MoE (8 experts, top-2):
two engine cores, each with its own worker, tokens and KV cache; each worker holds 4 experts and
the MoE layers gather both ranks' tokens. Greedy float32 tokens must equal ``transformers``' with
requests on both ranks at once and with one rank idle (its padding forwards keep the collectives
meeting), under chunked prefill and prefix caching, with and without async scheduling. Killing
one engine core fails ``/health`` (no hang), and SIGTERM stops everything.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from tests.e2e.conftest import RemoteServer
from tests.e2e.test_data_parallel import engine_cores
from tests.greedy_tokens import TOKEN_PROMPTS, transformers_greedy_tokens

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """A random tiny Qwen3-MoE checkpoint and transformers' greedy tokens for TOKEN_PROMPTS."""
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    torch.manual_seed(0)
    reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY)).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    reference.save_pretrained(folder)
    return folder, transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def dp_ep_server(request, tiny_moe, tmp_path_factory) -> Iterator[RemoteServer]:
    """The server, with each engine core's steps synchronous (the CPU default) and overlapped
    (the GPU default: step N+1 is scheduled and sent while step N runs)."""
    folder, _ = tiny_moe
    log = tmp_path_factory.mktemp("dp-ep") / "server.log"
    args = ["--model", str(folder), "--skip-tokenizer-init", "--max-model-len", "256",
            "--data-parallel-size", "2", "--enable-expert-parallel",
            "--block-size", "4", "--max-num-batched-tokens", "6", "--no-exit-on-engine-death",
            "--async-scheduling" if request.param else "--no-async-scheduling"]  # fmt: skip
    srv = RemoteServer(log, *args)
    try:
        yield srv
    finally:
        if srv.proc.poll() is None or not srv._log.closed:
            srv.stop(check=False)


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"return_token_ids": True}}


async def completions(srv: RemoteServer, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of every prompt, all requests in flight at once."""
    client = srv.async_openai(timeout=120)
    model = srv.model_name()
    responses = await asyncio.gather(
        *[client.completions.create(model=model, prompt=p, **GREEDY) for p in prompts]
    )
    return [r.choices[0].token_ids for r in responses]


def test_greedy_tokens_equal_transformers_on_both_ranks_and_with_one_idle(dp_ep_server, tiny_moe):
    _, expected = tiny_moe
    assert asyncio.run(completions(dp_ep_server, TOKEN_PROMPTS)) == expected  # both ranks at once
    for prompt, tokens in zip(TOKEN_PROMPTS, expected):  # one request: the other rank runs dummy steps
        assert asyncio.run(completions(dp_ep_server, [prompt])) == [tokens]
    assert asyncio.run(completions(dp_ep_server, TOKEN_PROMPTS)) == expected  # again: prefix-cache hits
    metrics = dp_ep_server.metrics()
    assert metrics["fastdeploy:prefix_cache_hits_total"] > 0
    for rank in (0, 1):  # tokens per EP rank, max / mean: between balanced (1) and all on one rank (2)
        assert 1.0 <= metrics[f"fastdeploy:moe_load_imbalance{{engine={rank}}}"] <= 2.0


def test_a_dead_engine_core_fails_health_and_sigterm_stops_all(dp_ep_server):
    cores = engine_cores(dp_ep_server)
    assert len(cores) == 2
    cores[1].kill()
    deadline = time.monotonic() + 10
    while httpx.get(dp_ep_server.url + "/health", timeout=2).status_code == 200:
        assert time.monotonic() < deadline, "health still 200 ten seconds after an engine core died"
        time.sleep(0.2)
    with pytest.raises(openai.APIError):
        asyncio.run(completions(dp_ep_server, TOKEN_PROMPTS[:1]))
    dp_ep_server.send_signal_and_wait(signal.SIGTERM)
