"""Runs one scheduler step on one device: inputs from the persistent batch, forward, sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from fastdeploy.config import EngineConfig
from fastdeploy.model_executor.attention.forward_context import set_forward_context
from fastdeploy.model_executor.attention.metadata import CommonAttentionMetadata
from fastdeploy.model_executor.layers.linear import prepack_linear_weights
from fastdeploy.model_executor.model_loader import ModelSource, load_model, resolve_dtype
from fastdeploy.model_executor.sampler import LogprobsTensors, Sampler
from fastdeploy.platforms import get_attention_backend
from fastdeploy.scheduler.output import ModelRunnerOutput, SchedulerOutput
from fastdeploy.worker.input_batch import InputBatch
from fastdeploy.worker.sampling_metadata import build_sampling_tensors

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache and the persistent batch of one worker."""

    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device, max_model_len: int):
        if config.cache.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype {config.cache.kv_cache_dtype!r} is not implemented yet; use auto"
            )
        self.config = config
        self.source = source
        self.device = device
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.dtype = resolve_dtype(config.model.dtype, source.arch, device)
        self.batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, self.block_size, device)
        self.attn_backend = get_attention_backend(config, device, self.dtype, source.arch.head_dim)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- set-up --------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.source, self.device, self.dtype)
        if self.device.type == "cpu":
            prepack_linear_weights(self.model)

    def kv_cache_bytes_per_block(self) -> int:
        arch = self.source.arch
        per_token = (
            2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * self.dtype.itemsize
        )
        return per_token * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[num_blocks, block_size, kv_heads, head_dim]`` key and value caches per layer."""
        arch = self.source.arch
        shape = (num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = []
        for layer in self.model.attention_layers():
            kv = (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            layer.kv_cache = kv
            layer.backend = self.attn_backend
            self.kv_caches.append(kv)

    # ---- one step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's deltas, run the forward pass and sample finished prefills/decodes."""
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(scheduler_output.step_id, [], [])
        inputs = self._prepare_inputs(scheduler_output)
        with set_forward_context(inputs["attn_metadata"]):
            hidden = self.model(inputs["input_ids"], inputs["positions"])
        sample_slots = inputs["sample_slots"]
        if len(sample_slots) == 0:
            return ModelRunnerOutput(scheduler_output.step_id, [], [])
        logits = self.model.compute_logits(hidden[inputs["logits_indices"]])
        params = build_sampling_tensors(self.batch, sample_slots, logits.shape[-1], self._to_device)
        sampled = self.sampler(logits, params)
        tokens = sampled.token_ids.tolist()
        req_ids = []
        for slot, token in zip(sample_slots.tolist(), tokens):
            self.batch.append_token(slot, token)
            req_ids.append(self.batch.req_ids[slot])
        logprobs = None
        if sampled.logprobs is not None:
            logprobs = self._logprobs_lists(sample_slots, sampled.logprobs)
        return ModelRunnerOutput(scheduler_output.step_id, req_ids, tokens, logprobs)

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
        for new in so.new_reqs:
            batch.add_request(new)
        cached = so.cached_reqs
        for req_id, block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            slot = batch.req_id_to_index[req_id]
            batch.block_table.append(slot, block_ids)
            batch.num_computed_tokens[slot] = num_computed

    def _prepare_inputs(self, so: SchedulerOutput) -> dict:
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
        input_ids = batch.token_ids[req_of_token, positions]
        block_numbers = batch.block_table.table[req_of_token, positions // self.block_size]
        slot_mapping = block_numbers.astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = batch.num_computed_tokens[slots] + counts
        query_start_loc = np.concatenate([[0], cu])
        finishing = seq_lens >= batch.num_tokens[slots]
        common = CommonAttentionMetadata(
            num_reqs=len(slots),
            num_actual_tokens=total,
            query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_table=batch.block_table.to_device(slots),
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
        )
        return {
            "input_ids": self._to_device(input_ids),
            "positions": self._to_device(positions),
            "attn_metadata": self.attn_backend.build(common),
            "logits_indices": self._to_device(cu[finishing] - 1),
            "sample_slots": slots[finishing],
        }

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)
