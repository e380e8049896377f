"""Requests as the engine core sees them, and the messages that cross process borders.

``EngineCoreRequest`` / ``EngineCoreOutputs`` are plain data that travel over ZMQ
(msgpack); ``Request`` is the engine core's mutable bookkeeping for one sequence.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.prompt_logprobs import PromptLogprobsBuffer
from fastdeploy.core.sampling_params import SamplingParams, StructuredOutputsParams


class FinishReason(str, enum.Enum):
    """Why a sequence ended; the value is what the OpenAI API reports."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


def longest_prompt(max_model_len: int, pooling: bool, max_tokens: int | None) -> int:
    """The most prompt tokens a request may have: the whole context for an embedded prompt or one
    only scored (``max_tokens == 0``), else one fewer (room for one output token)."""
    return max_model_len if pooling or max_tokens == 0 else max_model_len - 1


@dataclass
class EngineCoreRequest:
    """A tokenized request sent from the front end to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    mm_items: list[dict[str, Any]] | None = None
    """Multimodal items in wire form (:meth:`fastdeploy.core.mm_item.MMItem.to_wire`); over IPC an
    item the engine core already holds comes without features (see ``engine/feature_mirror.py``)."""
    pooling_params: PoolingParams | None = None
    """Set for an embedding request (pooling runner): pool the prompt, sample nothing."""

    def to_wire(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineCoreRequest:
        d = dict(d)
        sp = dict(d["sampling_params"])
        if sp.get("structured_outputs") is not None:
            sp["structured_outputs"] = StructuredOutputsParams(**sp["structured_outputs"])
        d["sampling_params"] = SamplingParams(**sp)
        if d.get("pooling_params") is not None:
            d["pooling_params"] = PoolingParams(**d["pooling_params"])
        return cls(**d)


@dataclass
class EngineCoreOutput:
    """New tokens of one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None
    """Seconds from arrival to first scheduling; sent with the first token only."""
    error: str | None = None
    """Set when the engine failed this request (it is finished with reason abort)."""
    logprobs: list[list] | None = None
    """Per new token: ``[top ids, top logprobs, sampled logprob, sampled rank]`` (when asked)."""
    prompt_logprobs: list[list] | None = None
    """Sent once, with the first output: per prompt token after the first, ``[top ids, top
    logprobs, token logprob, token rank]`` (when ``prompt_logprobs`` was asked)."""
    pooled: bytes | None = None
    """An embedding request's pooled vector (float32, native byte order), sent with its finish."""


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished generation request (all its choices), for the per-request histograms; times in
    seconds, None where the request never reached that point (aborted while waiting, say)."""

    prompt_tokens: int
    generation_tokens: int
    """Output tokens of all its choices."""
    n: int
    max_tokens: int | None
    prefill_time: float | None
    """First scheduled to first token."""
    decode_time: float | None
    """First token to the last one."""
    inference_time: float | None
    """First scheduled to finish."""


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the last snapshot."""
    prefix_cache_hits: int = 0
    """Of those, tokens found in the cache."""
    num_preemptions: int = 0
    encoder_cache_hits: int = 0
    """Multimodal items whose features the worker already held (not sent again)."""
    encoder_cache_misses: int = 0
    """Multimodal items whose features were sent to the worker."""
    moe_load_imbalance: float | None = None
    """Mixture-of-experts models: the last step's max / mean routed tokens per expert-parallel rank
    (per expert without expert parallelism); None for dense models or before any step."""

    def accumulate(self, newer: SchedulerStats) -> None:
        """Take ``newer``'s gauges and add its per-interval counters to ours."""
        self.num_running, self.num_waiting = newer.num_running, newer.num_waiting
        self.kv_cache_usage = newer.kv_cache_usage
        if newer.moe_load_imbalance is not None:
            self.moe_load_imbalance = newer.moe_load_imbalance
        self.prefix_cache_queries += newer.prefix_cache_queries
        self.prefix_cache_hits += newer.prefix_cache_hits
        self.num_preemptions += newer.num_preemptions
        self.encoder_cache_hits += newer.encoder_cache_hits
        self.encoder_cache_misses += newer.encoder_cache_misses


