"""The benchmark statistics on synthetic timings equal hand-computed values; datasets on a fake tokenizer."""

from __future__ import annotations

import json

import pytest

from fastdeploy.benchmarks.datasets import prefix_repetition_dataset, random_dataset, sharegpt_dataset
from fastdeploy.benchmarks.metrics import RequestResult, compute_metrics, format_table, parse_goodput


def synthetic_results() -> list[RequestResult]:
    """Three successes (5, 3 and 1 output tokens) and one failure; times in seconds."""
    return [
        RequestResult(
            True, "", 10, 5, ttft=0.1, itl=[0.05, 0.05, 0.1, 0.1], latency=0.4
        ),  # TPOT 0.3/4 = 75 ms
        RequestResult(True, "", 20, 3, ttft=0.2, itl=[0.1, 0.2], latency=0.5),  # TPOT 0.3/2 = 150 ms
        RequestResult(True, "", 30, 1, ttft=0.3, itl=[], latency=0.3),  # one token: no TPOT
        RequestResult(False, "HTTP 500: boom", 40, 0, latency=0.05),
    ]


def test_counts_and_throughput():
    m = compute_metrics(synthetic_results(), duration=2.0)
    assert (m.num_prompts, m.completed, m.failed) == (4, 3, 1)
    assert m.errors == ["HTTP 500: boom"]
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 9)  # the failed request's 40 not counted
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(30.0)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.goodput is None and m.good_requests is None


@pytest.mark.parametrize(
    "name, expected",
    [
        # (mean, median, p90, p99, count); percentiles interpolate linearly between ranks
        ("ttft_ms", (200.0, 200.0, 280.0, 298.0, 3)),  # 100, 200, 300
        ("tpot_ms", (112.5, 112.5, 142.5, 149.25, 2)),  # 75, 150
        ("itl_ms", (100.0, 100.0, 150.0, 195.0, 6)),  # 50, 50, 100, 100, 100, 200
        ("e2el_ms", (400.0, 400.0, 480.0, 498.0, 3)),  # 300, 400, 500
    ],
)
def test_latency_distributions(name, expected):
    dist = getattr(compute_metrics(synthetic_results(), duration=2.0), name)
    assert (dist.mean, dist.median, dist.p90, dist.p99, dist.count) == pytest.approx(expected)


@pytest.mark.parametrize(
    "slos, good",
    [
        (["ttft:250", "tpot:100"], 1),  # request 2 misses TPOT, request 3 misses TTFT
        (["ttft:300", "tpot:100"], 2),  # request 3 has no TPOT: it meets a TPOT SLO
        (["e2el:450"], 2),
        (["ttft:1000", "tpot:1000"], 3),  # the failed request never counts
        (["ttft:50"], 0),
    ],
)
def test_goodput(slos, good):
    m = compute_metrics(synthetic_results(), duration=2.0, slos_ms=parse_goodput(slos))
    assert m.good_requests == good
    assert m.goodput == pytest.approx(good / 2.0)


def test_parse_goodput_rejects_bad_items():
    assert parse_goodput(["TTFT:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_no_success_gives_empty_distributions_and_table():
    m = compute_metrics([RequestResult(False, "ConnectionError: refused")], duration=1.0)
    assert (m.completed, m.failed, m.request_throughput) == (0, 1, 0.0)
    assert m.ttft_ms.mean is None and m.ttft_ms.count == 0
    table = format_table(m)
    assert "Failed requests:" in table and "ConnectionError: refused" in table and "n/a" in table
    json.dumps(m.to_dict())  # serializable as the --save-result file


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics(synthetic_results(), duration=0.0)


class WordTokenizer:
    """One token per whitespace-separated word (ids are indexes into a growing vocabulary)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_random_dataset_lengths_and_seed():
    tok = WordTokenizer()
    samples = random_dataset(tok, 5, input_len=20, output_len=7, seed=1)
    assert [(s.prompt_len, s.expected_output_len) for s in samples] == [(20, 7)] * 5
    assert all(len(tok.encode(s.prompt)) == 20 for s in samples)
    assert len({s.prompt for s in samples}) == 5
    assert [s.prompt for s in random_dataset(tok, 5, 20, 7, seed=1)] == [s.prompt for s in samples]
    ranged = random_dataset(tok, 50, input_len=20, output_len=10, range_ratio=0.5, seed=2)
    assert all(10 <= s.prompt_len <= 30 and 5 <= s.expected_output_len <= 15 for s in ranged)
    assert len({s.prompt_len for s in ranged}) > 1


def test_prefix_repetition_dataset_shares_prefixes():
    tok = WordTokenizer()
    samples = prefix_repetition_dataset(tok, 8, prefix_len=10, suffix_len=5, num_prefixes=2, output_len=3)
    assert all(s.prompt_len == 15 and s.expected_output_len == 3 for s in samples)
    prefixes = {" ".join(s.prompt.split()[:10]) for s in samples}
    assert len(prefixes) == 2
    assert len({s.prompt for s in samples}) == 8


def test_sharegpt_dataset(tmp_path):
    conv = [
        {
            "conversations": [
                {"from": "human", "value": "one two three four five"},
                {"from": "gpt", "value": "a b c d"},
            ]
        },
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d e"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {
            "conversations": [
                {"from": "human", "value": "six seven eight nine"},
                {"from": "gpt", "value": "x y z w v"},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conv))
    samples = sharegpt_dataset(WordTokenizer(), str(path), 2)
    assert sorted((s.prompt_len, s.expected_output_len) for s in samples) == [(4, 5), (5, 4)]
    fixed = sharegpt_dataset(WordTokenizer(), str(path), 2, output_len=9)
    assert {s.expected_output_len for s in fixed} == {9}
    with pytest.raises(ValueError):
        sharegpt_dataset(WordTokenizer(), str(path), 3)
