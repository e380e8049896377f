"""``/v1/responses`` without a server: the request's translation to a chat request (input items,
tools, ``text.format``, errors naming the Responses field), the response store, and the output
items and stream events built from an answer's pieces."""

from __future__ import annotations

import json
import os

import pytest

from fastdeploy.core.outputs import CompletionOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.entrypoints.openai.chat_choices import ChatOptions
from fastdeploy.entrypoints.openai.errors import BadRequestError, NotFoundError
from fastdeploy.entrypoints.openai.protocol import parse_request
from fastdeploy.entrypoints.openai.protocol.responses import (
    ResponsesRequest,
    input_items,
    new_id,
    responses_error,
)
from fastdeploy.entrypoints.openai.protocol.responses_objects import ResponseObject, output_messages
from fastdeploy.entrypoints.openai.reasoning import get_reasoning_parser
from fastdeploy.entrypoints.openai.responses_output import ResponseOutput
from fastdeploy.entrypoints.openai.responses_store import ResponseStore, StoredResponse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(**body) -> ResponsesRequest:
    return parse_request(ResponsesRequest, {"model": "m", **body}, strict_fields=True)


def bad_request(param: str, **body) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        request(**body).to_chat_request([])
    assert info.value.param == param, (info.value.param, info.value.message)
    return info.value


def test_text_input_and_instructions_become_system_then_user_messages():
    chat = request(
        input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5
    ).to_chat_request([])
    assert chat.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    params = chat.to_sampling_params()
    assert params.max_tokens == 7 and params.temperature == 0.5


def test_history_sits_between_instructions_and_input():
    history = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    chat = request(input="C", instructions="I").to_chat_request(history)
    assert [(m["role"], m["content"]) for m in chat.template_messages()] == [
        ("system", "I"), ("user", "A"), ("assistant", "B"), ("user", "C"),
    ]  # fmt: skip


def test_input_items_calls_and_outputs_become_an_assistant_turn_and_tool_messages():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ]  # fmt: skip
    messages = request(input=items).to_chat_request([]).template_messages()
    assert messages[0] == {"role": "system", "content": "Use tools."}
    assert messages[1] == {"role": "user", "content": "Weather in Rome?"}
    assert messages[2]["role"] == "assistant" and messages[2]["content"] == "Checking."
    assert [(c["id"], c["function"]["arguments"]) for c in messages[2]["tool_calls"]] == [
        ("call_1", {"city": "Rome"}), ("call_2", {"city": "Paris"}),
    ]  # fmt: skip
    assert messages[3:] == [
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
    ]


def test_tools_tool_choice_and_text_format_become_the_chat_fields():
    tool = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER}
    chat = request(
        input="x",
        tools=[tool, {"type": "function", "name": "other"}],
        tool_choice={"type": "function", "name": "get_weather"},
    ).to_chat_request([])
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER
    assert chat.tool_choice_mode().mode == "named" and chat.tool_choice_mode().function == "get_weather"
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "other"}]}
    chat = request(
        input="x", tools=[tool, {"type": "function", "name": "other"}], tool_choice=allowed
    ).to_chat_request([])
    assert [t.function.name for t in chat.tools] == ["other"] and chat.tool_choice_mode().mode == "required"
    chat = request(
        input="x", text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}
    ).to_chat_request([])
    assert chat.structured_output_params().json == WEATHER
    chat = request(input="x", text={"format": {"type": "json_object"}}).to_chat_request([])
    assert chat.structured_output_params().json_object
    assert (
        request(input="x", text={"format": {"type": "text"}}).to_chat_request([]).structured_output_params()
        is None
    )


