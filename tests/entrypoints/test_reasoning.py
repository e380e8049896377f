"""Reasoning parsers (``--reasoning-parser``): whole texts and every split of them into deltas, the
registry, and the chat handler through ``build_app`` with a scripted engine (streamed and whole
answers, ``chat_template_kwargs`` reaching the template and the parser).

(The end-to-end side, with the official client against a live server, is tests/e2e/test_reasoning_serve.py.)
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jinja2
import pytest
from fastapi.testclient import TestClient

from fastdeploy.config import ModelConfig, ServerConfig
from fastdeploy.core.outputs import CompletionOutput, RequestOutput
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    get_reasoning_parser,
)

QWEN3_PROMPT = "<|user|>Hi\n<|assistant|>"
R1_PROMPT = "<|user|>Hi\n<|assistant|><think>\n"

# (parser, prompt, template kwargs, output, expected reasoning, expected content)
CASES: list[tuple[type[ReasoningParser], str, dict[str, Any], str, str | None, str | None]] = [
    (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        {},
        "<think>\nLet me see.\n</think>\n\nIt is 4.",
        "\nLet me see.\n",
        "It is 4.",
    ),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "\n<think>a<b</think>c</think>d", "a<b", "c</think>d"),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "Just 4.", None, "Just 4."),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "<thinking> is a tag", None, "<thinking> is a tag"),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "4 </think> 5", None, "4 </think> 5"),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "<think>cut by max_tok", "cut by max_tok", None),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "<think>cut at </thi", "cut at </thi", None),
    (Qwen3ReasoningParser, QWEN3_PROMPT, {}, "<thi", None, "<thi"),
    (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        {"enable_thinking": False},
        "<think>x</think>y",
        None,
        "<think>x</think>y",
    ),
    (
        Qwen3ReasoningParser,
        R1_PROMPT,
        {},
        "opened by the prompt</think>answer",
        "opened by the prompt",
        "answer",
    ),
    (DeepSeekR1ReasoningParser, R1_PROMPT, {}, "Hmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.\n", "4"),
    (DeepSeekR1ReasoningParser, R1_PROMPT, {}, "<think>old style</think>4", "old style", "4"),
    (DeepSeekR1ReasoningParser, R1_PROMPT, {}, "still thinking <", "still thinking <", None),
    (DeepSeekR1ReasoningParser, R1_PROMPT, {}, "</think>4", None, "4"),
    (DeepSeekR1ReasoningParser, R1_PROMPT, {}, "a</think>\n\n", "a", None),
]


def split_all(parser: ReasoningParser, pieces: list[str]) -> tuple[str | None, str | None]:
    stream = parser.stream()
    outs = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning = "".join(o[0] for o in outs)
    content = "".join(o[1] for o in outs)
    return reasoning or None, content or None


@pytest.mark.parametrize(("cls", "prompt", "kwargs", "text", "reasoning", "content"), CASES)
def test_whole_text(cls, prompt, kwargs, text, reasoning, content):
    assert cls(prompt, kwargs).extract(text) == (reasoning, content)


@pytest.mark.parametrize(("cls", "prompt", "kwargs", "text", "reasoning", "content"), CASES)
def test_every_split_into_deltas(cls, prompt, kwargs, text, reasoning, content):
    parser = cls(prompt, kwargs)
    assert split_all(parser, list(text)) == (reasoning, content)  # one character per delta
    cuts = range(len(text) + 1)
    for a, b in itertools.combinations_with_replacement(cuts, 2):  # every split into three deltas
        pieces = [text[:a], text[a:b], text[b:]]
        assert split_all(parser, pieces) == (reasoning, content), pieces


def test_stream_is_incremental_and_holds_back_only_a_possible_tag():
    stream = Qwen3ReasoningParser(QWEN3_PROMPT).stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>ab") == ("ab", "")
    assert stream.feed("c</") == ("c", "")  # "</" may start the end tag
    assert stream.feed("x") == ("</x", "")
    assert stream.feed("</think>") == ("", "")
    assert stream.feed("\n\nhi") == ("", "hi")
    assert stream.feed(" <think>") == ("", " <think>")
    assert stream.finish() == ("", "")


def test_registry_and_unknown_names():
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("deepseek-r1") is DeepSeekR1ReasoningParser  # SGLang's spelling
    with pytest.raises(ValueError, match="available: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert set(REASONING_PARSERS) >= {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        build_app(ScriptedEngine([]), ["m"], ServerConfig(reasoning_parser="nope"))


# --------------------------------------------------------------------------- the chat handler

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if open_think %}<think>\n{% endif %}{% endif %}"
)


class ScriptedTokenizer:
    """A tokenizer whose chat template reads ``enable_thinking`` and ``open_think``; one id per character."""

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=False, **kwargs) -> str:
        env = jinja2.Environment()
        return env.from_string(TEMPLATE).render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) % 90 + 1 for ch in text]

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0}


class ScriptedEngine:
    """An engine client that answers every request with ``pieces`` as the text deltas (``length`` if
    ``cut``, else ``stop``) and records the prompts it was given."""

    def __init__(self, pieces: list[str], cut: bool = False):
        self.pieces, self.cut = pieces, cut
        self.prompts: list[str] = []
        self.is_healthy = True
        self.max_model_len = 4096
        self.vocab_size = 100
        self.tokenizer = ScriptedTokenizer()
        self.source = SimpleNamespace(path="/models/m")
        self.config = SimpleNamespace(model=ModelConfig())

    async def generate(
        self, token_ids, params, request_id, prompt=None, **kwargs
    ) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            finish = ("length" if self.cut else "stop") if last else None
            outputs = [
                CompletionOutput(index=k, text=piece, token_ids=[7], finish_reason=finish)
                for k in range(params.n)
            ]
            yield RequestOutput(request_id, prompt, list(token_ids), outputs, finished=last)

    async def abort(self, request_ids) -> None:
        pass


_OPEN_CLIENTS: list[TestClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().__exit__(None, None, None)


def client_for(engine: ScriptedEngine, parser: str | None = "qwen3") -> TestClient:
    """A client of the app over ``engine``, on one event loop for all its requests (closed after the test)."""
    client = TestClient(build_app(engine, ["m"], ServerConfig(reasoning_parser=parser)))
    _OPEN_CLIENTS.append(client.__enter__())
    return client


def chat(client: TestClient, **fields) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    return client.post("/v1/chat/completions", json=body)


def stream_deltas(client: TestClient, **fields) -> list[dict[str, Any]]:
    response = chat(client, stream=True, **fields)
    assert response.status_code == 200, response.text
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e)["choices"][0] for e in events[:-1]]


OUTPUT = ["<th", "ink>\nTwo plus", " two.</th", "ink>\n", "\nIt is", " 4."]


def test_streamed_reasoning_then_content_split_inside_tags():
    choices = stream_deltas(client_for(ScriptedEngine(OUTPUT)))
    deltas = [c["delta"] for c in choices]
    reasoning = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(reasoning) == "\nTwo plus two."
    assert len(reasoning) == 2  # incremental: each piece as it comes
    content = [d["content"] for d in deltas[1:] if "content" in d]
    assert "".join(content) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    assert not any("<" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    assert choices[-1]["finish_reason"] == "stop"


def test_whole_answer_and_n():
    response = chat(client_for(ScriptedEngine(OUTPUT)), n=2)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        message = choice["message"]
        assert message["reasoning_content"] == message["reasoning"] == "\nTwo plus two."
        assert message["content"] == "It is 4."


def test_answer_cut_inside_reasoning_is_all_reasoning():
    engine = ScriptedEngine(["<think>Still", " thinking </thi"], cut=True)
    message = chat(client_for(engine)).json()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Still thinking </thi",
        "reasoning": "Still thinking </thi",
    }
    deltas = [c["delta"] for c in stream_deltas(client_for(engine))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Still thinking </thi"
    assert not any(d.get("content") for d in deltas)


def test_without_a_parser_nothing_changes():
    client = client_for(ScriptedEngine(OUTPUT), parser=None)
    message = chat(client).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "".join(OUTPUT)}
    deltas = [c["delta"] for c in stream_deltas(client)]
    assert all(set(d) <= {"role", "content"} for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "".join(OUTPUT)


def test_chat_template_kwargs_reach_the_template_and_the_parser():
    engine = ScriptedEngine(["Four."])
    client = client_for(engine)
    message = chat(client, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert engine.prompts[-1] == "<|user|>Hi\n<|assistant|><think>\n\n</think>\n\n"
    assert message == {"role": "assistant", "content": "Four."}
    chat(client)
    assert engine.prompts[-1] == "<|user|>Hi\n<|assistant|>"

    # a template that opens <think> in the prompt: the answer starts inside the reasoning
    engine = ScriptedEngine(["Hmm", "</think>", "Four."])
    message = chat(client_for(engine), chat_template_kwargs={"open_think": True}).json()["choices"][0][
        "message"
    ]
    assert engine.prompts[-1].endswith("<|assistant|><think>\n")
    assert (message["reasoning_content"], message["content"]) == ("Hmm", "Four.")


def test_chat_template_kwargs_with_continue_final_message():
    engine = ScriptedEngine(["x"])
    body = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    response = client_for(engine).post("/v1/chat/completions", json={"model": "m", **body})
    assert response.status_code == 200, response.text
    assert engine.prompts[-1] == "<|user|>Hi\n<|assistant|>Sure"


@pytest.mark.parametrize("value", [["enable_thinking"], "x", 3])
def test_chat_template_kwargs_must_be_an_object(value):
    response = chat(client_for(ScriptedEngine(["x"])), chat_template_kwargs=value)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_may_not_set_template_arguments():
    response = chat(client_for(ScriptedEngine(["x"])), chat_template_kwargs={"tokenize": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and "tokenize" in error["message"]


def test_include_reasoning_false_drops_the_reasoning():
    """vLLM's ``include_reasoning: false``: the answer's content only, whole and streamed."""
    engine = ScriptedEngine(OUTPUT)
    message = chat(client_for(engine), include_reasoning=False).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is 4."}
    deltas = [c["delta"] for c in stream_deltas(client_for(engine), include_reasoning=False)]
    assert not any("reasoning_content" in d or "reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."


def test_usage_counts_the_reasoning_tokens():
    """``usage.completion_tokens_details.reasoning_tokens`` with a reasoning parser (here the scripted
    tokenizer's one token per character: the reasoning text re-tokenized), for every choice, whole
    and streamed, with the reasoning returned or not; no such field without a parser."""
    reasoning_chars = len("\nTwo plus two.")
    for include in (True, False):
        usage = chat(client_for(ScriptedEngine(OUTPUT)), n=2, include_reasoning=include).json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * reasoning_chars}
    response = chat(client_for(ScriptedEngine(OUTPUT)), stream=True, stream_options={"include_usage": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_chars}
    plain = chat(client_for(ScriptedEngine(OUTPUT), parser=None)).json()["usage"]
    assert "completion_tokens_details" not in plain


class TagTokenizer:
    """``<think>`` and ``</think>`` are one token each (ids 100 and 101), as in Qwen3's vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return {"<think>": [100], "</think>": [101]}.get(text, [ord(ch) for ch in text])


@pytest.mark.parametrize(
    "prompt, kwargs, token_ids, count",
    [
        ("<|assistant|>", {}, [100, 5, 6, 7, 101, 8, 9], 3),  # the answer opens its reasoning
        ("<|assistant|><think>\n", {}, [5, 6, 101, 8], 2),  # the prompt opened it
        ("<|assistant|>", {}, [5, 6, 7], 0),  # no reasoning
        ("<|assistant|>", {}, [100, 5, 6], 2),  # cut inside the reasoning
        ("<|assistant|>", {"enable_thinking": False}, [100, 5, 101], 0),
    ],
)
def test_reasoning_tokens_by_the_tags_token_ids(prompt, kwargs, token_ids, count):
    parser = Qwen3ReasoningParser(prompt, kwargs)
    assert parser.count_reasoning_tokens(token_ids, "(unused)", TagTokenizer()) == count
