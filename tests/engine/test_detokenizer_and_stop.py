"""Incremental detokenization and front-end output processing with the default model's tokenizer."""

from __future__ import annotations

import random

import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.core.request import EngineCoreOutput
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, new_detokenizer
from fastdeploy.engine.output_processor import OutputProcessor, RequestState
from fastdeploy.model_executor.model_loader import load_tokenizer, resolve_model

MULTIBYTE_TEXTS = [
    "Hello 🦊 world 你好，世界！ café 👩‍👩‍👧 end",
    " 日本語のテキストと絵文字🎉🎉 mixed with ASCII, ñandú and Ελληνικά.",
    "🙂🙃🙂 back-to-back emoji, then 中文标点：“引号”。",
]
STOP = "###END###"


@pytest.fixture(scope="module")
def tokenizer():
    config = ModelConfig()
    return load_tokenizer(config, resolve_model(config))


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text  # byte-level BPE round-trips exactly
    return ids


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        chunks.append(ids[i : i + n])
        i += n
    return chunks


# ---- incremental detokenizer ---------------------------------------------------------


DETOKENIZERS = [IncrementalDetokenizer, StreamDetokenizer]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_incremental_detokenizer_multibyte(tokenizer, text, seed, detokenizer):
    rng = random.Random(seed)
    prompt = encode(tokenizer, "Question: say something.\nAnswer:")
    ids = encode(tokenizer, text)
    detok = detokenizer(tokenizer, prompt)
    chunks = random_chunks(rng, ids) if seed else [[t] for t in ids]
    deltas = []
    for i, chunk in enumerate(chunks):
        deltas.append(detok.add_tokens(chunk, final=i == len(chunks) - 1))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)
    # multi-byte characters span several tokens, so some steps must have waited
    assert "" in deltas


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_detokenizer_keeps_leading_space_of_first_token(tokenizer, detokenizer):
    prompt = encode(tokenizer, "The capital of France is")
    ids = encode(tokenizer, " Paris, of course.")
    detok = detokenizer(tokenizer, prompt)
    text = "".join(detok.add_tokens([t]) for t in ids)
    assert text == " Paris, of course."


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_detokenizer_skips_special_tokens(tokenizer, detokenizer):
    prompt = encode(tokenizer, "Hi")
    ids = encode(tokenizer, " there")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = detokenizer(tokenizer, prompt, skip_special_tokens=True)
    assert "".join(detok.add_tokens([t]) for t in [*ids, end]) == " there"
    keep = detokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert "".join(keep.add_tokens([t]) for t in [*ids, end]) == " there<|im_end|>"


@pytest.mark.parametrize("detokenizer", DETOKENIZERS)
def test_an_end_inside_a_character_keeps_the_complete_part(tokenizer, detokenizer):
    """Token 15107 is a space and the first bytes of an emoji: ending on it gives the space."""
    assert tokenizer.decode([15107]).startswith(" ") and tokenizer.decode([15107]).endswith("\ufffd")
    detok = detokenizer(tokenizer, encode(tokenizer, "Say:"))
    assert detok.add_tokens(encode(tokenizer, " hi")) == " hi"
    assert detok.add_tokens([15107], final=True) == " "
    assert detok.text == " hi "


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_detokenizer_is_chosen_and_falls_back_when_the_stream_refuses(tokenizer, text):
    """A tokenizers-backed tokenizer gets the stream; should the stream raise on a token (at any
    point, inside a multi-byte character too), the same request goes on with the Python
    detokenizer and the text is unchanged."""
    prompt = encode(tokenizer, "Say:")
    ids = encode(tokenizer, text)
    assert isinstance(new_detokenizer(tokenizer, prompt), StreamDetokenizer)

    class Refusing:
        def step(self, backend, token):
            raise Exception("Invalid prefix encountered")

    for cut in range(len(ids)):
        detok = StreamDetokenizer(tokenizer, prompt)
        deltas = [detok.add_tokens([t]) for t in ids[:cut]]
        detok._stream = Refusing()
        deltas += [detok.add_tokens([t], final=i == len(ids) - 1) for i, t in enumerate(ids) if i >= cut]
        assert detok._fallback is not None
        assert "".join(deltas) == detok.text == text, cut
        assert not any("\ufffd" in d for d in deltas)


