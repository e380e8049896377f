"""``/v1/completions`` as lm-evaluation-harness's ``local-completions`` model and strict-typed clients use it.

Against the shared e2e server: a loglikelihood batch (token-id prompts, ``echo``, ``logprobs``) whose
``top_logprobs`` must let the harness's greedy check (``token_logprob == max(top.values())``) be
right where several tokens share a text, and the not-implemented ``best_of`` / ``suffix`` checked
as strictly as every other field.
"""

from __future__ import annotations

import pytest

COMPLETIONS_PATH = "/v1/completions"
MULTIBYTE = "Emoji: 🤖🦙 and 日本語"
"""Characters split into byte tokens that each decode alone to "\\ufffd": different tokens, one text."""


def post(server, body: dict):
    with server.http() as client:
        return client.post(COMPLETIONS_PATH, json=body)


def lm_eval_parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs`` (v0.4), verbatim in effect."""
    res = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
        res.append((sum(token_logprobs), is_greedy))
    return res


def test_top_logprobs_of_tokens_sharing_a_text_keep_the_largest(server):
    ids = server.tokenize(MULTIBYTE)["tokens"]
    prompts = [ids, ids[:8]]
    body = {"prompt": prompts, "echo": True, "max_tokens": 1, "logprobs": 5, "temperature": 0, "seed": 1234}
    response = post(server, {**body, "prompt_logprobs": 5})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    shared_texts = 0
    for prompt, choice in zip(prompts, choices):
        lp, by_id = choice["logprobs"], choice["prompt_logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        for pos in range(1, len(prompt)):
            entries = by_id[pos]
            own = entries[str(prompt[pos])]
            listed = [own] + sorted(
                (e for t, e in entries.items() if t != str(prompt[pos]) and e["rank"] <= 5),
                key=lambda e: -e["logprob"],
            )
            expected: dict[str, float] = {}
            for e in listed:
                expected[e["decoded_token"]] = max(
                    expected.get(e["decoded_token"], e["logprob"]), e["logprob"]
                )
            shared_texts += len(listed) - len(expected)
            top = lp["top_logprobs"][pos]
            assert top == expected, (pos, top, listed)
            assert list(top)[0] == lp["tokens"][pos]  # the prompt token's text first, as before
            # the harness's greedy check agrees with the prompt token's rank
            assert (lp["token_logprobs"][pos] == max(top.values())) == (own["rank"] == 1), (pos, top, own)
    assert shared_texts > 0  # (the prompt does exercise tokens that share a text)

    # the harness's own request and parse: a continuation is greedy when every token of it ranks first
    plain = post(server, body).json()
    for again, first in zip(sorted(plain["choices"], key=lambda c: c["index"]), choices):
        assert again["logprobs"]["tokens"] == first["logprobs"]["tokens"]
        assert again["logprobs"]["token_logprobs"] == pytest.approx(
            first["logprobs"]["token_logprobs"], abs=1e-5
        )
    ranks = [None] + [choices[0]["prompt_logprobs"][pos][str(ids[pos])]["rank"] for pos in range(1, len(ids))]
    for ctxlen in range(1, len(ids)):
        (_, is_greedy), _ = lm_eval_parse_logprobs(plain, [ctxlen, 1])
        assert is_greedy == all(rank == 1 for rank in ranks[ctxlen:]), (ctxlen, ranks)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"best_of": True}, "best_of"),  # was accepted as 1
        ({"best_of": 1.0}, "best_of"),  # was accepted as 1
        ({"best_of": "1"}, "best_of"),
        ({"suffix": 5}, "suffix"),
        ({"suffix": "!"}, "suffix"),  # not implemented: only null or ""
        ({"best_of": 2}, "best_of"),  # not implemented: only equal to n
    ],
)
def test_best_of_and_suffix_are_strictly_typed(server, fields, param):
    error = server.check_error(post(server, {"prompt": "Hi", "max_tokens": 1, **fields}), 400)
    assert error["param"] == param, error


def test_best_of_equal_to_n_and_empty_suffix_are_accepted(server):
    response = post(server, {"prompt": "Hi", "max_tokens": 1, "n": 2, "best_of": 2, "suffix": ""})
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]