@dataclass
class EngineCoreOutputs:
    """Everything one engine step produced: token deltas plus a stats snapshot."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats | None = None
    timestamp: float = field(default_factory=time.time)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly dict: every output as one row of its fields in declaration order
        (:func:`outputs_to_rows`), not a dict of names: a step of 256 requests is one small frame,
        packed and unpacked without a per-field key or a deep copy."""
        return {
            "outputs": outputs_to_rows(self.outputs),
            "stats": dataclasses.asdict(self.stats) if self.stats is not None else None,
            "timestamp": self.timestamp,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineCoreOutputs:
        return cls(
            outputs=outputs_from_rows(d["outputs"]),
            stats=SchedulerStats(**d["stats"]) if d.get("stats") else None,
            timestamp=d["timestamp"],
        )


_OUTPUT_ROW = operator.attrgetter(*(f.name for f in dataclasses.fields(EngineCoreOutput)))
"""One :class:`EngineCoreOutput` → the tuple of its fields in declaration order (in C)."""


def outputs_to_rows(outputs: list[EngineCoreOutput]) -> list[tuple]:
    """The wire form of a step's outputs: one tuple of field values per output (no copies)."""
    return [_OUTPUT_ROW(o) for o in outputs]


def outputs_from_rows(rows: list) -> list[EngineCoreOutput]:
    """Back from :func:`outputs_to_rows` (msgpack turns the tuples into lists)."""
    return [EngineCoreOutput(*row) for row in rows]


class GrammarState(Protocol):
    """A request's grammar matcher as the scheduler sees it (``structured_output.RequestGrammar``)."""

    def accept_token(self, token_id: int) -> None:
        """Advance past an output token."""


class Request:
    """One sequence inside the engine core: its tokens, progress and status."""

    def __init__(
        self, core_request: EngineCoreRequest, block_size: int, mm_items: list[MMItem] | None = None
    ):
        """``mm_items``: the request's multimodal items with features, when already decoded
        (by the engine core's :class:`~fastdeploy.engine.feature_mirror.FeatureMirror`)."""
        self.request_id = core_request.request_id
        self.sampling_params = core_request.sampling_params
        self.eos_token_ids = set(core_request.eos_token_ids)
        self.arrival_time = core_request.arrival_time
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        """Tokens being sampled by steps in flight (async scheduling): scheduled, not yet known."""
        self.first_scheduled_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.block_size = block_size
        self.block_hashes: list[bytes] = []
        """Chained hashes of this request's full blocks (grown as tokens arrive)."""
        if mm_items is None:
            mm_items = [MMItem.from_wire(wire) for wire in core_request.mm_items or []]
        self.mm_items = mm_items
        """Multimodal items of the prompt, with their features (held until the request finishes)."""
        self.mm_extra_keys: list[tuple[int, int, str]] = [(i.offset, i.end, i.mm_hash) for i in self.mm_items]
        """(start, end, mm_hash) of multimodal items, for block hashing."""
        self.prompt_logprobs: PromptLogprobsBuffer | None = (
            None
            if self.sampling_params.prompt_logprobs is None
            else PromptLogprobsBuffer(self.num_prompt_tokens)
        )
        """Prompt logprobs gathered over the prefill chunks (None: not asked)."""
        self.pooling_params = core_request.pooling_params
        """Set for an embedding request: finished after its prefill, with the pooled vector."""
        self.grammar: GrammarState | None = None
        """The matcher of a structured-output request (set by the engine core once its grammar is
        compiled); advanced with every output token."""
        self.awaiting_grammar = False
        """A structured-output request whose grammar is being compiled: its prompt is prefilled
        meanwhile, all but the last token (whose step samples the first output token, under the
        grammar), so that the compile overlaps the prefill."""

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked and not all computed yet: the prompt must be computed, not cached."""
        return self.prompt_logprobs is not None and self.prompt_logprobs.needed

    @property
    def needs_every_prompt_position(self) -> bool:
        """Every prompt position must go through the model (prompt logprobs still to compute, or
        mean pooling): the request reads nothing from the prefix cache."""
        if self.pooling_params is not None and self.pooling_params.needs_every_position:
            return True
        return self.needs_prompt_logprobs

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