# ---- output processor -----------------------------------------------------------------


def make_processor(tokenizer, request_id: str, prompt_ids: list[int], params: SamplingParams):
    processor = OutputProcessor(tokenizer)
    state = RequestState(request_id, "prompt", prompt_ids, params, tokenizer, 0.0)
    child_ids = processor.add_request(state)
    return processor, child_ids


def drive(processor, child_id: str, ids: list[int], delta: bool, final_reason: str = "length"):
    """Feed one token per step; returns (outputs, aborts per step)."""
    results, aborts = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput(child_id, [t], final_reason if last else None)
        outs, to_abort, _ = processor.process([out], delta=delta)
        results.extend(outs)
        aborts.append(to_abort)
    return results, aborts


STOP_TEXT = "The result is ready: 🦊 forty-two" + " " + STOP + " and text that must not appear"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates_exactly(tokenizer, include):
    prompt = encode(tokenizer, "Compute:")
    ids = encode(tokenizer, STOP_TEXT)
    stop_at = STOP_TEXT.index(STOP)
    expected = STOP_TEXT[: stop_at + len(STOP)] if include else STOP_TEXT[:stop_at]
    params = SamplingParams(max_tokens=100, stop=[STOP, "never-seen"], include_stop_str_in_output=include)
    processor, (child,) = make_processor(tokenizer, "r", prompt, params)
    results, aborts = drive(processor, child, ids, delta=False)
    final = results[-1]
    assert final.finished
    assert final.outputs[0].text == expected
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == STOP
    # the stop string spans several tokens, and it ended the request at the step of its last one
    stop_step = next(i for i, a in enumerate(aborts) if a)
    assert aborts[stop_step] == ["r"]
    assert sum(1 for a in aborts if a) == 1
    assert tokenizer.decode(ids[: stop_step + 1]).endswith(STOP)
    assert not tokenizer.decode(ids[:stop_step]).endswith(STOP)
    assert len(results) == stop_step + 1  # nothing more is reported for a finished request
    assert final.outputs[0].token_ids == ids[: stop_step + 1]
    assert "r" not in processor.requests
    # every non-final output is a prefix of the final text
    for r in results:
        assert expected.startswith(r.outputs[0].text)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_streaming_deltas(tokenizer, include):
    prompt = encode(tokenizer, "Compute:")
    ids = encode(tokenizer, STOP_TEXT)
    params = SamplingParams(max_tokens=100, stop=[STOP], include_stop_str_in_output=include)
    processor, (child,) = make_processor(tokenizer, "full", prompt, params)
    full_results, _ = drive(processor, child, ids, delta=False)
    expected = full_results[-1].outputs[0].text

    processor, (child,) = make_processor(tokenizer, "stream", prompt, params)
    results, aborts = drive(processor, child, ids, delta=True)
    deltas = [o.text for r in results for o in r.outputs]
    assert "".join(deltas) == expected
    assert sum(1 for a in aborts if a) == 1
    if not include:
        assert not any("#" in d for d in deltas)  # no part of the stop string ever leaks
    else:
        assert deltas[-1].endswith(STOP)
        assert not any("#" in d for d in deltas[:-1])
    streamed_ids = [t for r in results for o in r.outputs for t in o.token_ids]
    assert streamed_ids == full_results[-1].outputs[0].token_ids
    assert [r.finished for r in results][-1] is True
    assert not any(r.finished for r in results[:-1])
    assert results[-1].outputs[0].finish_reason == "stop"


