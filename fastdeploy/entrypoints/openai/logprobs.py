"""Engine logprobs → the two OpenAI response formats.

Chat (``logprobs: true`` + ``top_logprobs: N``): ``{"content": [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}``. Legacy completions
(``logprobs: N``): ``{tokens, token_logprobs, top_logprobs, text_offset}``.
Token strings are each token decoded alone, or ``token_id:N`` with ``as_ids`` (vLLM's
``return_tokens_as_token_ids``); ``-inf`` becomes -9999.0 (JSON has no infinity), as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from fastdeploy.core.outputs import Logprob
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
)


def _finite(value: float) -> float:
    return max(value, -9999.0) if not math.isnan(value) else -9999.0


def _token_str(token: int, lp: Logprob, as_ids: bool = False) -> str:
    return lp.decoded_token if lp.decoded_token is not None and not as_ids else f"token_id:{token}"


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int, as_ids: bool = False
) -> ChatCompletionLogProbs:
    """The ``logprobs`` object of a chat choice (or of one streamed delta)."""
    content = []
    for token, entry in zip(token_ids, logprobs):
        sampled = entry[token]
        text = _token_str(token, sampled, as_ids)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
        top = [(t, lp) for t, lp in top if lp.rank <= num_top][:num_top]
        content.append(
            ChatCompletionLogProbsContent(
                token=text,
                logprob=_finite(sampled.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    ChatCompletionLogProb(
                        token=_token_str(t, lp, as_ids),
                        logprob=_finite(lp.logprob),
                        bytes=list(_token_str(t, lp, as_ids).encode()),
                    )
                    for t, lp in top
                ],
            )
        )
    return ChatCompletionLogProbs(content=content)


def completion_logprobs(
    token_ids: list[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num_top: int,
    text_offset: int,
    decode: Callable[[int], str] | None = None,
    as_ids: bool = False,
) -> CompletionLogProbs:
    """The legacy ``logprobs`` object; ``text_offset`` is where the first token's text starts.

    Each ``top_logprobs`` entry holds the sampled token and the ``num_top``
    most likely ones. A None entry (the first prompt token of an echoed prompt,
    which nothing predicts) gives a null ``token_logprob`` and ``top_logprobs``;
    its text comes from ``decode``.
    """
    out = CompletionLogProbs()
    offset = text_offset
    for token, entry in zip(token_ids, logprobs):
        if entry is None:
            text = decode(token) if decode is not None and not as_ids else f"token_id:{token}"
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(text)
            continue
        sampled = entry[token]
        text = _token_str(token, sampled, as_ids)
        out.tokens.append(text)
        out.token_logprobs.append(_finite(sampled.logprob))
        out.text_offset.append(offset)
        offset += len(text)
        out.top_logprobs.append(_top_logprobs(token, entry, num_top, as_ids))
    return out


def _top_logprobs(token: int, entry: dict[int, Logprob], num_top: int, as_ids: bool) -> dict[str, float]:
    """A legacy ``top_logprobs`` entry: the ``num_top`` most likely tokens and, always, the sampled
    one (OpenAI: "up to logprobs+1 elements"; with ``logprobs: 0`` just the sampled token). The
    sampled token comes first, then the others most likely first, as vLLM orders them (its clients
    read the first key as the chosen token).

    The keys are token texts, and different tokens can have the same text (the byte tokens of a
    character split in pieces all decode to "\\ufffd"). Such tokens share one key, which holds the
    largest of their logprobs: a later, less likely token must not overwrite the sampled token's
    value (or a more likely one's), or a client comparing ``token_logprobs[i]`` with
    ``max(top_logprobs[i].values())`` (lm-evaluation-harness's greedy check) gets it wrong."""
    others = [(t, lp) for t, lp in entry.items() if t != token and lp.rank is not None and lp.rank <= num_top]
    others.sort(key=lambda x: -x[1].logprob)
    top: dict[str, float] = {}
    for t, lp in [(token, entry[token]), *others]:
        key, value = _token_str(t, lp, as_ids), _finite(lp.logprob)
        if key not in top or value > top[key]:
            top[key] = value
    return top


def prompt_logprobs_json(
    prompt_token_ids: list[int], prompt_logprobs: Sequence[dict[int, Logprob] | None], num_top: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or token id → logprob, rank, text.

    Each dict holds the prompt token and the alternatives ranked ``1..num_top``
    (the engine may have computed more, for an echo with a larger ``logprobs``).
    """
    out: PromptLogprobs = []
    for token, entry in zip(prompt_token_ids, prompt_logprobs):
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(t): PromptLogprob(
                    logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
                )
                for t, lp in entry.items()
                if t == token or (lp.rank is not None and lp.rank <= num_top)
            }
        )
    return out
