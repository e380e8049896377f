"""A server with async scheduling (the overlapped runner across the worker process) answers
exactly like the default one."""

from __future__ import annotations


def test_async_scheduling_server_matches_the_default_server(server, server_factory, model_name):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    overlapped = server_factory("--async-scheduling")
    for prompt in prompts:
        body = {"model": model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        plain = server.openai().completions.create(**body)
        overlap = overlapped.openai().completions.create(**body)
        assert overlap.choices[0].text == plain.choices[0].text
        assert overlap.choices[0].finish_reason == plain.choices[0].finish_reason
        assert overlap.usage.completion_tokens == plain.usage.completion_tokens
    streamed = "".join(
        chunk.choices[0].text
        for chunk in overlapped.openai().completions.create(
            model=model_name, prompt=prompts[0], max_tokens=12, temperature=0, stream=True
        )
    )
    assert (
        streamed
        == server.openai()
        .completions.create(model=model_name, prompt=prompts[0], max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