def test_held_back_text_is_released_when_the_engine_finishes(tokenizer):
    """With stop strings set but never hit, streaming still delivers all text at the end."""
    prompt = encode(tokenizer, "Write:")
    text = MULTIBYTE_TEXTS[0] + " and a tail"
    ids = encode(tokenizer, text)
    params = SamplingParams(max_tokens=100, stop=["a-very-long-stop-string-that-never-appears"])
    processor, (child,) = make_processor(tokenizer, "r", prompt, params)
    results, aborts = drive(processor, child, ids, delta=True, final_reason="length")
    assert not any(aborts)
    assert "".join(o.text for r in results for o in r.outputs) == text
    assert results[-1].outputs[0].finish_reason == "length"
    assert not any("\ufffd" in o.text for r in results for o in r.outputs)


def test_stop_token_id_is_not_text(tokenizer):
    prompt = encode(tokenizer, "Hi")
    ids = encode(tokenizer, " there friend")
    stop_id = ids[-1]
    params = SamplingParams(max_tokens=10, stop_token_ids=[stop_id])
    processor, (child,) = make_processor(tokenizer, "r", prompt, params)
    for t in ids[:-1]:
        processor.process([EngineCoreOutput(child, [t])], delta=False)
    outs, _, finished = processor.process([EngineCoreOutput(child, [stop_id], "stop", stop_id)], delta=False)
    assert outs[0].outputs[0].text == tokenizer.decode(ids[:-1])
    assert outs[0].outputs[0].token_ids == ids
    assert outs[0].outputs[0].stop_reason == stop_id
    assert finished and finished[0].request_id == "r"


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_even_with_special_tokens_shown(tokenizer, include):
    """A choice ended by EOS (the engine's finish "stop", no stop_reason) does not show the EOS
    token's text with skip_special_tokens false, unless include_stop_str_in_output (as vLLM)."""
    prompt = encode(tokenizer, "Hi")
    ids = encode(tokenizer, " there friend")
    eos = tokenizer.eos_token_id
    eos_text = tokenizer.decode([eos], skip_special_tokens=False)
    params = SamplingParams(max_tokens=10, skip_special_tokens=False, include_stop_str_in_output=include)
    processor, (child,) = make_processor(tokenizer, "r", prompt, params)
    for t in ids:
        processor.process([EngineCoreOutput(child, [t])], delta=False)
    outs, _, _ = processor.process([EngineCoreOutput(child, [eos], "stop")], delta=False)
    text = tokenizer.decode(ids)
    assert outs[0].outputs[0].text == (text + eos_text if include else text)
    assert outs[0].outputs[0].token_ids == [*ids, eos]  # the token itself is reported, as vLLM does


