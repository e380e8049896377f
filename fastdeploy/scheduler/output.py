"""What the scheduler sends to the workers each step (compact, msgpack-friendly)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """A request the worker has not seen (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]
    """Every known token: the prompt, plus outputs generated before a preemption."""
    num_prompt_tokens: int
    sampling: dict[str, Any]
    """The worker-side sampling fields (see ``WORKER_SAMPLING_FIELDS``) plus ``min_tokens_stop_ids``."""
    block_ids: list[int]
    num_computed_tokens: int
    mm_items: list[dict[str, Any]] | None = None
    """Multimodal items in wire form; ``features`` only where the worker lacks them, ``cached``
    whether the worker keeps them after the request (see ``scheduler/encoder_sync.py``)."""


@dataclass
class CachedRequestData:
    """Deltas for requests the worker already holds."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


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

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SchedulerOutput:
        return cls(
            step_id=d["step_id"],
            new_reqs=[NewRequestData(**r) for r in d["new_reqs"]],
            cached_reqs=CachedRequestData(**d["cached_reqs"]),
            num_scheduled_tokens=d["num_scheduled_tokens"],
            total_num_scheduled_tokens=d["total_num_scheduled_tokens"],
            finished_req_ids=d["finished_req_ids"],
            evicted_mm_hashes=d.get("evicted_mm_hashes", []),
        )


@dataclass
class ModelRunnerOutput:
    """Tokens sampled in one step, for the requests that produced one."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[list | None] | None = None
    """Aligned with ``req_ids`` when any row asked for logprobs: ``[top ids, top logprobs,
    sampled logprob, sampled rank]`` or None per row."""
    prompt_logprobs: dict[str, list] | None = None
    """Requests that asked for prompt logprobs and prefilled this step → ``[first prompt index,
    entries]``: one entry ``[top ids, top logprobs, token logprob, token rank]`` per prompt token
    that this step's positions predict (index 1 is the second prompt token)."""
    stopped: list[bool] | None = None
    """Per row, whether the device-side stop check (EOS / stop ids once min_tokens are out,
    max_tokens, max_model_len) ends the request; the scheduler's host check stays authoritative."""

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ModelRunnerOutput:
        return cls(**d)
