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
