"""Runs one scheduler step on one device: inputs from the persistent batch, forward, sample."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from fastdeploy import envs
from fastdeploy.config import EngineConfig
from fastdeploy.core.step_io import (
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    StopCode,
)
from fastdeploy.distributed import ep_agree_step, ep_step_tokens, tp_broadcast, tp_size
from fastdeploy.model_executor.attention.backend import AttentionMetadata
from fastdeploy.model_executor.attention.forward_context import set_forward_context
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.linear import prepack_linear_weights
from fastdeploy.model_executor.layers.moe_load import MoELoadMeter
from fastdeploy.model_executor.layers.parallel_linear import local_heads
from fastdeploy.model_executor.model_loader import ModelSource, load_model, resolve_dtype
from fastdeploy.model_executor.sampler import LogprobsTensors, Sampler
from fastdeploy.ops._ext import has_cuda_ops
from fastdeploy.ops.cache_ops import check_fp8_supported, normalize_kv_cache_dtype
from fastdeploy.ops.stop_ops import alloc_stop_flag, get_stop, set_stop
from fastdeploy.ops.upload import upload
from fastdeploy.platforms import get_attention_backend
from fastdeploy.worker import warm_up
from fastdeploy.worker.cuda_graph import DecodeGraphs, GraphOutput
from fastdeploy.worker.forward_stats import ForwardStats
from fastdeploy.worker.input_batch import InputBatch
from fastdeploy.worker.mixed_graphs import MixedStepGraphs, mixed_step_graphs
from fastdeploy.worker.mm_state import MultimodalBatchState
from fastdeploy.worker.pooler import Pooler
from fastdeploy.worker.prompt_logprobs import compute_prompt_logprobs
from fastdeploy.worker.sampling_metadata import build_sampling_tensors
from fastdeploy.worker.step_state import (
    StepArrays,
    StepInputs,
    StepState,
    device_stop_codes,
    length_stop_codes,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache and the persistent batch of one worker."""

    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, max_model_len: int):
        self.kv_cache_dtype = normalize_kv_cache_dtype(config.cache.kv_cache_dtype)
        self.config = config
        self.source = source
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.dtype = resolve_dtype(config.model.dtype, source.arch, device)
        self.batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, self.block_size, device)
        arch = source.arch
        heads = local_heads(arch.num_attention_heads, arch.num_key_value_heads)  # this rank's (TP)
        self.attn_backend = get_attention_backend(
            config,
            device,
            self.dtype,
            arch.head_dim,
            num_heads=heads.num_heads,
            num_kv_heads=heads.num_kv_heads,
            kv_cache_dtype=self.kv_cache_dtype,
            needs_mask_offsets=arch.mm is not None and config.model.mm_bidirectional_attention,
        )
        if self.kv_cache_dtype == "fp8_e4m3":  # (the backend's supports_fp8_kv_cache was checked when chosen)
            check_fp8_supported(device)
        self.sampler = Sampler()
        self.pooler: Pooler | None = Pooler() if source.pooler is not None else None
        """Pooling runner (embedding models): every request is pooled after its prefill, none sampled."""
        self.mm: MultimodalBatchState | None = None
        """Features, M-RoPE positions and mask offsets of multimodal requests (vision-language models)."""
        if source.arch.mm is not None:
            bidirectional = config.model.mm_bidirectional_attention
            self.mm = MultimodalBatchState(source.arch.mm, device, self.dtype, bidirectional)
        self.model: torch.nn.Module | None = None
        self.moe_load = MoELoadMeter([])
        """The MoE layers' load-balance statistic (read without waiting for the device)."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        pinned = device.type == "cuda"
        rows = config.scheduler.max_num_seqs
        self._host_token_ids = [torch.zeros(rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._host_stop_codes = [torch.zeros(rows, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        """Pinned buffers the sampled ids and stop codes are copied into, alternating between steps."""
        self._stop_flag_device, self._stop_flag_host = alloc_stop_flag(device)
        self.any_running = False
        """Whether any request that sampled in the last saved step runs on: the device's flag
        (``set_stop``), read through pinned memory once the step's copies are done (``get_stop``)."""
        self._prev_sampled: torch.Tensor | None = None
        self._prev_slots = np.zeros(0, dtype=np.int64)
        """The last sampled ids (on the device) and their slots: inputs of the next step's decodes."""
        self._pending: StepState | None = None
        self._unsampled: StepState | None = None
        """A launched step whose grammar bitmask is still to come (:meth:`sample_tokens`)."""
        self.graphs: DecodeGraphs | None = None
        """Captured decode CUDA graphs (GPU, unless --enforce-eager)."""
        self.mixed_graphs: MixedStepGraphs | None = None
        """Captured graphs of small steps that are not decode-only (``--cuda-graph-max-tokens``)."""
        self.forward_every_step = config.parallel.expert_parallel_spans_replicas
        """Agree with the other replicas on every step's size, and run a padding forward in a step
        with no tokens: the MoE layers gather every replica's tokens."""
        self.forward_stats = ForwardStats(envs.FD_FORWARD_STATS_LOG_S)
        """Steps and tokens per forward path (graphs or eager), logged every ``FD_FORWARD_STATS_LOG_S``."""
        self.trace: list[tuple[str, int, float]] | None = [] if envs.FD_STEP_TRACE else None
        """(stage, step id, perf_counter seconds) of every stage when ``FD_STEP_TRACE=1``."""

    # ---- set-up --------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.source, self.device, self.dtype)
        self.moe_load = MoELoadMeter([m for m in self.model.modules() if isinstance(m, FusedMoE)])
        if self.device.type == "cpu":
            prepack_linear_weights(self.model)

    def kv_cache_bytes_per_block(self) -> int:
        """Key + value bytes of one block over all layers (fp8: one byte per value plus a float32
        scale per token and head)."""
        arch = self.source.arch
        if self.kv_cache_dtype == "fp8_e4m3":
            per_head = arch.head_dim + 4
        else:
            per_head = arch.head_dim * self.dtype.itemsize
        kv_heads = local_heads(arch.num_attention_heads, arch.num_key_value_heads).num_kv_heads  # this rank's
        return 2 * arch.num_hidden_layers * kv_heads * per_head * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[num_blocks, block_size, kv_heads, head_dim]`` key and value caches per layer."""
        arch = self.source.arch
        kv_heads = local_heads(arch.num_attention_heads, arch.num_key_value_heads).num_kv_heads  # this rank's
        shape = (num_blocks, self.block_size, kv_heads, arch.head_dim)
        self.kv_caches = []
        fp8 = self.kv_cache_dtype == "fp8_e4m3"
        cache_dtype = torch.float8_e4m3fn if fp8 else self.dtype
        for layer in self.model.attention_layers():
            kv = (
                torch.zeros(shape, dtype=cache_dtype, device=self.device),
                torch.zeros(shape, dtype=cache_dtype, device=self.device),
            )
            layer.kv_cache = kv
            layer.backend = self.attn_backend
            layer.kv_cache_dtype = self.kv_cache_dtype
            if fp8:  # one float32 scale per token and KV head
                layer.kv_scales = tuple(
                    torch.ones(shape[:3], dtype=torch.float32, device=self.device) for _ in range(2)
                )
            self.kv_caches.append(kv)

        self.graphs = self._capture_graphs()
        # (with expert parallelism over replicas, the replicas agree on decode sizes only)
        if self.graphs is not None and not self.forward_every_step:
            mixed = self.new_mixed_graphs()
            self.mixed_graphs = mixed if mixed is not None and mixed.try_capture(self.graphs.pool) else None
        if self.device.type == "cuda":
            self.warm_up_kernels()

    def warm_up_kernels(self) -> None:
        """Compile the kernels' variants now, not in the first requests' steps (:mod:`~fastdeploy.worker.warm_up`)."""
        warm_up.warm_up_kernels(self)

    def profile_run(self) -> None:
        """The largest step's forward and sampling without a KV cache: its peak memory (:mod:`~fastdeploy.worker.warm_up`)."""
        warm_up.profile_run(self)

    # ---- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to the end: inputs and forward, sampling, then its output."""
        state = self._preprocess_and_execute_model(scheduler_output)
        self._postprocess(state, scheduler_output.grammar)
        return self._save_model_output(state)

    @torch.inference_mode()
    def execute_model_overlap(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch step N and return step N-1's output while N runs (seed 004).

        Order: preprocess + execute N (its decode inputs take N-1's sampled ids on the
        device), save N-1 (waits on N-1's event; the device keeps computing N), then
        postprocess N. N-1's tokens are in the host batch before N is sampled, so
        penalties and stop checks see the same history as the plain path. A step with
        grammar rows and no bitmask yet is sampled later, by :meth:`sample_tokens`, once the
        engine has advanced the grammars with N-1's tokens.
        """
        state = self._preprocess_and_execute_model(scheduler_output)
        previous, self._pending = self._pending, None
        output = self._save_model_output(previous) if previous is not None else None
        if previous is not None and self._ended_before(state, previous, scheduler_output):
            self._skip_sampling(state)
        if scheduler_output.structured_req_ids and scheduler_output.grammar is None:
            self._unsampled = state
            return output
        self._postprocess(state, scheduler_output.grammar)
        if scheduler_output.total_num_scheduled_tokens:
            self._pending = state
        return output

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask) -> None:
        """Sample the step launched last by :meth:`execute_model_overlap`, under ``grammar``."""
        state, self._unsampled = self._unsampled, None
        if state is None:
            raise RuntimeError("sample_tokens without a launched step awaiting its grammar")
        self._postprocess(state, grammar)
        self._pending = state

    def _forward(self, inputs: StepInputs) -> GraphOutput:
        """The model's forward pass: a CUDA graph replay for decode-only steps that fit one and for
        small other steps (``--cuda-graph-max-tokens``), else eager (counted in :attr:`forward_stats`).

        Only a decode graph of a small batch also returns the logits and greedy tokens of every row.
        """
        common = inputs.attn_metadata.common
        tensors = inputs.tensors
        graphs = self.graphs
        graphable = (
            graphs is not None
            and common.max_query_len == 1
            and common.attn_mask_offsets is None
            and graphs.padded_size(common.num_reqs) is not None
        )
        tokens = most = common.num_actual_tokens
        if self.forward_every_step:  # the MoE layers gather every replica's tokens: one size for all
            most, graphable = ep_agree_step(most, graphable)
        if graphable:
            self.forward_stats.note("decode_graph", tokens)
            return graphs.run(tensors.input_ids, tensors.positions, common, graphs.padded_size(most))
        mixed = self.mixed_graphs  # (never captured when the replicas must agree on every step)
        if mixed is not None and inputs.inputs_embeds is None:
            size = mixed.padded_size(common)
            if size is not None:
                self.forward_stats.note("mixed_graph", tokens)
                return GraphOutput(mixed.run(tensors.input_ids, tensors.positions, common, size), None, None)
        self.forward_stats.note("eager", tokens)
        with set_forward_context(inputs.attn_metadata), ep_step_tokens(most):
            hidden = self.model(tensors.input_ids, tensors.positions, inputs.inputs_embeds)
            return GraphOutput(hidden, None, None)

    def _idle_forward(self) -> None:
        """This replica's part of a step in which it has no tokens but another replica has: the
        MoE layers gather from every replica, so it runs the step's agreed size too (a graph of
        padding requests, or one eager token that writes no cache slot)."""
        most, graphable = ep_agree_step(0, self.graphs is not None)
        if graphable:
            self.graphs.run_padding(self.graphs.padded_size(most))
            return
        with ep_step_tokens(max(most, 1)):
            warm_up.warm_up_prefill(self, 1)  # (a forward that writes no cache slot)

    def _capture_graphs(self) -> DecodeGraphs | None:
        """Capture decode CUDA graphs unless eager mode is asked for or the parts are not graph-safe."""
        device_cfg = self.config.device
        if self.device.type != "cuda" or device_cfg.enforce_eager or self.mm is not None:
            return None  # (M-RoPE models take [3, T] positions, which the captured graphs do not)
        if self.pooler is not None:
            return None  # a pooling runner never decodes
        if not self.attn_backend.supports_cuda_graphs or not has_cuda_ops():
            logger.warning(
                "CUDA graphs need the triton or flashinfer attention backend and the compiled fastdeploy_ops "
                "(python setup_ops.py build_ext --inplace); running every step eagerly"
            )
            return None
        graphs = self.new_decode_graphs()
        try:
            graphs.capture()
        except torch.OutOfMemoryError:
            free, total = torch.cuda.mem_get_info(self.device)
            logger.warning(
                "out of GPU memory while capturing CUDA graphs (%.2f of %.1f GiB free): running eagerly; "
                "lower --gpu-memory-utilization or --cuda-graph-max-bs to keep graphs",
                free / 2**30,
                total / 2**30,
            )
            del graphs
            torch.cuda.empty_cache()
            return None
        return graphs

    def new_mixed_graphs(self) -> MixedStepGraphs | None:
        """Graphs (not yet captured) of small non-decode steps, or None (see :func:`mixed_step_graphs`)."""
        width = self.batch.block_table.table.shape[1]
        return mixed_step_graphs(
            self.model, self.attn_backend, self.config, width, self.max_model_len, self.device
        )

    def new_decode_graphs(self) -> DecodeGraphs:
        """Decode graphs (not yet captured) for batch sizes up to ``--cuda-graph-max-bs``."""
        max_bs = self.config.device.cuda_graph_max_bs or min(self.config.scheduler.max_num_seqs, 512)
        return DecodeGraphs(
            self.model,
            self.attn_backend,
            min(max_bs, self.config.scheduler.max_num_seqs),
            self.batch.block_table.table.shape[1],
            self.block_size,
            self.max_model_len,
            self.device,
        )

    def _preprocess_and_execute_model(self, so: SchedulerOutput) -> StepState:
        """Apply the scheduler's deltas, build inputs, run the model and the LM head."""
        self._trace("execute_start", so.step_id)
        self._update_states(so)
        state = StepState(so.step_id)
        if so.total_num_scheduled_tokens == 0:
            if self.forward_every_step:
                self._idle_forward()
            return state
        inputs = self._prepare_inputs(so)
        hidden, all_logits, greedy_tokens = self._forward(inputs)
        if self.pooler is not None:  # embedding requests: pooled, never sampled
            state.pooled = self.pooler.pool(
                hidden, self.batch, inputs.scheduled_slots, inputs.query_start_loc_cpu
            )
            self._trace("execute_end", so.step_id)
            return state
        state.prompt_logprobs = compute_prompt_logprobs(
            self.model, hidden, self.batch, inputs.scheduled_slots, inputs.query_start_loc_cpu
        )
        state.sample_slots = inputs.sample_slots
        state.num_tokens_after = inputs.num_tokens_after
        state.length_codes = inputs.tensors.length_codes
        state.req_ids = [self.batch.req_ids[slot] for slot in state.sample_slots.tolist()]
        if all_logits is not None and len(state.sample_slots) == len(inputs.scheduled_slots):
            # every row samples (a decode step): the graph's logits and argmax as they are
            state.logits, state.greedy_tokens = all_logits, greedy_tokens
        elif len(state.sample_slots):
            state.logits = self.model.compute_logits(hidden[inputs.tensors.logits_indices])
        self._trace("execute_end", so.step_id)
        return state

    def _postprocess(self, state: StepState, grammar: GrammarBitmask | None = None) -> None:
        """Sample on the device (the rows in ``grammar`` under their bitmask), decide there which
        requests end, and start copying both to the host."""
        if state.logits is None:
            return
        slots = state.sample_slots
        params = build_sampling_tensors(self.batch, slots, state.logits.shape[-1], self._to_device)
        if grammar is not None and grammar.req_ids:
            params.token_bitmask = self._token_bitmask(state.req_ids, grammar)
        sampled = self.sampler(state.logits, params, state.greedy_tokens)
        if tp_size() > 1:  # every rank feeds rank 0's ids to its next step (random draws may differ)
            tp_broadcast(sampled.token_ids, src=0)
        state.logits = state.greedy_tokens = None
        state.stop_codes = device_stop_codes(
            self.batch, slots, sampled.token_ids, state.length_codes, state.num_tokens_after, self._to_device
        )
        set_stop(state.stop_codes != StopCode.RUNNING, self._stop_flag_device, self._stop_flag_host)
        self._prev_sampled, self._prev_slots = sampled.token_ids, slots
        turn = state.step_id % 2
        state.token_ids_host = self._host_token_ids[turn][: len(slots)]
        state.token_ids_host.copy_(sampled.token_ids, non_blocking=True)
        state.stop_codes_host = self._host_stop_codes[turn][: len(slots)]
        state.stop_codes_host.copy_(state.stop_codes, non_blocking=True)
        state.logprobs = sampled.logprobs
        if self.device.type == "cuda":
            state.event = torch.cuda.Event()
            state.event.record()
        self._trace("postprocess_end", state.step_id)

    def _token_bitmask(
        self, req_ids: list[str], grammar: GrammarBitmask
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's bitmask on the device, one row per sampled row (all ones where no grammar
        applies), and the rows a grammar masks. Only the grammar's rows are copied to the device
        (half the bytes when half the batch is constrained); the batch's mask is laid out there."""
        row_of = {req_id: row for row, req_id in enumerate(req_ids)}
        pairs = [(row_of[r], i) for i, r in enumerate(grammar.req_ids) if r in row_of]
        if not pairs:
            return None
        rows = [row for row, _ in pairs]
        indices = [i for _, i in pairs]
        compact = grammar.array()
        in_order = indices == list(range(len(compact)))
        if grammar.tensor is not None and in_order:  # filled in this process (pinned on a GPU): as it is
            (rows_on_device,) = upload([np.asarray(rows, dtype=np.int64)], self.device)
            compact = grammar.tensor.to(self.device, non_blocking=True)
        else:
            if not in_order or self.device.type != "cuda":
                compact = compact[indices]  # (a copy: a CPU tensor cannot wrap the read-only received bytes)
            compact, rows_on_device = upload([compact, np.asarray(rows, dtype=np.int64)], self.device)
        mask = torch.full((len(req_ids), grammar.words), -1, dtype=torch.int32, device=self.device)
        mask[rows_on_device] = compact
        return mask, rows_on_device

    def _ended_before(self, state: StepState, previous: StepState, so: SchedulerOutput) -> bool:
        """Whether every request ``state`` would sample for already ended with ``previous``'s token.

        With async scheduling a request that ends at step N is still in step N+1 (the engine
        scheduled N+1 before N's tokens were back). Once N is saved, the device's flag says
        whether any of N's requests runs on; when none does and N+1 samples only for them (the
        same requests: none re-added by this step), N+1's tokens would all be dropped by the
        engine, so they are not sampled.
        """
        if self.any_running or previous.stop_codes is None or not state.req_ids:
            return False
        readded = {new.req_id for new in so.new_reqs}
        return readded.isdisjoint(state.req_ids) and set(state.req_ids) <= set(previous.req_ids)

    def _skip_sampling(self, state: StepState) -> None:
        """Leave ``state`` with no sampled rows (its output then carries no tokens)."""
        state.logits = state.greedy_tokens = state.length_codes = None
        state.sample_slots = state.sample_slots[:0]
        state.num_tokens_after = state.num_tokens_after[:0]
        state.req_ids = []
        self._prev_sampled, self._prev_slots = None, self._prev_slots[:0]

    def _save_model_output(self, state: StepState) -> ModelRunnerOutput:
        """Wait for the step's copies, record its tokens in the batch and build the output."""
        self._trace("save_start", state.step_id)
        if state.event is not None:
            state.event.synchronize()
        tokens = state.token_ids_host.tolist() if state.token_ids_host is not None else []
        for slot, req_id, token in zip(state.sample_slots.tolist(), state.req_ids, tokens):
            if self.batch.req_id_to_index.get(req_id) == slot:  # not finished or preempted meanwhile
                self.batch.append_token(slot, token)
        logprobs = None
        if state.logprobs is not None:
            logprobs = self._logprobs_lists(state.sample_slots, state.logprobs)
        stopped = state.stop_codes_host.tolist() if state.stop_codes_host is not None else []
        if state.stop_codes is not None:
            self.any_running = get_stop(self._stop_flag_host)
        self._trace("save_end", state.step_id)
        return ModelRunnerOutput(
            state.step_id,
            state.req_ids,
            tokens,
            stopped,
            logprobs,
            state.prompt_logprobs,
            moe_load_imbalance=self.moe_load.poll(),
            pooled=state.pooled,
        )

    def _trace(self, stage: str, step_id: int) -> None:
        if self.trace is not None:
            self.trace.append((stage, step_id, time.perf_counter()))

    def _logprobs_lists(self, slots: np.ndarray, lp: LogprobsTensors) -> list[list | None]:
        """Per sampled row: ``[top ids, top logprobs, sampled logprob, sampled rank]`` or None (msgpack-friendly)."""
        top_ids, top_lps = lp.top_ids.cpu().tolist(), lp.top_logprobs.cpu().tolist()
        sampled_lps, ranks = lp.sampled_logprobs.cpu().tolist(), lp.sampled_ranks.cpu().tolist()
        out: list[list | None] = []
        for row, k in enumerate(self.batch.num_logprobs[slots].tolist()):
            out.append(None if k < 0 else [top_ids[row][:k], top_lps[row][:k], sampled_lps[row], ranks[row]])
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
            if self.mm is not None:
                self.mm.remove_request(req_id)
            if self.pooler is not None:
                self.pooler.remove_request(req_id)
        if self.mm is not None:
            self.mm.evict(so.evicted_mm_hashes)  # before this step's new requests re-add any of them
        for new in so.new_reqs:
            batch.add_request(new)
            if self.mm is not None:
                self.mm.add_request(new)
            if self.pooler is not None:
                self.pooler.add_request(new.req_id, new.pooling)
        cached = so.cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            slot = batch.req_id_to_index[req_id]
            batch.block_table.append(slot, block_ids)
            batch.num_computed_tokens[slot] = num_computed

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        """The step's inputs from the persistent batch, built with vectorised numpy and uploaded
        in one copy; the tokens still in flight are then patched in from the device."""
        batch = self.batch
        num_sched = np.zeros(batch.num_slots, dtype=np.int64)
        for req_id, n in so.num_scheduled_tokens.items():
            num_sched[batch.req_id_to_index[req_id]] = n
        slots = np.flatnonzero(num_sched)
        counts = num_sched[slots]
        cu = np.cumsum(counts)
        total = int(cu[-1])
        req_of_token = np.repeat(slots, counts)
        positions = batch.num_computed_tokens[req_of_token] + (
            np.arange(total) - np.repeat(cu - counts, counts)
        )
        # tokens sampled by the step still in flight: on the device only, taken from its sampled ids
        unsaved = np.flatnonzero(positions >= batch.num_tokens[req_of_token])
        block_numbers = batch.block_table.table[req_of_token, positions // self.block_size]
        seq_lens = batch.num_computed_tokens[slots] + counts
        query_start_loc = np.concatenate([[0], cu])
        finishing = seq_lens >= batch.num_tokens[slots]
        mm_step = (
            None if self.mm is None else self.mm.prepare([batch.req_ids[s] for s in slots], counts, positions)
        )
        sample_slots = slots[finishing]
        num_tokens_after = seq_lens[finishing] + 1  # each sampling row's tokens once it has its new one
        host = StepArrays(
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_table=batch.block_table.rows(slots),
            slot_mapping=block_numbers.astype(np.int64) * self.block_size + positions % self.block_size,
            input_ids=batch.token_ids[req_of_token, positions],
            positions=positions if mm_step is None else mm_step.positions,
            logits_indices=cu[finishing] - 1,
            unsaved_tokens=unsaved,
            unsaved_rows=self._unsaved_rows(unsaved, req_of_token),
            length_codes=length_stop_codes(batch, sample_slots, num_tokens_after, self.max_model_len),
            mask_offsets=None if mm_step is None else mm_step.mask_offsets,
        )
        dev = host.upload(self.device)
        if len(unsaved):
            dev.input_ids[dev.unsaved_tokens] = self._prev_sampled[dev.unsaved_rows]
        inputs_embeds = None if mm_step is None else self.mm.inputs_embeds(self.model, dev.input_ids, mm_step)
        return StepInputs(
            tensors=dev,
            attn_metadata=self.attention_metadata(
                host, dev, query_start_loc, seq_lens, int(counts.max()), batch.num_prompt_tokens[slots]
            ),
            inputs_embeds=inputs_embeds,
            sample_slots=sample_slots,
            num_tokens_after=num_tokens_after,
            scheduled_slots=slots,
            query_start_loc_cpu=query_start_loc,
        )

    def attention_metadata(
        self,
        host: StepArrays[np.ndarray],
        dev: StepArrays[torch.Tensor],
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        max_query_len: int,
        num_prompt_tokens: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """The backend's metadata of a step (``query_start_loc`` and ``seq_lens``: the int64 host
        copies; ``num_prompt_tokens``: each request's prompt length, where known)."""
        common = CommonAttentionMetadata(
            num_reqs=len(seq_lens),
            num_actual_tokens=int(query_start_loc[-1]),
            query_start_loc=dev.query_start_loc,
            seq_lens=dev.seq_lens,
            block_table=dev.block_table,
            block_table_cpu=host.block_table,
            slot_mapping=dev.slot_mapping,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            num_prompt_tokens_cpu=num_prompt_tokens,
            attn_mask_offsets=dev.mask_offsets,
        )
        return self.attn_backend.build(common)

    def _unsaved_rows(self, unsaved: np.ndarray, req_of_token: np.ndarray) -> np.ndarray:
        """For each token not yet on the host, its row in the previous step's sampled ids."""
        if len(unsaved) == 0:
            return unsaved
        rows = self.batch.rows_of(self._prev_slots)[req_of_token[unsaved]]
        if self._prev_sampled is None or (rows < 0).any():
            raise RuntimeError("a scheduled token was neither on the host nor sampled by the previous step")
        return rows

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array as a device tensor (through pinned memory, see :func:`upload`): a copy
        from pageable memory would wait for the stream, i.e. for the step still running."""
        return upload([array], self.device)[0]
