"""Request parsing and validation of the OpenAI protocol, without a server or an engine."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fastdeploy.core.sampling_params import SamplingParamsError
from fastdeploy.engine.protocol import EngineDeadError, EngineRequestRejected
from fastdeploy.entrypoints.openai.content_format import apply_content_format, resolve_content_format
from fastdeploy.entrypoints.openai.errors import (
    AuthenticationError,
    BadRequestError,
    NotFoundError,
    OpenAIError,
    ServiceUnavailableError,
    from_pydantic,
)
from fastdeploy.entrypoints.openai.event_streams import sse, to_openai_error
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UsageInfo,
    parse_request,
    parse_tokenize_request,
    random_id,
    resolve_max_tokens,
)
from fastdeploy.entrypoints.openai.serving_engine import sub_request_ids

USER = [{"role": "user", "content": "Hello"}]


def completion(**fields):
    return parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def chat(**fields):
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, **fields})


def bad_request(fn, *args, **kwargs) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        fn(*args, **kwargs)
    assert info.value.status_code == 400
    return info.value


# --------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize(
    "prompt",
    [[], "", [[]], [1, "a"], [1, True], [[1], "a"], 5, None, {"text": "x"}, [-1], [1.5]],
)
def test_completion_bad_prompts(prompt):
    err = bad_request(completion, prompt=prompt)
    assert err.param == "prompt"


def test_completion_prompt_is_required():
    err = bad_request(parse_request, CompletionRequest, {"model": "m"})
    assert err.param == "prompt"
    assert "Missing required parameter" in err.message


# --------------------------------------------------------------------------- sampling params


def test_defaults_follow_openai():
    params = completion().to_sampling_params()
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.n == 1
    assert params.top_k == -1
    assert params.max_tokens is None  # resolved later against the prompt length
    assert params.stop == []
    assert CompletionRequest.DEFAULT_MAX_TOKENS == 16


def test_explicit_nulls_mean_defaults():
    params = chat(temperature=None, top_p=None, n=None, max_tokens=None, stop=None).to_sampling_params()
    assert (params.temperature, params.top_p, params.n, params.max_tokens, params.stop) == (
        1.0,
        1.0,
        1,
        None,
        [],
    )


def test_fields_are_passed_through():
    params = chat(
        n=3,
        temperature=0,
        top_p=0.5,
        seed=7,
        max_tokens=20,
        stop="END",
        top_k=5,
        min_p=0.1,
        min_tokens=2,
        stop_token_ids=[7, 8],
        include_stop_str_in_output=True,
        ignore_eos=True,
        skip_special_tokens=False,
    ).to_sampling_params()
    assert params.n == 3 and params.temperature == 0.0 and params.top_p == 0.5 and params.seed == 7
    assert params.max_tokens == 20 and params.stop == ["END"] and params.top_k == 5 and params.min_p == 0.1
    assert params.min_tokens == 2 and params.stop_token_ids == [7, 8]
    assert params.include_stop_str_in_output and params.ignore_eos and not params.skip_special_tokens


def test_stop_list_and_top_k_zero():
    params = completion(stop=["a", "b"], top_k=0).to_sampling_params()
    assert params.stop == ["a", "b"]
    assert params.top_k == -1


def test_max_completion_tokens_wins():
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_out_of_range_values_are_400_with_param(fields, param):
    err = bad_request(chat(**fields).to_sampling_params)
    assert err.param == param
    assert err.body()["error"]["param"] == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 10.5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": True}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"seed": 2**70}, "seed"),
        ({"top_k": 2**70}, "top_k"),  # (once a 500: the engine's IPC and tensors hold 64-bit integers)
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"model": 3}, "model"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_are_400_with_param(fields, param):
    err = bad_request(chat, **fields)
    assert err.param == param


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"not_a_field": ["a"]}, "not_a_field"),
        ({"stream_options": {"include_usage": True, "other": 1}}, "stream_options.other"),
    ],
)
def test_unknown_field_is_rejected_with_strict_fields(fields, param):
    err = bad_request(parse_request, ChatCompletionRequest, {"messages": USER, **fields}, strict_fields=True)
    assert err.param == param
    assert err.message == f"Unrecognized request argument supplied: {param}"


def test_deprecated_functions_are_read_as_tools():
    """OpenAI's deprecated ``functions`` / ``function_call``: ``tools`` / ``tool_choice``, one call."""
    function = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    request = chat(functions=[function], function_call={"name": "f"})
    request.to_sampling_params()
    assert request.legacy_functions and request.parallel_tool_calls is False
    assert [t.function.name for t in request.tools] == ["f"]
    assert request.tool_choice == {"type": "function", "function": {"name": "f"}}
    auto = chat(functions=[function], function_call="auto")
    auto.to_sampling_params()
    assert auto.tool_choice == "auto"
    off = chat(functions=[function], function_call="none")
    off.to_sampling_params()
    assert off.tool_choice == "none" and off.legacy_functions


