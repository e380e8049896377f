"""Pooled vectors of embedding requests, from the final hidden states of their prefill steps.

An embedding request (pooling runner) is prefill only. With chunked prefill its
prompt may span several steps: last-token pooling takes the hidden state of the
step that ends the prompt; mean pooling adds every chunk's rows to a float32
running sum kept here per request, and divides by the prompt length at the end.
Mean-pooling requests read nothing from the prefix cache (``Request.
needs_every_prompt_position``), so every prompt position passes through here.
A request dropped by the scheduler (finished, aborted, preempted) loses its sum;
a preempted one starts again from its first token.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.worker.input_batch import InputBatch


class Pooler:
    """Per-request pooling parameters and mean-pooling sums of one worker."""

    def __init__(self) -> None:
        self.params: dict[str, PoolingParams] = {}
        self._sums: dict[str, torch.Tensor] = {}
        """Mean pooling: float32 sum of the rows computed so far, per request."""

    def add_request(self, req_id: str, params: PoolingParams | None) -> None:
        """Start (or restart, after a preemption) pooling a request."""
        if params is None:
            raise ValueError(f"request {req_id!r} has no pooling parameters; the pooling runner only embeds")
        self.params[req_id] = params
        self._sums.pop(req_id, None)

    def remove_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self._sums.pop(req_id, None)

    def pool(
        self, hidden: torch.Tensor, batch: InputBatch, slots: np.ndarray, query_start_loc: np.ndarray
    ) -> dict[str, bytes] | None:
        """The pooled vectors of the requests whose prompt ends in this step.

        ``slots[i]`` owns the hidden rows ``query_start_loc[i]:[i + 1]``, which start at
        position ``batch.num_computed_tokens[slot]``. Returns ``{req_id: float32 bytes}``
        (None when no prompt ends here).
        """
        finished: list[tuple[str, torch.Tensor, bool]] = []
        for i, slot in enumerate(slots.tolist()):
            req_id = batch.req_ids[slot]
            params = self.params[req_id]
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            num_prompt = int(batch.num_prompt_tokens[slot])
            done = int(batch.num_computed_tokens[slot]) + end - start >= num_prompt
            if params.pooling_type == "mean":
                chunk_sum = hidden[start:end].float().sum(dim=0)
                total = self._sums.pop(req_id, None)
                total = chunk_sum if total is None else total + chunk_sum
                if not done:
                    self._sums[req_id] = total
                    continue
                vector = total / num_prompt
            elif done:
                vector = hidden[end - 1].float()
            else:
                continue
            finished.append((req_id, vector, params.normalize))
        if not finished:
            return None
        vectors = torch.stack([v for _, v, _ in finished])
        normalize = torch.tensor([n for *_, n in finished], device=vectors.device)
        vectors = torch.where(normalize[:, None], torch.nn.functional.normalize(vectors, dim=-1), vectors)
        rows = vectors.cpu().numpy()
        return {req_id: rows[i].tobytes() for i, (req_id, _, _) in enumerate(finished)}
