"""Engine requests are sent when the handler starts them, before any response; a response that never
runs its body still aborts them (``SSEResponse(on_close=...)``), and one that runs streams their outputs."""

from __future__ import annotations

import asyncio

from fastdeploy.core.outputs import CompletionOutput, RequestOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.event_streams import SSEResponse
from fastdeploy.entrypoints.openai.serving_engine import EnginePrompt, StartedRequests


class RecordingEngine:
    """An engine client whose ``generate`` records the send at the call, as ``AsyncLLM``'s does."""

    def __init__(self):
        self.sent: list[str] = []
        self.aborted: list[str] = []

    def generate(self, prompt_token_ids, sampling_params, request_id, prompt=None, **kwargs):
        self.sent.append(request_id)

        async def outputs():
            yield RequestOutput(
                request_id, prompt, prompt_token_ids, [CompletionOutput(0, "hi", [7], "stop")], True
            )

        return outputs()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def prompts(count: int) -> list[EnginePrompt]:
    return [EnginePrompt(token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1)) for _ in range(count)]


def test_requests_are_sent_at_start_and_aborted_when_the_response_never_runs():
    engine = RecordingEngine()

    async def run() -> None:
        started = StartedRequests(engine, ["a", "b"], prompts(2), None)
        started.send(prompts(2))
        assert engine.sent == ["a", "b"]  # before anything iterates

        async def body():
            async for _, out in started.outputs():
                yield out.outputs[0].text

        response = SSEResponse(body(), on_close=started.close)

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("the client is gone")  # the response dies before its first byte

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
        try:
            await response(scope, receive, send)
        except Exception:
            pass
        assert engine.aborted == ["a", "b"]
        await started.close()  # idempotent
        assert engine.aborted == ["a", "b"]

    asyncio.run(run())


def test_outputs_stream_and_finished_requests_are_not_aborted():
    engine = RecordingEngine()

    async def run() -> list[str]:
        started = StartedRequests(engine, ["a", "b"], prompts(2), None)
        started.send(prompts(2))
        texts = [out.outputs[0].text async for _, out in started.outputs()]
        assert started.tracker.completion_tokens == 2
        return texts

    assert asyncio.run(run()) == ["hi", "hi"]
    assert engine.aborted == []