@pytest.mark.parametrize(
    "fields,param",
    [
        (
            {"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "g"}}]},
            "functions",
        ),
        ({"functions": {"name": "f"}}, "functions"),
        ({"functions": [{"description": "no name"}]}, "functions[0]"),
        ({"functions": [{"name": "f"}], "function_call": {"nom": "f"}}, "function_call"),
        ({"function_call": "auto", "tool_choice": "auto"}, "function_call"),
    ],
)
def test_bad_deprecated_functions_are_400(fields, param):
    err = bad_request(chat(**fields).to_sampling_params)
    assert err.param == param


@pytest.mark.parametrize("fields", [{"best_of": 3}, {"suffix": "x"}])
def test_unimplemented_completion_fields_are_400(fields):
    (name,) = fields
    err = bad_request(completion(**fields).to_sampling_params)
    assert err.param == name


def test_echo_and_prompt_logprobs_map_to_sampling_params():
    assert completion(prompt_logprobs=3).to_sampling_params().prompt_logprobs == 3
    assert chat(prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0
    assert completion(echo=True).to_sampling_params().prompt_logprobs is None
    # echoed logprobs cover the prompt: the engine computes prompt logprobs for them
    assert completion(echo=True, logprobs=2).to_sampling_params().prompt_logprobs == 2
    assert completion(echo=True, logprobs=2, prompt_logprobs=4).to_sampling_params().prompt_logprobs == 4
    assert completion(echo=True, max_tokens=0).to_sampling_params().max_tokens == 0


@pytest.mark.parametrize(
    "make, fields, param",
    [
        (completion, {"prompt_logprobs": -2}, "prompt_logprobs"),
        (completion, {"echo": True, "logprobs": 2, "prompt_logprobs": -2}, "prompt_logprobs"),
        (chat, {"prompt_logprobs": -5}, "prompt_logprobs"),
        (completion, {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
        (completion, {"echo": True, "max_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_echo_and_prompt_logprobs_values_are_400(make, fields, param):
    assert bad_request(make(**fields).to_sampling_params).param == param


def test_zero_max_tokens_hints_echo_only_where_echo_allows_it():
    assert "only with echo" in bad_request(completion(max_tokens=0).to_sampling_params).message
    # (chat's echo never allows 0: the hint once told a chat request with echo to set echo)
    for fields in ({"max_tokens": 0}, {"max_tokens": 0, "echo": True}, {"max_completion_tokens": 0}):
        err = bad_request(chat(**fields).to_sampling_params)
        assert "echo" not in err.message, err.message


def test_tokenize_request_chat_template_reaches_the_chat_request():
    """(the server refuses or renders it: tests/entrypoints/test_content_format.py)"""
    tokenize = parse_tokenize_request({"messages": USER, "chat_template": "{{ x }}"})
    chat_request = parse_request(ChatCompletionRequest, tokenize.chat_request())
    assert chat_request.chat_template == "{{ x }}"
    chat_request.check_supported()


def test_chat_echo_needs_a_bool():
    assert bad_request(chat, echo="yes").param == "echo"


def test_off_values_of_unimplemented_fields_are_accepted():
    chat(
        logprobs=False,
        top_logprobs=0,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        tools=None,
        response_format={"type": "text"},
        user="someone",
        stream=True,
        stream_options={"include_usage": True},
    ).to_sampling_params()
    completion(logprobs=None, echo=False, best_of=1, suffix=None).to_sampling_params()
    completion(n=2, best_of=2).to_sampling_params()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        # (Python's int() reads these, so they were once taken as token ids; OpenAI refuses them)
        ({"logit_bias": {" 1": 1}}, "logit_bias"),
        ({"logit_bias": {"1_0": 1}}, "logit_bias"),
        ({"logit_bias": {"\uff11": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"bad_words": [""]}, "bad_words"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_out_of_range_sampling_fields_are_400_naming_the_field(fields, param):
    err = bad_request(chat(**fields).to_sampling_params)
    assert err.param == param


def test_every_logit_bias_key_that_is_not_a_token_id_is_named():
    err = bad_request(chat(logit_bias={"bad1": 50.0, "7": 1.0, "bad2": 20.0}).to_sampling_params)
    assert (
        err.param == "logit_bias" and "'bad1'" in str(err) and "'bad2'" in str(err) and "'7'" not in str(err)
    )


def test_completion_logprobs_range():
    assert completion(logprobs=5).to_sampling_params().logprobs == 5
    assert completion(logprobs=0).to_sampling_params().logprobs == 0
    assert completion(logprobs=-1).to_sampling_params().logprobs == -1  # the whole vocabulary
    assert bad_request(completion(logprobs=-2).to_sampling_params).param == "logprobs"
    # an echo's prompt logprobs follow a -1 (the bound against --max-logprobs is the server's)
    assert completion(echo=True, logprobs=-1, prompt_logprobs=3).to_sampling_params().prompt_logprobs == -1


def test_sampling_fields_reach_sampling_params():
    params = chat(
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"7": -100, "9": 2.5},
        bad_words=["foo"],
    ).to_sampling_params()
    assert params.logprobs == 3
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.logit_bias == {7: -100.0, 9: 2.5}
    assert params.bad_words == ["foo"]
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat().to_sampling_params().logprobs is None


def test_include_usage_only_when_streaming():
    assert chat(stream=True, stream_options={"include_usage": True}).usage_in_stream()[0]
    assert not chat(stream=True).usage_in_stream()[0]
    assert not chat(stream=False, stream_options={"include_usage": True}).usage_in_stream()[0]


# --------------------------------------------------------------------------- chat messages


def test_content_parts_are_joined():
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    [message] = req.template_messages()
    assert message["content"] == "a\nb"
    assert apply_content_format([message], "string") == [{"role": "user", "content": "a\nb"}]


def test_content_format_openai_hands_the_template_the_parts_as_sent():
    """``--chat-template-content-format openai``: the text parts with their own fields (a template
    may read them), a string content as one part; ``auto`` follows what the template reads."""
    parts = [{"type": "text", "text": "Hola", "source_lang_code": "es"}, {"type": "text", "text": "mundo"}]
    req = chat(messages=[{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}])
    assert apply_content_format(req.template_messages(), "openai") == [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
    changed = {**req.template_messages()[0], "content": "rewritten"}  # (e.g. by the tool-call prompt)
    assert apply_content_format([changed], "openai")[0]["content"] == [{"type": "text", "text": "rewritten"}]
    loops = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
    assert resolve_content_format("auto", loops) == "openai"
    assert resolve_content_format("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("openai", None) == "openai"


def test_developer_role_is_shown_as_system_and_assistant_may_lack_content():
    req = chat(
        messages=[
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "q", "name": "bob"},
            {"role": "assistant", "content": None},
        ]
    )
    assert req.template_messages() == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "user"}], "messages"),
        ([{"role": "", "content": "x"}], "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "messages"),  # no tool_call_id
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages"),  # only assistants call tools
        (["hi"], "messages[0]"),
    ],
)
def test_bad_messages(messages, param):
    err = bad_request(chat, messages=messages)
    assert err.param == param


def test_image_parts_say_not_supported():
    err = bad_request(chat, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert "'image_url' is not supported" in err.message


def test_feature_parts_keep_the_content_a_list_of_parts():
    image = {
        "type": "image_feature_url",
        "image_feature_url": {"url": "file:///x.npy", "grid_thw": [1, 4, 6]},
    }
    content = [{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "user", "content": content}])
    assert req.messages[0].content == content
    assert req.template_messages() == [{"role": "user", "content": content}]
    # without feature parts, text parts are still joined
    req = chat(messages=[{"role": "user", "content": [content[0], content[2]]}])
    assert req.messages[0].content == "a\nb"


# --------------------------------------------------------------------------- tokenize requests


def test_tokenize_request_forms():
    assert isinstance(parse_tokenize_request({"prompt": "x"}), TokenizeCompletionRequest)
    chat_req = parse_tokenize_request({"messages": USER})
    assert isinstance(chat_req, TokenizeChatRequest)
    assert chat_req.add_generation_prompt is None and not chat_req.add_special_tokens  # (the chat's default)
    assert chat_req.chat_request() == {"messages": USER, "continue_final_message": False}
    continued = parse_tokenize_request(
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": False, "tools": []}
    ).chat_request()
    assert continued == {
        "messages": USER,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "tools": [],
    }
    assert bad_request(parse_tokenize_request, {"messages": []}).param == "messages"
    both = bad_request(parse_tokenize_request, {"prompt": "x", "messages": USER})  # (messages used to win)
    assert both.param == "prompt" and "not both" in both.message
    neither = bad_request(parse_tokenize_request, {})
    assert neither.param == "prompt" and "prompt (or messages)" in neither.message
    assert bad_request(parse_request, DetokenizeRequest, {"tokens": [1, -2]}).param == "tokens"
    assert bad_request(parse_request, DetokenizeRequest, {"tokens": "12"}).param == "tokens"


# --------------------------------------------------------------------------- prompt length


def test_prompt_length_with_requested_max_tokens():
    assert resolve_max_tokens(100, 50, 8192) == 50
    assert resolve_max_tokens(8000, 192, 8192) == 192
    err = bad_request(resolve_max_tokens, 8990, 10, 8192, prompt_kind="messages")
    assert err.message.startswith(
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
        "(8990 in the messages, 10 in the completion)."
    )
    assert err.param == "messages"
    assert err.code == "context_length_exceeded"


def test_prompt_length_without_max_tokens():
    assert resolve_max_tokens(100, None, 8192) == 8092
    assert resolve_max_tokens(100, None, 8192, default=16) == 16
    assert resolve_max_tokens(8185, None, 8192, default=16) == 7
    assert resolve_max_tokens(8191, None, 8192) == 1
    for prompt_len in (8192, 9000):
        err = bad_request(resolve_max_tokens, prompt_len, None, 8192, default=16)
        assert "maximum context length is 8192 tokens" in err.message
        assert f"{prompt_len} tokens" in err.message
        assert err.param == "prompt"


# --------------------------------------------------------------------------- errors


def test_error_body_shape():
    body = BadRequestError("bad", param="x").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}}
    assert NotFoundError("m").status_code == 404
    assert AuthenticationError("k").status_code == 401
    assert ServiceUnavailableError("d").status_code == 503
    assert set(ServiceUnavailableError("d").body()["error"]) == {"message", "type", "param", "code"}


def test_invalid_json_and_non_object_bodies():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json("{not json")
    assert from_pydantic(info.value).code == "invalid_json"
    err = bad_request(parse_request, CompletionRequest, [1, 2])
    assert err.message == "The request body must be a JSON object"


def test_exception_mapping():
    assert to_openai_error(EngineDeadError("gone")).status_code == 503
    rejected = to_openai_error(EngineRequestRejected("prompt has 9 tokens; it must have 1 to 8"))
    assert rejected.status_code == 400 and "prompt has 9 tokens" in rejected.message
    err = to_openai_error(SamplingParamsError("top_p", "top_p must be in (0, 1]"))
    assert (err.status_code, err.param) == (400, "top_p")
    assert to_openai_error(RuntimeError("boom")).status_code == 500
    original = BadRequestError("x")
    assert to_openai_error(original) is original
    assert isinstance(to_openai_error(KeyError("k")), OpenAIError)


# --------------------------------------------------------------------------- responses


def test_stream_chunks_serialize_like_openai():
    role = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
    text = ChatCompletionStreamChoice(index=1, delta=DeltaMessage(content="hi"))
    end = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="stop")
    chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[role, text, end])
    data = json.loads(chunk.model_dump_json(exclude={"usage"}))
    assert data["object"] == "chat.completion.chunk"
    assert "usage" not in data
    assert [c["delta"] for c in data["choices"]] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert [c["finish_reason"] for c in data["choices"]] == [None, None, "stop"]
    event = sse(chunk)
    assert event.startswith("data: {") and event.endswith("}\n\n")


def test_usage_and_ids():
    usage = UsageInfo.build(prompt_tokens=10, completion_tokens=5, cached_tokens=8)
    assert usage.model_dump() == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    rid = random_id("cmpl")
    assert rid.startswith("cmpl-") and len(rid) == len("cmpl-") + 32
    assert sub_request_ids(rid, 1) == [rid]
    assert sub_request_ids(rid, 2) == [f"{rid}-0", f"{rid}-1"]