@pytest.mark.parametrize("tools", [None, []])
def test_tool_choice_auto_without_tools_is_a_plain_answer(tools):
    # OpenAI's Responses default, which clients send with no tools (the OpenAI Agents SDK with a
    # run-wide tool_choice and an agent without tools)
    for choice in ("auto", "none"):
        chat = request(input="x", tools=tools, tool_choice=choice).to_chat_request([])
        assert chat.tools is None and chat.tool_choice_mode().mode == "none"
    for choice in ("required", {"type": "function", "name": "f"}):
        with pytest.raises(BadRequestError) as info:
            request(input="x", tools=tools, tool_choice=choice).to_chat_request([]).tool_choice_mode()
        assert info.value.param.startswith("tool_choice")


def test_logprobs_are_asked_by_include_or_top_logprobs():
    assert request(input="x").to_chat_request([]).to_sampling_params().logprobs is None
    chat = request(input="x", include=["message.output_text.logprobs"]).to_chat_request([])
    assert chat.to_sampling_params().logprobs == 0
    assert request(input="x", top_logprobs=3).to_chat_request([]).to_sampling_params().logprobs == 3


def test_errors_name_the_responses_field():
    bad_request("input", instructions="only")
    bad_request("input", input=[])
    bad_request("input[0].type", input=[{"type": "computer_call_output", "call_id": "c"}])
    bad_request("input[0].role", input=[{"role": "tool", "content": "x"}])
    err = bad_request(
        "input[0].content[0]",
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
    )
    assert "image_feature_url" in err.message
    bad_request("input[0].call_id", input=[{"type": "function_call_output", "output": "x"}])
    bad_request("tools[0].type", input="x", tools=[{"type": "web_search"}])
    bad_request(
        "tool_choice",
        input="x",
        tools=[{"type": "function", "name": "f"}],
        tool_choice={"type": "file_search"},
    )
    bad_request("text.format.type", input="x", text={"format": {"type": "xml"}})
    bad_request("background", input="x", background=True, store=False)
    bad_request("stream", input="x", background=True, stream=True)
    bad_request("conversation", input="x", conversation="conv_1")
    bad_request("prompt", input="x", prompt={"id": "pmpt_1"})
    bad_request("top_logprobs", input="x", top_logprobs=-2)
    # (an unknown include value was once accepted; OpenAI answers it with a 400)
    err = bad_request("include[1]", input="x", include=["message.output_text.logprobs", "bogus"])
    assert "'bogus'" in err.message and err.code == "invalid_value"
    bad_request("top_k", input="x", top_k=2**70)
    bad_request("input[0].content", input=[{"role": "user", "content": None}])
    err = bad_request("tools[0].name", input="x", tools=[{"type": "function", "name": "bad name"}])
    assert "tools[0].name" in err.message or "1 to 64" in err.message


def test_chat_side_errors_are_renamed():
    cases = {
        "response_format.json_schema.schema": "text.format.schema",
        "response_format": "text.format",
        "max_completion_tokens": "max_output_tokens",
        "messages": "input",
        "tools[2].function.parameters": "tools[2].parameters",
        "tool_choice.function.name": "tool_choice.name",
        "temperature": "temperature",
    }
    for chat_param, expected in cases.items():
        err = responses_error(BadRequestError(f"'{chat_param}' is wrong", param=chat_param, code="c"))
        assert err.param == expected and err.message == f"'{expected}' is wrong" and err.code == "c"


def test_ignored_fields_are_accepted():
    chat = request(
        input="x", user="u", store=False, metadata={"k": "v"}, truncation="auto", service_tier="auto",
        reasoning={"effort": "low"}, include=["reasoning.encrypted_content"], max_tool_calls=2,
        safety_identifier="s", prompt_cache_key="p", text={"verbosity": "low"},
    ).to_chat_request([])  # fmt: skip
    assert chat.template_messages() == [{"role": "user", "content": "x"}]


def test_output_messages_and_input_items():
    output = [
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {"type": "message", "id": "msg_1", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_9", "name": "f", "arguments": "{}"},
    ]
    assert output_messages(output) == [
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        }
    ]
    assert output_messages([]) == [{"role": "assistant", "content": ""}]
    (item,) = input_items(request(input="Hi"))
    assert item["type"] == "message" and item["content"] == [{"type": "input_text", "text": "Hi"}]
    assert item["id"].startswith("msg_")


