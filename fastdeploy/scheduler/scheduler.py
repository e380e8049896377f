"""FCFS continuous-batching scheduler with chunked prefill and preemption by recompute."""

from __future__ import annotations

import time
from collections import deque

from fastdeploy.config import EngineConfig
from fastdeploy.core.request import (
    EngineCoreOutput,
    FinishReason,
    GrammarState,
    Request,
    RequestStatus,
    SchedulerStats,
)
from fastdeploy.core.step_io import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StopCode,
    WorkerSamplingParams,
    reaches_length_limit,
)
from fastdeploy.scheduler.encoder_sync import WorkerEncoderCache
from fastdeploy.scheduler.kv_cache_manager import KVCacheManager

_FINISH_OF_STOP_CODE = {
    StopCode.EOS: FinishReason.STOP,
    StopCode.STOP_TOKEN: FinishReason.STOP,
    StopCode.LENGTH: FinishReason.LENGTH,
}
"""The finish reason of each stop code the worker reports (``RUNNING`` has none)."""


def worker_sampling(request: Request) -> WorkerSamplingParams:
    """The sampling and stop controls the worker needs for ``request``."""
    sp = request.sampling_params
    return WorkerSamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.seed,
        repetition_penalty=sp.repetition_penalty,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        logit_bias=sp.logit_bias,
        bad_words_token_ids=sp.bad_words_token_ids,
        min_tokens=sp.min_tokens,
        max_tokens=sp.max_tokens,
        eos_token_ids=[] if sp.ignore_eos else sorted(request.eos_token_ids),
        stop_token_ids=list(sp.stop_token_ids),
        logprobs=sp.logprobs,
        # once sent, prompt logprobs are not recomputed when a preempted request resumes
        prompt_logprobs=sp.prompt_logprobs if request.needs_prompt_logprobs else None,
    )


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes.

    One token budget (``max_num_batched_tokens``) is shared: running requests
    (decodes and unfinished prefill chunks) are served first, in arrival order,
    then waiting requests are admitted while budget, ``max_num_seqs`` and KV
    blocks last. When a running request cannot get a block, the newest running
    request is preempted: its blocks are freed and it is recomputed later.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.async_scheduling = False
        """Set by the engine core: a step is scheduled before the previous one's tokens are back,
        so each running request carries placeholders for its in-flight tokens. Off for the pooling
        runner, which samples nothing: an embedding request's fully scheduled prompt then leaves
        nothing to schedule until its pooled vector finishes it."""
        self.block_size = config.cache.block_size
        self.kv = KVCacheManager(num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.encoder_cache = WorkerEncoderCache(config.cache.encoder_cache_memory)
        """Which multimodal features the worker holds (sent once per content hash)."""
        self.requests: dict[str, Request] = {}
        self._num_with_grammar = 0
        """Requests in :attr:`requests` with a grammar (none: a step's tokens skip the grammar pass)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._dropped_req_ids: list[str] = []
        self._step_id = 0
        self._num_preemptions = 0
        self.moe_load_imbalance: float | None = None
        """The worker's MoE load-balance figure of the last step that routed tokens (metrics)."""

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._num_with_grammar += request.grammar is not None
        self.waiting.append(request)

    def set_grammar(self, request: Request, grammar: GrammarState) -> None:
        """Give a request that was added while its grammar compiled (``awaiting_grammar``) its
        matcher: the rest of its prompt, and its outputs, are scheduled from the next step on."""
        request.grammar = grammar
        request.awaiting_grammar = False
        self._num_with_grammar += request.request_id in self.requests

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish the given requests with reason ``abort``; unknown ids are ignored."""
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            self._finish(request, FinishReason.ABORT)
            outputs.append(
                EngineCoreOutput(req_id, [], FinishReason.ABORT.value, None, request.num_cached_tokens)
            )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._dropped_req_ids.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        self.encoder_cache.release(request.request_id)
        del self.requests[request.request_id]
        self._num_with_grammar -= request.grammar is not None

    # ---- scheduling ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work and reserve its KV blocks."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        running, allocate_slots = self.running, self.kv.allocate_slots  # (the hot loop: a decode each)

        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            placeholders = request.num_output_placeholders
            if placeholders and self._in_flight_tokens_finish(request):
                index += 1
                continue
            computed = request.num_computed_tokens
            num_new = min(len(request.all_token_ids) + placeholders - computed, budget)
            if request.awaiting_grammar:  # (no placeholders: it has sampled nothing yet)
                num_new = min(num_new, request.num_tokens - 1 - computed)
            if request.mm_extra_keys:
                num_new = self._keep_items_whole(request, computed, num_new)
            if num_new <= 0:
                index += 1
                continue
            while (blocks := allocate_slots(request, num_new)) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            num_scheduled[request.request_id] = num_new
            new_blocks[request.request_id] = [b.block_id for b in blocks] if blocks else []
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        admitted: list[Request] = []
        held: list[Request] = []  # waiting requests with nothing to compute before their grammar
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_computed = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_computed
            if request.awaiting_grammar:
                num_new -= 1
                if num_new <= 0:
                    held.append(self.waiting.popleft())
                    continue
            if num_new > budget and not self.chunked_prefill:
                break
            num_new = self._keep_items_whole(request, num_computed, min(num_new, budget))
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            self.running.append(request)
            admitted.append(request)
            num_scheduled[request.request_id] = num_new
            scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(held))

        output = self._make_output(num_scheduled, new_blocks, admitted)
        structured, async_scheduling = output.structured_req_ids, self.async_scheduling
        for request, n in scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders:
                # this step samples a token for it (the end of its prefill, or a decode)
                if request.grammar is not None:
                    structured.append(request.request_id)
                if async_scheduling:
                    request.num_output_placeholders += 1  # a token the host sees later
        return output

    def _keep_items_whole(self, request: Request, start: int, num_new: int) -> int:
        """With bidirectional item attention, end a prefill chunk before an item it would cut.

        A chunk computing ``start .. start + num_new`` that would end inside an item
        ends at the item's first token instead, so that every token of the item
        sees all the others. An item that starts the chunk and is longer than the
        budget is still split (its first part then does not see the rest).
        """
        if not request.mm_extra_keys or not self.config.model.mm_bidirectional_attention:
            return num_new
        end = start + num_new
        for item_start, item_end, _ in request.mm_extra_keys:
            if start < item_start < end < item_end:
                return item_start - start
        return num_new

    def _in_flight_tokens_finish(self, request: Request) -> bool:
        """Whether the tokens already in flight take the request to max_tokens or max_model_len
        (then nothing more is scheduled for it: the worker ends it with the last of them)."""
        placeholders = request.num_output_placeholders
        return placeholders > 0 and bool(
            reaches_length_limit(
                len(request.output_token_ids) + placeholders,
                len(request.all_token_ids) + placeholders,
                request.sampling_params.max_tokens,
                self.max_model_len,
            )
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_output_placeholders = 0  # a token in flight for it is dropped; recompute regenerates it
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self._dropped_req_ids.append(request.request_id)
        self.waiting.appendleft(request)

    def _make_output(
        self, num_scheduled: dict[str, int], new_blocks: dict[str, list[int]], admitted: list[Request]
    ) -> SchedulerOutput:
        new_reqs = []
        for request in admitted:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling=worker_sampling(request),
                    block_ids=self.kv.block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    mm_items=self.encoder_cache.items_for_worker(request),
                    pooling=request.pooling_params,
                )
            )
        cached = CachedRequestData()
        for req_id, block_ids in new_blocks.items():
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(self.requests[req_id].num_computed_tokens)
        self._step_id += 1
        dropped, self._dropped_req_ids = self._dropped_req_ids, []
        return SchedulerOutput(
            step_id=self._step_id,
            new_reqs=new_reqs,
            cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=dropped,
            evicted_mm_hashes=self.encoder_cache.take_evicted(),
        )

    # ---- results -------------------------------------------------------------------

    def accept_grammar_tokens(self, runner_output: ModelRunnerOutput) -> None:
        """Give each structured-output request's grammar its sampled token (the rows that
        :meth:`update_from_output` will append). Apart from it, so that the engine core can start
        the next bitmask before the rest of the bookkeeping."""
        if not self._num_with_grammar:
            return
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(req_id)
            if (
                request is not None
                and request.grammar is not None
                and request.status == RequestStatus.RUNNING
                and request.max_tokens != 0
            ):
                request.grammar.accept_token(token_id)

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish the requests the worker's stop codes end, report deltas.

        The worker alone decides whether a token ends its request (EOS, stop token ids,
        max_tokens, max_model_len: :class:`~fastdeploy.core.step_io.StopCode`); this only acts on
        it. A row of a request aborted or preempted meanwhile (or finished by the previous
        step's token, with async scheduling) is dropped. Prompt logprobs of prefill chunks are
        gathered per request and sent with its first output. A request with ``max_tokens ==
        0`` ends right after its prefill (reason ``length``): the token sampled there is dropped.
        An embedding request ends (reason ``stop``) with the pooled vector of its prefill.
        """
        outputs = self._finish_pooled(runner_output.pooled) if runner_output.pooled else []
        if runner_output.moe_load_imbalance is not None:
            self.moe_load_imbalance = runner_output.moe_load_imbalance
        for req_id, (first_index, entries) in (runner_output.prompt_logprobs or {}).items():
            request = self.requests.get(req_id)
            if request is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs.add(first_index, entries)
        all_logprobs = runner_output.logprobs or [None] * len(runner_output.req_ids)
        requests, running = self.requests, RequestStatus.RUNNING
        for req_id, token_id, code, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.stopped, all_logprobs
        ):
            request = requests.get(req_id)
            if request is None or request.status != running:
                continue  # aborted or preempted while the step ran
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            prompt_logprobs = request.prompt_logprobs.take() if request.prompt_logprobs else None
            if request.sampling_params.max_tokens == 0:
                new_token_ids, logprobs = [], None
            else:
                request.append_output_token(token_id)
                new_token_ids = [token_id]
            finish, stop_reason = None, None
            if code:  # (0: the request goes on)
                reason = _FINISH_OF_STOP_CODE.get(code)
                stop_reason = token_id if code == StopCode.STOP_TOKEN else None
                if reason is not None:
                    self._finish(request, reason, stop_reason)
                    finish = reason.value
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    finish,
                    stop_reason,
                    request.num_cached_tokens,
                    request.queue_time if len(request.output_token_ids) <= 1 else None,
                    None,  # (error; positional arguments: this runs for every row of every step)
                    None if logprobs is None else [logprobs],
                    prompt_logprobs,
                )
            )
        return outputs

    def _finish_pooled(self, pooled: dict[str, bytes]) -> list[EngineCoreOutput]:
        """Finish the embedding requests whose pooled vectors came back (unless aborted or
        preempted meanwhile) and report the vectors."""
        outputs = []
        for req_id, vector in pooled.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self._finish(request, FinishReason.STOP)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    [],
                    FinishReason.STOP.value,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_time=request.queue_time,
                    pooled=vector,
                )
            )
        return outputs

    def make_stats(self) -> SchedulerStats:
        """Snapshot for metrics; resets the per-interval prefix-cache counters."""
        stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            moe_load_imbalance=self.moe_load_imbalance,
        )
        stats.encoder_cache_hits, stats.encoder_cache_misses = self.encoder_cache.take_stats()
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self._num_preemptions = 0
        return stats
