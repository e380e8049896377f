"""The worker's stop decision for scheduler tests: the real ``InputBatch`` and stop-code functions, on the CPU.

The scheduler finishes requests only from the stop codes a worker reports, so a fake
worker must compute them the way the real one does; these helpers run the worker's own
code (``length_stop_codes`` + ``device_stop_codes``) on a batch holding each request's tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fastdeploy.core.request import Request
from fastdeploy.core.step_io import ModelRunnerOutput, NewRequestData, SchedulerOutput
from fastdeploy.scheduler.scheduler import Scheduler, worker_sampling
from fastdeploy.worker.input_batch import InputBatch
from fastdeploy.worker.step_state import device_stop_codes, length_stop_codes


def worker_stop_codes(sched: Scheduler, req_ids: list[str], tokens: list[int]) -> list[int]:
    """The stop code a worker gives each request's next token ``tokens[i]`` (no tokens in flight)."""
    if not req_ids:
        return []
    batch = InputBatch(len(req_ids), sched.max_model_len, sched.block_size, torch.device("cpu"))
    for req_id in req_ids:
        request = sched.requests[req_id]
        batch.add_request(
            NewRequestData(
                req_id,
                list(request.all_token_ids),
                request.num_prompt_tokens,
                worker_sampling(request),
                [],
                0,
            )
        )
    slots = np.array([batch.req_id_to_index[r] for r in req_ids], dtype=np.int64)
    num_tokens_after = batch.num_tokens[slots] + 1
    length_codes = torch.from_numpy(length_stop_codes(batch, slots, num_tokens_after, sched.max_model_len))
    sampled = torch.tensor(tokens, dtype=torch.int64)
    codes = device_stop_codes(batch, slots, sampled, length_codes, num_tokens_after, torch.from_numpy)
    return codes.tolist()


def worker_output(
    sched: Scheduler, so: SchedulerOutput, sampler: Callable[[Request], int], **extra
) -> ModelRunnerOutput:
    """What a worker returns for ``so``: a token from ``sampler`` for every request whose scheduled
    tokens reach its end, with the worker's stop codes (``extra``: further output fields)."""
    req_ids = [
        rid
        for rid in so.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
    ]
    tokens = [sampler(sched.requests[rid]) for rid in req_ids]
    return ModelRunnerOutput(so.step_id, req_ids, tokens, worker_stop_codes(sched, req_ids, tokens), **extra)
