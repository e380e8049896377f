"""The step hand-offs: ``SchedulerOutput`` (engine core → workers), ``ModelRunnerOutput`` (back); msgpack-friendly."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastdeploy.core.pooling_params import PoolingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


class StopCode(enum.IntEnum):
    """Why a request ends with the token just sampled (``RUNNING``: it goes on).

    Decided once, by the worker's stop check on the device (``worker/step_state.py``), and
    carried per row in :attr:`ModelRunnerOutput.stopped`; the scheduler finishes requests from
    it. Stop strings need text and stay in the front end.
    """

    RUNNING = 0
    EOS = 1
    """An end-of-sequence id (finish reason ``stop``, no stop reason)."""
    STOP_TOKEN = 2
    """One of ``stop_token_ids`` (finish reason ``stop``; the token is the stop reason)."""
    LENGTH = 3
    """``max_tokens`` outputs or ``max_model_len`` tokens (finish reason ``length``)."""


def reaches_length_limit(
    num_output_tokens: int | np.ndarray,
    num_tokens: int | np.ndarray,
    max_tokens: int | np.ndarray | None,
    max_model_len: int,
) -> bool | np.ndarray:
    """Whether a request with ``num_output_tokens`` outputs and ``num_tokens`` tokens in all can take
    no further token: ``max_tokens`` outputs (None: no limit) or ``max_model_len`` tokens.

    The one length rule, elementwise on numpy arrays: the worker's stop check applies it to
    the token just sampled, the scheduler to the tokens still in flight (async scheduling) so
    that it schedules nothing past the limit.
    """
    if max_tokens is None:
        return num_tokens >= max_model_len
    return (num_output_tokens >= max_tokens) | (num_tokens >= max_model_len)


@dataclass
class WorkerSamplingParams:
    """The sampling and stop controls of one request that a worker needs, with their defaults.

    Built by the scheduler from the request's ``SamplingParams`` and sent once, in
    :class:`NewRequestData`; the worker's ``InputBatch`` keeps them per slot.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0): no top-k."""
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    """Token id → bias added to its logit."""
    bad_words_token_ids: list[list[int]] | None = None
    """Token sequences never to generate."""
    min_tokens: int = 0
    """Outputs before an EOS or stop token id may end the request (those ids are banned until then)."""
    max_tokens: int | None = None
    """Outputs allowed (None: up to ``max_model_len``); with 0 the prefill's token is dropped."""
    eos_token_ids: list[int] = field(default_factory=list)
    """End-of-sequence ids that end the request (empty with ``ignore_eos``)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Further ids that end the request (reported as its stop reason)."""
    logprobs: int | None = None
    """Top logprobs wanted per sampled token (None: no logprobs)."""
    prompt_logprobs: int | None = None
    """Top logprobs wanted per prompt token (None: none, or already sent before a preemption)."""


