"""Prompt logprobs on their way from the worker to the user.

The worker sends, per step and request, the logprobs of the prompt tokens that
this step's prefill chunk predicts (``[first prompt index, entries]``, each
entry ``[top ids, top logprobs, token logprob, token rank]`` like sampled
logprobs). The engine core gathers them in a :class:`PromptLogprobsBuffer`
(dropping repeats after a preemption recomputes the prompt) and sends the
whole list once, with the request's first output. The front end turns it into
``RequestOutput.prompt_logprobs`` with :func:`to_prompt_logprobs`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastdeploy.core.outputs import Logprob

logger = logging.getLogger(__name__)

PromptLogprobsEntry = list
"""``[top ids, top logprobs, token logprob, token rank]`` of one prompt token (msgpack-friendly)."""


class PromptLogprobsBuffer:
    """The prompt logprobs of one engine-core request, gathered over its prefill chunks.

    Entry ``i`` belongs to prompt token ``i + 1`` (the first prompt token has
    none). ``add`` takes a chunk that starts at any prompt index: entries it
    already holds (a prefill recomputed after a preemption) are skipped.
    """

    def __init__(self, num_prompt_tokens: int):
        self.num_prompt_tokens = num_prompt_tokens
        self.entries: list[PromptLogprobsEntry] = []
        self.sent = False

    @property
    def complete(self) -> bool:
        """Whether every prompt token after the first has its entry."""
        return len(self.entries) >= self.num_prompt_tokens - 1

    @property
    def needed(self) -> bool:
        """Whether the worker must still compute prompt logprobs (and the prefix cache must be bypassed)."""
        return not self.sent and not self.complete

    def add(self, first_index: int, entries: Sequence[PromptLogprobsEntry]) -> None:
        """Append the entries of prompt tokens ``first_index, first_index + 1, ...`` not held yet."""
        if self.sent:
            return
        expected = len(self.entries) + 1
        if first_index > expected:
            logger.warning(
                "prompt logprobs gap: got prompt index %d, expected %d; entries dropped",
                first_index,
                expected,
            )
            return
        self.entries.extend(entries[expected - first_index :])

    def take(self) -> list[PromptLogprobsEntry] | None:
        """The entries, once (later calls return None); sent with the request's first output."""
        if self.sent:
            return None
        self.sent = True
        entries, self.entries = self.entries, []
        return entries


def _decoder(tokenizer: Any, token_ids: set[int]) -> dict[int, str | None]:
    """Each token id decoded alone (one batched call when the tokenizer supports it)."""
    ids = sorted(token_ids)
    if tokenizer is None:
        return dict.fromkeys(ids)
    batch_decode = getattr(tokenizer, "batch_decode", None)
    if batch_decode is not None:
        return dict(zip(ids, batch_decode([[t] for t in ids])))
    return {t: tokenizer.decode([t]) for t in ids}


def to_prompt_logprobs(
    prompt_token_ids: list[int], entries: Sequence[PromptLogprobsEntry], tokenizer: Any
) -> list[dict[int, Logprob] | None]:
    """A list aligned with the prompt: None for the first token, then ``{token id: Logprob}``.

    Each dict holds the prompt token itself (with its rank) and the top-k
    alternatives (ranks 1..k), like sampled logprobs. Missing entries (which
    only a dropped chunk could cause) are None.
    """
    ids = set(prompt_token_ids)
    for top_ids, *_ in entries:
        ids.update(top_ids)
    text = _decoder(tokenizer, ids)
    result: list[dict[int, Logprob] | None] = [None]
    for token, (top_ids, top_lps, token_lp, rank) in zip(prompt_token_ids[1:], entries):
        entry = {token: Logprob(token_lp, rank, text[token])}
        for i, (tid, lp) in enumerate(zip(top_ids, top_lps)):
            if tid not in entry:
                entry[tid] = Logprob(lp, i + 1, text[tid])
        result.append(entry)
    result.extend([None] * (len(prompt_token_ids) - len(result)))
    return result
