"""The default model's greedy float32 tokens under the active tensor backend equal the torch backend's.

``backend_reference_tokens.json`` holds the torch backend's tokens. Under torch (the main
CI job) this test checks the file against the live torch backend, so it cannot go stale;
under Paddle (``FD_BACKEND=paddle``, the Paddle CI job, where torch is not installed) the
same test checks Paddle against it: torch == file == Paddle. Regenerate the file with
``python tests/engine/test_backend_parity.py`` under torch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fastdeploy import SamplingParams
from fastdeploy.platforms.backend import active_backend

REFERENCE = Path(__file__).with_name("backend_reference_tokens.json")
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors of the rainbow, one per line, and explain why the sky is blue in one sentence.",
]
CHAT = [{"role": "user", "content": "What is 2+2?"}]
MAX_TOKENS = 12


def _generate() -> dict:
    from fastdeploy import LLM

    # a small token budget: the long prompt is prefilled in chunks beside the others' decodes
    llm = LLM(
        dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512, kv_cache_memory=0.05
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        batch = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        alone = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids  # again, from the prefix cache
        chat = llm.chat(CHAT, params)[0].outputs[0]
        return {"prompts": batch, "alone": alone, "chat": chat.token_ids, "chat_text": chat.text}
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def generated() -> dict:
    return _generate()


def test_backend_is_the_one_requested():
    expected = os.environ.get("FD_BACKEND", "auto")
    if expected in ("torch", "paddle"):
        assert active_backend() == expected


@pytest.mark.slow  # ~30 s under torch, ~70 s under Paddle on the 2-core CI machine
def test_greedy_tokens_equal_the_torch_backend(generated):
    reference = json.loads(REFERENCE.read_text())
    assert reference["max_tokens"] == MAX_TOKENS and reference["prompt_texts"] == PROMPTS
    assert generated["prompts"] == reference["prompts"]
    assert generated["alone"] == reference["prompts"][0]
    assert generated["chat"] == reference["chat"]
    assert generated["chat_text"] == reference["chat_text"]


if __name__ == "__main__":  # regenerate the reference under torch
    if active_backend() != "torch":
        sys.exit("regenerate the reference under the torch backend")
    data = _generate()
    REFERENCE.write_text(
        json.dumps(
            {
                "backend": "torch",
                "max_tokens": MAX_TOKENS,
                "prompt_texts": PROMPTS,
                "prompts": data["prompts"],
                "chat": data["chat"],
                "chat_text": data["chat_text"],
            },
            indent=1,
        )
        + "\n"
    )