@dataclass
class NewRequestData:
    """A request the worker has not seen (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]
    """Every known token: the prompt, plus outputs generated before a preemption."""
    num_prompt_tokens: int
    sampling: WorkerSamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_items: list[dict[str, Any]] | None = None
    """Multimodal items in wire form; ``features`` only where the worker lacks them, ``cached``
    whether the worker keeps them after the request (see ``scheduler/encoder_sync.py``)."""
    pooling: PoolingParams | None = None
    """An embedding request's pooling (pooling runner): its prompt is pooled, not sampled."""

    def to_wire(self) -> dict[str, Any]:
        """``dataclasses.asdict`` form without its deep copies (packed at once, never kept)."""
        return {
            **vars(self),
            "sampling": vars(self.sampling),
            "pooling": vars(self.pooling) if self.pooling is not None else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> NewRequestData:
        """Rebuild from ``dataclasses.asdict`` form (as decoded from msgpack)."""
        pooling = PoolingParams(**d["pooling"]) if d.get("pooling") else None
        return cls(**{**d, "sampling": WorkerSamplingParams(**d["sampling"]), "pooling": pooling})


@dataclass
class CachedRequestData:
    """Deltas for requests the worker already holds."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit ``t % 32`` of word ``t // 32`` allows token t)."""
    return (vocab_size + 31) // 32


@dataclass
class GrammarBitmask:
    """The tokens each structured-output request may sample next: one bitmask row per request.

    Bit ``t % 32`` of int32 word ``t // 32`` of a row allows token ``t``; rows are in ``req_ids``
    order (the worker maps them to its sampled rows). Built by the engine core's grammar matchers.
    """

    req_ids: list[str]
    bitmask: bytes | np.ndarray
    """``[len(req_ids), words]`` int32, native byte order: the manager's array as it filled it
    (in one process no copy is made), bytes once it has crossed a process boundary."""
    words: int
    tensor: torch.Tensor | None = None
    """In one process: the host tensor ``bitmask`` views, pinned when the worker runs on a GPU, so
    that the worker copies it to the device directly (no staging copy). Not sent to a worker process."""

    def array(self) -> np.ndarray:
        """The bitmask as an ``[rows, words]`` int32 array (the array itself, or a view of the bytes)."""
        import numpy as np

        if isinstance(self.bitmask, np.ndarray):
            return self.bitmask
        return np.frombuffer(self.bitmask, dtype=np.int32).reshape(len(self.req_ids), self.words)

    def to_wire(self) -> dict[str, Any]:
        """Its fields for msgpack (which packs the array's buffer as bytes, without a copy here)."""
        bitmask = self.bitmask if isinstance(self.bitmask, bytes) else memoryview(self.bitmask)
        return {"req_ids": self.req_ids, "bitmask": bitmask, "words": self.words}


@dataclass
class SchedulerOutput:
    """One step: which requests run, how many tokens each, and what changed."""

    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    """Requests finished, aborted or preempted since the last step: drop their state."""
    evicted_mm_hashes: list[str] = field(default_factory=list)
    """Multimodal features evicted from the encoder cache: the worker drops them (before adding
    this step's new requests)."""
    structured_req_ids: list[str] = field(default_factory=list)
    """Requests with a grammar that sample a token this step: their rows need a bitmask."""
    grammar: GrammarBitmask | None = None
    """Their bitmask, when known at scheduling time (no step in flight). With async scheduling it
    depends on the token still in flight, so it comes after that step's output, through
    ``sample_tokens``; the worker waits for it before sampling."""

    def to_wire(self) -> dict[str, Any]:
        """The ``dataclasses.asdict`` form, built shallowly: the lists are packed as they are (the
        executor encodes the message at once), not deep-copied first as ``asdict`` would, which
        cost the engine core ~10% of its per-step time at 256 requests (docs/benchmarks.md)."""
        return {
            **vars(self),
            "new_reqs": [r.to_wire() for r in self.new_reqs],
            "cached_reqs": vars(self.cached_reqs),
            "grammar": self.grammar.to_wire() if self.grammar is not None else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SchedulerOutput:
        return cls(
            step_id=d["step_id"],
            new_reqs=[NewRequestData.from_wire(r) for r in d["new_reqs"]],
            cached_reqs=CachedRequestData(**d["cached_reqs"]),
            num_scheduled_tokens=d["num_scheduled_tokens"],
            total_num_scheduled_tokens=d["total_num_scheduled_tokens"],
            finished_req_ids=d["finished_req_ids"],
            evicted_mm_hashes=d.get("evicted_mm_hashes", []),
            structured_req_ids=d.get("structured_req_ids", []),
            grammar=GrammarBitmask(**d["grammar"]) if d.get("grammar") else None,
        )


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests that produced one, and whether each ends there."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    stopped: list[int]
    """Per row, the worker's :class:`StopCode` for its token (0 while the request goes on): the
    scheduler finishes requests from it and re-checks nothing."""
    logprobs: list[list | None] | None = None
    """Aligned with ``req_ids`` when any row asked for logprobs: ``[top ids, top logprobs,
    sampled logprob, sampled rank]`` or None per row."""
    prompt_logprobs: dict[str, list] | None = None
    """Requests that asked for prompt logprobs and prefilled this step → ``[first prompt index,
    entries]``: one entry ``[top ids, top logprobs, token logprob, token rank]`` per prompt token
    that this step's positions predict (index 1 is the second prompt token)."""
    moe_load_imbalance: float | None = None
    """Mixture-of-experts models: max / mean of the (token, expert) pairs routed per expert-parallel
    rank (per expert without expert parallelism) in this step, over all MoE layers."""
    pooled: dict[str, bytes] | None = None
    """Pooling runner: the embedding requests whose prefill ended this step → their pooled vector
    (float32, native byte order); those requests are finished by it."""

    def to_wire(self) -> dict[str, Any]:
        """Its fields as they are (all plain values; encoded at once, no ``asdict`` copies)."""
        return dict(vars(self))

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ModelRunnerOutput:
        return cls(**d)
