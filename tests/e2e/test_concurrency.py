"""32 concurrent streaming requests: all complete, each with the greedy output it gets when sent alone."""

from __future__ import annotations

import asyncio

NUM_REQUESTS = 32
MAX_TOKENS = 12

SUBJECTS = [
    "the moon", "a red bicycle", "the ocean", "coffee", "mountains", "a small cat", "winter", "the city of Rome",
    "volcanoes", "a library", "the piano", "rain", "a lighthouse", "honey bees", "the desert", "a train station",
]  # fmt: skip


def make_prompts() -> list[str]:
    """Distinct prompts of different lengths (some long enough to fill several KV blocks)."""
    prompts = []
    for i in range(NUM_REQUESTS):
        subject = SUBJECTS[i % len(SUBJECTS)]
        if i % 2 == 0:
            verb = "Write one sentence about" if i < len(SUBJECTS) else "Name a color that reminds you of"
            prompts.append(f"{verb} {subject}:")
        else:
            detail = " ".join(f"Fact {k}: {subject} is interesting." for k in range(i // 4 + 1))
            prompts.append(f"{detail} Question {i}: describe {subject} in a few words. Answer:")
    assert len(set(prompts)) == NUM_REQUESTS
    return prompts


async def stream_completion(client, model: str, prompt: str) -> tuple[str, str | None, int]:
    """Text, finish reason and completion tokens (from the usage chunk) of one streamed greedy request."""
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, tokens = "", None, -1
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish, tokens


def test_32_concurrent_streams_match_sequential(server, model_name):
    prompts = make_prompts()

    async def run() -> tuple[list, list, float]:
        client = server.async_openai(timeout=300)
        try:
            alone = [await stream_completion(client, model_name, p) for p in prompts]
            peak = 0.0

            async def watch_running() -> None:
                nonlocal peak
                while True:
                    m = await asyncio.to_thread(server.metrics)
                    peak = max(peak, m["fastdeploy:num_requests_running"])
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch_running())
            try:
                together = await asyncio.gather(*(stream_completion(client, model_name, p) for p in prompts))
            finally:
                watcher.cancel()
            return alone, list(together), peak
        finally:
            await client.close()

    alone, together, peak = asyncio.run(run())
    for prompt, (_text, finish, tokens) in zip(prompts, together):
        assert finish in ("stop", "length"), (prompt, finish)
        assert 0 < tokens <= MAX_TOKENS, (prompt, tokens)
    mismatches = [(p, a[0], t[0]) for p, a, t in zip(prompts, alone, together) if a != t]
    assert not mismatches, (
        f"{len(mismatches)} of {NUM_REQUESTS} differ (prompt, alone, concurrent): {mismatches}"
    )
    # the requests really ran as one batch (not one after the other)
    assert peak > 1, peak
    assert server.wait_idle()["fastdeploy:num_requests_running"] == 0
