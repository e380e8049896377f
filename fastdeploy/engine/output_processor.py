"""Front-end bookkeeping of requests: detokenization, stop strings, n choices, outputs.

Runs in the process that talks to users (the offline ``LLM`` or the API server),
so the engine core only ever deals in token ids.
"""

from __future__ import annotations

import array
import time
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.core.outputs import CompletionOutput, Logprob, RequestOutput
from fastdeploy.core.prompt_logprobs import to_prompt_logprobs
from fastdeploy.core.request import EngineCoreOutput, FinishedRequestStats
from fastdeploy.core.sampling_params import SamplingParams
from fastdeploy.core.timeline import RequestTimeline
from fastdeploy.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, new_detokenizer


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Engine-core id of choice ``index`` of a request with ``n`` choices."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class ChoiceState:
    """One choice of a request, as seen by the front end."""

    index: int
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    sent_token_len: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_reported: bool = False
    last_token_time: float | None = None
    undecoded: int = 0
    """Trailing entries of ``token_ids`` not yet detokenized (final-only outputs decode once, at the end)."""


@dataclass
class RequestTimes:
    """Timestamps for the latency metrics (time.time() seconds)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    queue_time: float | None = None


class RequestState:
    """All choices of one user request plus its timing."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        arrival_time: float,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.times = RequestTimes(arrival=arrival_time)
        self.timeline = RequestTimeline(arrival=time.monotonic())
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        """Set from the first engine output that carries them (every choice computes the same)."""
        self.prompt_logprobs_sent = False
        self.pooled: bytes | None = None
        """An embedding request's pooled vector (float32 bytes), once the engine sent it."""
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.choices = [
            ChoiceState(
                i,
                new_detokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                if tokenizer
                else None,
            )
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        if len(self.choices) == 1:  # the common case, checked for every request every step
            return self.choices[0].finish_reason is not None
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_generation_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class OutputProcessor:
    """Turns engine-core token deltas into ``RequestOutput``s.

    ``process`` returns the outputs to hand to users and the engine-core ids to
    abort (choices that hit a stop string, which only the front end can see).
    ``delta=True`` yields only what is new since the last output; ``final_only=True``
    yields outputs of finished requests only (offline generation, which would otherwise
    copy every request's growing token list and text at every step).
    """

    def __init__(self, tokenizer: Any, metrics: Any = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        """An ``EngineMetrics`` (or None) told about tokens, latencies and finishes."""
        self.requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, state: RequestState) -> list[str]:
        """Register a request; returns the engine-core ids of its choices."""
        self.requests[state.request_id] = state
        ids = []
        for i in range(state.params.n):
            child = child_request_id(state.request_id, i, state.params.n)
            self._child_to_parent[child] = (state.request_id, i)
            ids.append(child)
        return ids

    def parent_of(self, child_id: str) -> str | None:
        """The user request id an engine-core id belongs to."""
        parent = self._child_to_parent.get(child_id)
        return parent[0] if parent else None

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        return [child_request_id(request_id, i, state.params.n) for i in range(state.params.n)]

    def abort_request(self, request_id: str, now: float | None = None) -> list[str]:
        """Finish every unfinished choice with ``abort`` (counted in the metrics), forget the
        request, and return the engine-core ids to abort."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        now = time.time() if now is None else now
        for choice in state.choices:
            if choice.finish_reason is None:
                if choice.undecoded:  # (final-only outputs: the text so far)
                    choice.text += choice.detokenizer.add_tokens(
                        choice.token_ids[-choice.undecoded :], final=True
                    )
                    choice.undecoded = 0
                choice.finish_reason = "abort"
                self._on_choice_finished(state, choice, now)
        child_ids = self.child_ids(request_id)
        self.remove_request(request_id)
        return child_ids

    def remove_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state:
            for i in range(state.params.n):
                self._child_to_parent.pop(child_request_id(request_id, i, state.params.n), None)

    def process(
        self,
        core_outputs: list[EngineCoreOutput],
        delta: bool,
        now: float | None = None,
        final_only: bool = False,
    ) -> tuple[list[RequestOutput], list[str], list[RequestState]]:
        """Apply one step's outputs → (outputs for users, engine ids to abort, finished states)."""
        now = time.time() if now is None else now
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent = self._child_to_parent.get(out.request_id)
            if parent is None:
                continue
            state = self.requests[parent[0]]
            choice = state.choices[parent[1]]
            if choice.finish_reason is not None:
                continue
            self._apply(state, choice, out, now, final_only)
            if choice.finish_reason == "stop" and out.finish_reason is None:
                to_abort.append(out.request_id)  # a stop string ended it; the core does not know yet
            touched[state.request_id] = state
        results, finished = [], []
        for state in touched.values():
            done = state.finished
            if done or not final_only:
                results.append(self._make_output(state, delta))
            if done:
                finished.append(state)
                self.remove_request(state.request_id)
        return results, to_abort, finished

    def _apply(
        self, state: RequestState, choice: ChoiceState, out: EngineCoreOutput, now: float, final_only: bool
    ) -> None:
        """One engine output into its choice. With ``final_only`` (nobody reads the text before the
        choice ends) and no stop strings to watch for, the text is decoded once, when the choice ends,
        instead of token by token for every request at every step of the offline engine loop
        (docs/benchmarks.md, fifteenth session); the same text."""
        metrics = self.metrics
        if out.queue_time is not None:
            state.times.queue_time = out.queue_time
            if state.timeline.arrival is not None:
                state.timeline.scheduled = state.timeline.arrival + out.queue_time
        if out.new_token_ids:
            if state.times.first_token is None:
                state.times.first_token = now
                if metrics:
                    metrics.on_first_token(now - state.times.arrival, len(state.prompt_token_ids))
            elif metrics and choice.last_token_time is not None:
                metrics.on_inter_token(now - choice.last_token_time)
            choice.last_token_time = state.times.last_token = now
            if metrics:
                metrics.on_generation_tokens(len(out.new_token_ids))
        state.num_cached_tokens = out.num_cached_tokens
        if out.pooled is not None:  # an embedding request: its vector is its first (and only) output
            state.pooled = out.pooled
            if metrics and state.times.first_token is None:
                state.times.first_token = now
                metrics.on_first_token(now - state.times.arrival, len(state.prompt_token_ids))
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = to_prompt_logprobs(
                state.prompt_token_ids, out.prompt_logprobs, self.tokenizer
            )
        choice.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            choice.logprobs.extend(
                self._to_logprobs(token, entry) for token, entry in zip(out.new_token_ids, out.logprobs)
            )
        finishing = out.finish_reason is not None
        if choice.detokenizer is not None:
            new_ids = out.new_token_ids
            if final_only and not state.params.stop and not finishing:
                choice.undecoded += len(new_ids)
                return
            if choice.undecoded:  # the tokens of the steps before, decoded with these
                new_ids = choice.token_ids[-(choice.undecoded + len(new_ids)) :]
                choice.undecoded = 0
            if finishing and out.finish_reason == "stop" and not state.params.include_stop_str_in_output:
                # the token that ended the choice (EOS or a stop_token_ids entry) is not text, even
                # with skip_special_tokens false (as vLLM: only include_stop_str_in_output shows it)
                new_ids = new_ids[:-1]
            delta_text = choice.detokenizer.add_tokens(new_ids, final=finishing)
            choice.text += delta_text
            # stop strings count once the choice has more than min_tokens tokens (as vLLM)
            if (
                state.params.stop
                and len(choice.token_ids) > state.params.min_tokens
                and self._match_stop(state, choice, len(delta_text))
            ):
                self._on_choice_finished(state, choice, now)
                return
        if finishing:
            choice.finish_reason = out.finish_reason
            choice.stop_reason = out.stop_reason
            self._on_choice_finished(state, choice, now)

    def _to_logprobs(self, token: int, entry: list) -> dict[int, Logprob]:
        """``[top ids, top logprobs, sampled logprob, rank]`` → ``{token: Logprob}``, sampled token first."""
        top_ids, top_lps, sampled_lp, rank = entry
        result = {token: Logprob(sampled_lp, rank, self._decode_one(token))}
        for i, (tid, lp) in enumerate(zip(top_ids, top_lps)):
            if tid not in result:
                result[tid] = Logprob(lp, i + 1, self._decode_one(tid))
        return result

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _on_choice_finished(self, state: RequestState, choice: ChoiceState, now: float) -> None:
        if not self.metrics:
            return
        times = state.times
        self.metrics.on_finished(choice.finish_reason, now - times.arrival, times.queue_time)
        if state.pooled is not None or any(c.finish_reason is None for c in state.choices):
            return  # (an embedding, or choices still running: the request is not finished)
        scheduled = None if times.queue_time is None else times.arrival + times.queue_time
        first, last = times.first_token, times.last_token
        self.metrics.on_request_finished(
            FinishedRequestStats(
                prompt_tokens=len(state.prompt_token_ids),
                generation_tokens=sum(len(c.token_ids) for c in state.choices),
                n=len(state.choices),
                max_tokens=state.params.max_tokens,
                prefill_time=None if scheduled is None or first is None else max(first - scheduled, 0.0),
                decode_time=None if first is None or last is None else last - first,
                inference_time=None if scheduled is None else max(now - scheduled, 0.0),
            )
        )

    @staticmethod
    def _match_stop(state: RequestState, choice: ChoiceState, delta_len: int) -> bool:
        """Cut the text at the first stop string that completed in this delta."""
        search_from = max(0, len(choice.text) - delta_len - state.max_stop_len + 1)
        best = None
        for stop in state.params.stop:
            idx = choice.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        end = idx + len(stop) if state.params.include_stop_str_in_output else idx
        choice.text = choice.text[:end]
        choice.finish_reason = "stop"
        choice.stop_reason = stop
        return True

    def _make_output(self, state: RequestState, delta: bool) -> RequestOutput:
        outputs = []
        for choice in state.choices:
            done = choice.finish_reason is not None
            # hold back text that could still turn out to be the start of a stop string
            held_back = 0 if done else max(state.max_stop_len - 1, 0)
            visible = max(choice.sent_text_len, len(choice.text) - held_back)
            want_logprobs = state.params.logprobs is not None
            if delta:
                text = choice.text[choice.sent_text_len : visible]
                token_ids = choice.token_ids[choice.sent_token_len :]
                logprobs = choice.logprobs[choice.sent_token_len :] if want_logprobs else None
                if not text and not token_ids and (not done or choice.finish_reported):
                    continue
            else:
                text, token_ids = choice.text[:visible], list(choice.token_ids)
                logprobs = list(choice.logprobs) if want_logprobs else None
            choice.sent_text_len, choice.sent_token_len = visible, len(choice.token_ids)
            choice.finish_reported = done
            outputs.append(
                CompletionOutput(
                    choice.index, text, token_ids, choice.finish_reason, choice.stop_reason, logprobs
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_logprobs = None  # streaming: only the first output that has them carries them
        state.prompt_logprobs_sent = state.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            timeline=state.timeline,
            embedding=None if state.pooled is None else array.array("f", state.pooled).tolist(),
        )
