"""Streaming deltas that waited for a slow consumer fold into one, losing nothing."""

from __future__ import annotations

from fastdeploy.core.outputs import CompletionOutput, Logprob, RequestOutput, merge_delta_outputs
from fastdeploy.core.timeline import RequestTimeline


def out(choices, finished=False, cached=0, prompt_lps=None, sent=None, timeline=None) -> RequestOutput:
    return RequestOutput(
        "r", None, [1, 2], choices, finished, cached, prompt_lps, timeline=timeline, sent_at=sent
    )


def test_texts_ids_logprobs_and_finish_join_per_choice():
    lp = [{5: Logprob(-0.5, 1, "a")}]
    timeline = RequestTimeline()
    a = out([CompletionOutput(0, "He", [5], None, None, lp), CompletionOutput(1, "x", [7])],
            cached=0, prompt_lps=[None, {2: Logprob(-1.0)}], sent=1.0, timeline=timeline)  # fmt: skip
    b = out([CompletionOutput(0, "llo", [6], None, None, [{6: Logprob(-0.25, 1, "b")}])], cached=16, sent=2.0)
    c = out([CompletionOutput(1, "y", [8], "stop", 8), CompletionOutput(0, "", [9], "length", None, [{9: Logprob(-2.0)}])],
            finished=True, cached=16, sent=3.0)  # fmt: skip
    merged = merge_delta_outputs(merge_delta_outputs(a, b), c)
    assert merged is a and merged.finished and merged.num_cached_tokens == 16
    first, second = sorted(merged.outputs, key=lambda o: o.index)
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello", [5, 6, 9], "length")
    assert [list(d) for d in first.logprobs] == [[5], [6], [9]]
    assert (second.text, second.token_ids, second.finish_reason, second.stop_reason) == (
        "xy",
        [7, 8],
        "stop",
        8,
    )
    assert second.logprobs is None
    assert merged.prompt_logprobs == [None, {2: Logprob(-1.0)}]
    assert merged.sent_at == 1.0 and merged.timeline is timeline  # the earliest send: its whole wait counts


def test_a_choice_new_in_the_later_delta_is_added():
    merged = merge_delta_outputs(out([CompletionOutput(0, "a", [1])]), out([CompletionOutput(2, "b", [2])]))
    assert [(o.index, o.text) for o in merged.outputs] == [(0, "a"), (2, "b")]
    assert not merged.finished