# --------------------------------------------------------------------------- store


def stored(text: str, previous: str | None = None) -> StoredResponse:
    return StoredResponse(
        response={"id": "x", "text": text},
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}],
        previous_response_id=previous,
    )


def test_store_chains_conversations_and_forgets(tmp_path):
    store = ResponseStore(str(tmp_path), max_bytes=1 << 20)
    a, b = new_id("resp"), new_id("resp")
    store.save(a, stored("one"))
    store.save(b, stored("two", previous=a))
    assert [m["content"] for m in store.conversation(b)] == ["one", "ONE", "two", "TWO"]
    assert store.load(b).response == {"id": "x", "text": "two"}
    assert ResponseStore(str(tmp_path)).load(a) is not None  # another process sees it
    assert store.delete(a) and not store.delete(a)
    assert store.conversation(b) is None  # a broken chain is not half a conversation
    for bad in ("../etc/passwd", "resp_" + "g" * 32, "resp_1", ""):
        assert store.load(bad) is None and not store.delete(bad)
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_store_drops_its_oldest_past_its_bound(tmp_path):
    size = len(json.dumps({"response": {"id": "x", "text": "r00"}}))
    store = ResponseStore(str(tmp_path), max_bytes=12 * size)
    ids = [new_id("resp") for _ in range(20)]
    for i, rid in enumerate(ids):
        store.save(rid, stored(f"r{i:02d}"))
    kept = [rid for rid in ids if store.load(rid) is not None]
    assert 1 <= len(kept) < 20 and kept == ids[-len(kept) :]
    assert sum(os.path.getsize(tmp_path / f"{rid}.json") for rid in kept) <= store.max_bytes
    off = ResponseStore(str(tmp_path / "off"), max_bytes=0)
    off.save(ids[0], stored("x"))
    assert not off.enabled and off.load(ids[0]) is None


def test_private_store_directory_is_removed_on_close():
    store = ResponseStore(max_bytes=1 << 20)
    rid = new_id("resp")
    store.save(rid, stored("x"))
    directory = store.directory
    assert directory and os.path.isdir(directory) and store.load(rid) is not None
    store.close()
    assert not os.path.exists(directory)


# --------------------------------------------------------------------------- output items and events


def pieces(texts: list[str], finish: str = "stop") -> list[CompletionOutput]:
    return [
        CompletionOutput(
            index=0, text=t, token_ids=[i], finish_reason=finish if i == len(texts) - 1 else None
        )
        for i, t in enumerate(texts)
    ]


def run(output: ResponseOutput, outs: list[CompletionOutput]) -> list[dict]:
    events = [e for c in outs for e in output.feed(c)]
    return events + output.finish()


def check_events(events: list[dict], items: list[dict]) -> None:
    """Every item added is finished once, in order, with the same id; deltas add up to the final text."""
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert added == [i["id"] for i in done] and done == items
    for item in items:
        deltas = "".join(
            e["delta"] for e in events if e.get("item_id") == item["id"] and e["type"].endswith(".delta")
        )
        text = {
            "message": lambda i: i["content"][0]["text"],
            "reasoning": lambda i: i["content"][0]["text"],
        }.get(item["type"], lambda i: i["arguments"])(item)
        assert deltas == text


def test_text_answer_is_one_message_item():
    output = ResponseOutput(ChatOptions(), None)
    events = run(output, pieces(["Hel", "lo", "!"]))
    (item,) = output.items
    assert item["type"] == "message" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello!", "annotations": []}]
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    check_events(events, output.items)
    assert output.finish_reason == "stop"


