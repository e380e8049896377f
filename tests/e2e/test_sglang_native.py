"""SGLang's native API on the shared server, as SGLang's own tests and clients call it: ``/generate``
(text or token ids, one or a batch, ``n``, streaming with the text so far, logprobs, SGLang's
finish reasons and errors), ``/abort_request``, ``/get_model_info`` and ``/get_server_info``."""

from __future__ import annotations

import json
import threading
import time

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def generate(server, **body):
    with server.http() as http:
        return http.post("/generate", json=body)


def test_one_text_answers_like_the_completions_route(server, model_name):
    answer = generate(server, text=PROMPT, sampling_params=GREEDY).json()
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["completion_tokens"] == len(answer["output_ids"]) == 8
    assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    assert isinstance(meta["id"], str) and meta["id"]
    same = server.openai().completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert answer["text"] == same.choices[0].text
    by_ids = generate(server, input_ids=answer["output_ids"][:3], sampling_params=GREEDY, rid="mine").json()
    assert by_ids["meta_info"]["id"] == "mine" and by_ids["meta_info"]["prompt_tokens"] == 3


def test_batches_and_n_answer_lists_in_prompt_order(server):
    texts = [PROMPT, "One, two, three,"]
    batch = generate(server, text=texts, sampling_params=GREEDY).json()
    assert [a["text"] for a in batch] == [
        generate(server, text=t, sampling_params=GREEDY).json()["text"] for t in texts
    ]
    sampled = generate(
        server, text=PROMPT, sampling_params={"max_new_tokens": 4, "n": 3, "temperature": 1.0}
    ).json()
    assert len(sampled) == 3 and len({a["meta_info"]["id"] for a in sampled}) == 3
    per_prompt = [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}]
    lengths = [
        a["meta_info"]["completion_tokens"]
        for a in generate(server, text=texts, sampling_params=per_prompt).json()
    ]
    assert lengths == [2, 5]


def test_stream_sends_the_text_so_far(server):
    whole = generate(server, text=PROMPT, sampling_params=GREEDY).json()
    with server.http() as http:
        lines = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, "stream": True}).text
    events = [line[6:] for line in lines.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))  # cumulative
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "index" not in chunks[0]


def test_logprobs(server):
    answer = generate(
        server, text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
        top_logprobs_num=3, return_text_in_logprobs=True,
    ).json()  # fmt: skip
    meta = answer["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None  # nothing predicts the first token
    assert all(lp <= 0 for lp, _, _ in meta["input_token_logprobs"][1:])
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 8
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == token and abs(top[0][0] - lp) < 1e-6  # greedy: the best
    assert "".join(text for *_, text in meta["output_token_logprobs"]) == answer["text"]
    default = generate(server, text=PROMPT, sampling_params=GREEDY, return_logprob=True).json()["meta_info"]
    assert len(default["input_token_logprobs"]) == 1 and "output_top_logprobs" not in default
    assert default["output_token_logprobs"][0][2] is None  # no text unless asked


def test_stop_strings_report_what_matched(server):
    answer = generate(
        server, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 32, "stop": " "}
    ).json()
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": " "}
    assert " " not in answer["text"]


def test_errors_are_400s(server):
    for body, words in (
        ({"sampling_params": GREEDY}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "tempreature": 0}},
            "unknown key 'tempreature'",
        ),
        ({"text": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 10**6}}, "context length"),
        ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 500}, "logprob_start_len"),
    ):
        response = generate(server, **body)
        assert response.status_code == 400, body
        assert words in response.json()["error"]["message"], response.json()


def test_abort_request_ends_a_running_generation(server):
    result: dict = {}
    body = {
        "text": PROMPT,
        "rid": "abort-me",
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
    }
    worker = threading.Thread(target=lambda: result.update(generate(server, **body).json()))
    worker.start()
    time.sleep(1.0)
    with server.http() as http:
        assert http.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    worker.join(timeout=60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] < 1500


def test_model_and_server_info(server):
    with server.http() as http:
        model = http.get("/get_model_info").json()
        info = http.get("/get_server_info").json()
    assert model["is_generation"] is True and model["model_path"]
    assert isinstance(info["max_total_num_tokens"], int) and info["max_total_num_tokens"] > 0
    assert isinstance(info["version"], str)


def test_flush_cache_forgets_the_cached_prefixes(server):
    """SGLang's /flush_cache (and vLLM's /reset_prefix_cache): a prompt seen before is served from
    the prefix cache, and computed in full again after a flush."""
    prompt = "A long shared prefix for the cache: " + "one two three four five six seven eight " * 8
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
    generate(server, **body)
    assert generate(server, **body).json()["meta_info"]["cached_tokens"] > 0
    with server.http() as http:
        flushed = http.post("/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        assert generate(server, **body).json()["meta_info"]["cached_tokens"] == 0
        assert http.post("/reset_prefix_cache").status_code == 200
    assert generate(server, **body).json()["meta_info"]["cached_tokens"] == 0