def test_stop_strings_wait_for_min_tokens(tokenizer):
    """A stop string completed within the first min_tokens tokens does not end the choice (as vLLM);
    one completed after them does."""
    prompt = encode(tokenizer, "Count:")
    ids = encode(tokenizer, "one two one two one two one two")
    params = SamplingParams(max_tokens=50, stop=["two"], min_tokens=5)
    processor, (child,) = make_processor(tokenizer, "r", prompt, params)
    results, aborts = drive(processor, child, ids, delta=False)
    stop_step = next(i for i, a in enumerate(aborts) if a)
    assert stop_step >= 5  # "two" first completes at the second token: ignored there
    final = results[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "two"
    assert final.text == tokenizer.decode(ids[: stop_step + 1])[: -len("two")]


@pytest.mark.parametrize("delta", [False, True])
def test_two_choices_aggregate_into_one_output(tokenizer, delta):
    prompt = encode(tokenizer, "Pick a word:")
    texts = [" apple pie 🍎", " 香蕉 banana split"]
    seqs = [encode(tokenizer, t) for t in texts]
    params = SamplingParams(n=2, max_tokens=100)
    processor, child_ids = make_processor(tokenizer, "req", prompt, params)
    assert child_ids == ["req#0", "req#1"]
    collected: dict[int, list[str]] = {0: [], 1: []}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish_reports: dict[int, list[str]] = {0: [], 1: []}
    results = []
    for i in range(max(len(s) for s in seqs)):
        batch = [
            EngineCoreOutput(child_ids[c], [seq[i]], "length" if i == len(seq) - 1 else None)
            for c, seq in enumerate(seqs)
            if i < len(seq)
        ]
        outs, to_abort, _ = processor.process(batch, delta=delta)
        assert not to_abort
        assert len(outs) == 1 and outs[0].request_id == "req"
        results.append(outs[0])
        indices = [o.index for o in outs[0].outputs]
        assert indices == sorted(set(indices)) and set(indices) <= {0, 1}
        for o in outs[0].outputs:
            if delta:
                collected[o.index].append(o.text)
                tokens[o.index].extend(o.token_ids)
            if o.finish_reason is not None:
                finish_reports[o.index].append(o.finish_reason)
    final = results[-1]
    assert final.finished
    assert not any(r.finished for r in results[:-1])
    if delta:
        # each choice's deltas add up to its text, and each reports its finish exactly once
        assert ["".join(collected[c]) for c in (0, 1)] == texts
        assert [tokens[c] for c in (0, 1)] == seqs
        assert finish_reports == {0: ["length"], 1: ["length"]}
    else:
        assert all(len(r.outputs) == 2 for r in results)
        assert [o.index for o in final.outputs] == [0, 1]
        assert [o.text for o in final.outputs] == texts
        assert [o.token_ids for o in final.outputs] == seqs
        assert all(o.finish_reason == "length" for o in final.outputs)
    assert "req" not in processor.requests


@pytest.mark.parametrize("stop", [[], [STOP]])
def test_final_only_reports_just_the_finished_output_the_cumulative_mode_ends_with(tokenizer, stop):
    """Offline generation asks for finished outputs only: no output until a request
    finishes, then the same one the cumulative mode ends with (stop strings included)."""
    prompt = encode(tokenizer, "Compute:")
    ids = encode(tokenizer, STOP_TEXT)
    params = SamplingParams(max_tokens=100, stop=stop)
    finals = []
    for final_only in (False, True):
        processor, (child,) = make_processor(tokenizer, "r", prompt, params)
        reported = []
        for i, t in enumerate(ids):
            reason = "length" if i == len(ids) - 1 else None
            outs, _, finished = processor.process(
                [EngineCoreOutput(child, [t], reason)], False, None, final_only
            )
            reported.append(outs)
            if finished:
                break
        if final_only:
            assert all(not outs for outs in reported[:-1])
        assert len(reported[-1]) == 1 and reported[-1][0].finished
        finals.append(reported[-1][0])
    cumulative, final_only = finals
    assert final_only.outputs[0].text == cumulative.outputs[0].text
    assert final_only.outputs[0].token_ids == cumulative.outputs[0].token_ids
    assert (
        final_only.outputs[0].finish_reason
        == cumulative.outputs[0].finish_reason
        == ("stop" if stop else "length")
    )


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("end", ["length", "stop_token", "abort"])
def test_final_only_text_decoded_once_equals_the_incremental_text(tokenizer, text, end):
    """Without stop strings a final-only output's text is decoded once, when the choice ends: the
    same text as decoding step by step, cut inside a multi-byte character (no U+FFFD), after a stop
    token (not text), or aborted by the front end halfway (the text so far)."""
    prompt = encode(tokenizer, "Say:")
    ids = encode(tokenizer, text)
    cut = ids[: max(1, len(ids) - 1)]  # the last token may end inside a character
    texts = []
    for final_only in (False, True):
        processor, (child,) = make_processor(tokenizer, "r", prompt, SamplingParams(max_tokens=100))
        outs: list = []
        steps = cut[: len(cut) // 2] if end == "abort" else cut
        for i, t in enumerate(steps):
            last = i == len(steps) - 1 and end != "abort"
            if last and end == "stop_token":
                out = EngineCoreOutput(child, [t, tokenizer.eos_token_id], "stop", tokenizer.eos_token_id)
            else:
                out = EngineCoreOutput(child, [t], "length" if last else None)
            outs, _, _ = processor.process([out], False, None, final_only)
        if end == "abort":
            state = processor.requests["r"]
            processor.abort_request("r")
            texts.append(state.choices[0].text)
            continue
        texts.append(outs[0].outputs[0].text)
    assert texts[0] == texts[1] and texts[1]
    assert "\ufffd" not in texts[1]
