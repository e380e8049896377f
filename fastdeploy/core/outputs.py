"""Results handed to users of the offline API and the API server."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy.core.timeline import RequestTimeline


@dataclass
class Logprob:
    """The log-probability of one token under the raw model logits, and its rank (1 = most likely)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence (one of the ``n`` choices of a request)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``stop``, ``length`` or ``abort``; None while still generating."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the sequence, if any."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per token of ``token_ids`` (when asked): the sampled token first, then the top-N, by id."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    In streaming use ``outputs[i].text`` / ``token_ids`` hold the delta since the
    previous ``RequestOutput``; otherwise they hold everything generated so far.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``prompt_logprobs`` asked: aligned with ``prompt_token_ids``, None for the first token,
    else the token itself and the top-k by id. In streaming use only the first output carries it."""
    embedding: list[float] | None = None
    """An embedding request's pooled vector (pooling runner), in the finished output; ``outputs``
    then holds one choice with no tokens."""
    metrics: dict[str, float] = field(default_factory=dict)
    timeline: RequestTimeline | None = None
    """The request's timeline (the same object in every output of the request; API server only)."""
    sent_at: float | None = None
    """``time.monotonic()`` when the engine core sent the step output this delta came from."""


@dataclass
class EmbeddingOutput:
    """The pooled vector of one input."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of one input of ``LLM.embed`` (as vLLM's)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def merge_delta_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Fold the streaming delta ``later`` into ``first`` (in place; returns ``first``).

    A consumer that fell behind the engine takes the deltas waiting for it as one: texts,
    token ids and logprobs joined per choice, the later finish state and counts kept,
    prompt logprobs from whichever carried them (only one does), the earlier engine send time.
    """
    by_index = {c.index: c for c in first.outputs}
    for c in later.outputs:
        mine = by_index.get(c.index)
        if mine is None:
            first.outputs.append(c)
            by_index[c.index] = c
            continue
        mine.text += c.text
        mine.token_ids = mine.token_ids + c.token_ids
        if c.logprobs is not None:
            mine.logprobs = (mine.logprobs or []) + c.logprobs
        if c.finish_reason is not None:
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
    first.finished = later.finished
    first.num_cached_tokens = later.num_cached_tokens
    if first.prompt_logprobs is None:
        first.prompt_logprobs = later.prompt_logprobs
    if later.embedding is not None:
        first.embedding = later.embedding
    return first