def test_cut_answer_is_incomplete_and_empty_answer_is_an_empty_message():
    output = ResponseOutput(ChatOptions(), None)
    run(output, pieces(["a", "b"], finish="length"))
    assert output.items[0]["status"] == "incomplete" and output.finish_reason == "length"
    output = ResponseOutput(ChatOptions(), None)
    events = run(output, pieces([""]))
    assert output.items == [
        {"type": "message", "id": output.items[0]["id"], "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "", "annotations": []}]},
    ]  # fmt: skip
    check_events(events, output.items)


def test_reasoning_then_answer_are_two_items():
    parser = get_reasoning_parser("qwen3")("<|im_start|>assistant\n", None)
    output = ResponseOutput(ChatOptions(reasoning=parser), None)
    events = run(output, pieces(["<think>", "Let me", " think", "</th", "ink>", "\n\nIt is", " 4."]))
    reasoning, message = output.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "Let me think"}
    ]
    assert message["content"][0]["text"] == "It is 4."
    assert output.reasoning_tokens >= 2
    check_events(events, output.items)
    types = [e["type"] for e in events]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")


def test_tool_calls_are_function_call_items():
    from fastdeploy.entrypoints.openai.tool_calling import ToolPlan
    from fastdeploy.entrypoints.openai.tool_parsers import get_tool_parser

    plan = ToolPlan(parser=get_tool_parser("hermes")())
    output = ResponseOutput(ChatOptions(tools=plan), None)
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    events = run(output, pieces([text[i : i + 7] for i in range(0, len(text), 7)]))
    calls = [i for i in output.items if i["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in calls)
    assert output.finish_reason == "tool_calls"
    check_events(events, output.items)


def test_cancel_markers(tmp_path):
    store = ResponseStore(str(tmp_path), max_bytes=1 << 20)
    rid = new_id("resp")
    store.save(rid, stored("x"))
    store.save(rid, stored("xy"))  # saved again as a background response progresses: counted once
    assert store._bytes == os.path.getsize(tmp_path / f"{rid}.json")
    assert not store.cancel_requested(rid)
    store.request_cancel(rid)
    assert ResponseStore(str(tmp_path)).cancel_requested(rid)  # seen by the process running it
    store.clear_cancel(rid)
    assert not store.cancel_requested(rid)
    store.request_cancel(rid)
    assert store.delete(rid) and not store.cancel_requested(rid) and store._bytes == 0
    store.request_cancel("../x")  # not an id: nothing written
    assert sorted(os.listdir(tmp_path)) == []


def test_an_unwritable_store_keeps_nothing_and_raises_nothing(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store = ResponseStore(str(blocked / "responses"), max_bytes=1 << 20)
    rid = new_id("resp")
    assert store.save(rid, stored("x")) is False
    assert store.load(rid) is None and not store.delete(rid) and store.conversation(rid) is None


def test_a_cancel_reaches_the_process_running_the_background_response(tmp_path):
    """Two API server processes share the store: B's cancel, with no task of its own, leaves the
    marker; A's watcher cancels its run, which stores the response as cancelled; B returns that."""
    import asyncio

    from fastdeploy.entrypoints.openai.serving_responses import OpenAIServingResponses

    rid = new_id("resp")
    running = {"id": rid, "background": True, "status": "in_progress"}
    a = OpenAIServingResponses(None, ResponseStore(str(tmp_path), max_bytes=1 << 20))
    b = OpenAIServingResponses(None, ResponseStore(str(tmp_path), max_bytes=1 << 20))
    a.CANCEL_POLL_S = b.CANCEL_POLL_S = 0.01

    async def scenario() -> dict:
        a.store.save(rid, StoredResponse(response=running, messages=[]))

        async def run() -> None:  # stands for A's _run_background
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                a.store.save(rid, StoredResponse(response={**running, "status": "cancelled"}, messages=[]))
                raise

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(a._watch_cancel(rid, task))
        result = await asyncio.wait_for(b.cancel(rid), timeout=10)
        await asyncio.wait({task, watcher})
        assert task.cancelled()
        return result

    assert asyncio.run(scenario())["status"] == "cancelled"
    assert a.store.load(rid).response["status"] == "cancelled"


def test_feature_parts_pass_through_to_the_chat_message():
    part = {"type": "image_feature_url", "image_feature_url": {"url": "file:///x.npy", "grid_thw": [1, 2, 2]}}
    content = [{"type": "input_text", "text": "What is this?"}, part]
    (message,) = request(input=[{"role": "user", "content": content}]).to_chat_request([]).messages
    assert message.content == [{"type": "text", "text": "What is this?"}, part]


def test_a_stream_that_fails_ends_with_error_and_response_failed(tmp_path):
    """The engine dying mid-stream: the events so far, then ``error`` and ``response.failed`` carrying
    the output made so far (nothing stored as completed)."""
    import asyncio
    from types import SimpleNamespace

    from fastdeploy.engine.protocol import EngineDeadError
    from fastdeploy.entrypoints.openai.serving_engine import UsageTracker
    from fastdeploy.entrypoints.openai.serving_responses import OpenAIServingResponses, _Run

    async def outputs():
        yield 0, SimpleNamespace(outputs=[CompletionOutput(index=0, text="Hel", token_ids=[1])])
        raise EngineDeadError("the engine core exited")

    started = SimpleNamespace(outputs=outputs, tracker=UsageTracker(["r"], []))
    handler = OpenAIServingResponses(None, ResponseStore(str(tmp_path), max_bytes=1 << 20))
    req = request(input="Hi")
    base = ResponseObject.of(new_id("resp"), "m", req, SamplingParams())

    async def collect() -> list[dict]:
        run = _Run(req, base, started, ResponseOutput(ChatOptions(), None), input_items(req))
        chunks = [c async for c in handler._stream(run)]
        return [json.loads(c.split("data: ", 1)[1]) for c in chunks]

    events = asyncio.run(collect())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    error, failed = events[-2:]
    assert error["type"] == "error" and "engine" in error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "engine_dead"
    (item,) = failed["response"]["output"]  # the message so far, closed as incomplete
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Hel"
    assert events[-3]["type"] == "response.output_item.done" and events[-3]["item"] == item
    assert handler.store.load(base.id) is None


def test_unknown_ids_are_404s_in_openai_words(tmp_path):
    """Retrieve, delete, cancel and input_items of an unknown id: OpenAI's (and vLLM's) sentence,
    full stop included, which vLLM's suite matches ("Response with id .* not found."); an unknown
    ``previous_response_id`` carries OpenAI's code ``previous_response_not_found``."""
    import asyncio
    import re

    from fastdeploy.entrypoints.openai.serving_responses import OpenAIServingResponses

    handler = OpenAIServingResponses(None, ResponseStore(str(tmp_path), max_bytes=1 << 20))
    rid = new_id("resp")
    for call in (handler.retrieve, handler.delete, handler.cancel, handler.list_input_items):
        with pytest.raises(NotFoundError) as info:
            asyncio.run(call(rid))
        assert info.value.message == f"Response with id '{rid}' not found."
        assert re.search("Response with id .* not found.", info.value.message)
        assert info.value.param == "response_id"
    with pytest.raises(NotFoundError) as info:
        asyncio.run(handler.create_response(request(input="Hi", previous_response_id=rid), None))
    assert info.value.message == f"Previous response with id '{rid}' not found."
    assert (info.value.param, info.value.code) == ("previous_response_id", "previous_response_not_found")


def test_the_response_reports_the_sampling_it_runs_with():
    """``temperature`` and ``top_p`` are the values sampled with, defaults included (never null)."""
    base = ResponseObject.of(new_id("resp"), "m", request(input="Hi"), SamplingParams())
    assert (base.temperature, base.top_p) == (1.0, 1.0)
    params = SamplingParams(temperature=0.0, top_p=0.5)
    base = ResponseObject.of(new_id("resp"), "m", request(input="Hi", temperature=0, top_p=0.5), params)
    assert (base.temperature, base.top_p) == (0.0, 0.5)
