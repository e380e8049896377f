"""The MoE load-balance statistic, read without stalling the device.

Every :class:`~fastdeploy.model_executor.layers.fused_moe.FusedMoE` layer adds the (token,
expert) pairs it routes to its ``routed_tokens`` counters on the device (inside CUDA graphs
too). :class:`MoELoadMeter` makes those counters rows of one ``[layers, experts]`` buffer and,
at most every :data:`READ_INTERVAL_S`, sums them, starts a non-blocking copy to the host and
zeroes them; a later step picks the copy up once its event says it is done. So the statistic
never makes the host wait for the device: a blocking read per step would wait for the step
the host has already queued behind it, which is what async scheduling must avoid.
"""

from __future__ import annotations

import time

import torch
from torch import nn

READ_INTERVAL_S = 0.5
"""Least time between two reads of the counters (the metric is scraped every few seconds)."""


def load_imbalance(counts: torch.Tensor, ep_size: int) -> float | None:
    """Max / mean of the pairs routed per expert-parallel rank (per expert without expert
    parallelism) in ``counts [E]``; None when nothing was routed."""
    per_rank = counts.view(ep_size, -1).sum(1) if ep_size > 1 else counts
    total = int(per_rank.sum())
    return None if total == 0 else float(per_rank.max()) * len(per_rank) / total


class MoELoadMeter:
    """The routed-pair counters of a model's MoE layers, read asynchronously (module docstring)."""

    def __init__(self, layers: list[nn.Module], read_interval_s: float = READ_INTERVAL_S):
        """``layers``: the model's FusedMoE layers, before any CUDA graph is captured (their
        ``routed_tokens`` buffers are replaced by rows of one shared buffer here)."""
        self.read_interval_s = read_interval_s
        self.ep_size = layers[0].ep_size if layers else 1
        self.counts: torch.Tensor | None = None
        """``[layers, experts]`` int64 on the layers' device: the layers' counters are its rows."""
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._pending = False
        self._last_read = float("-inf")
        if not layers:
            return
        first = layers[0].routed_tokens
        self.counts = torch.zeros(len(layers), first.numel(), dtype=first.dtype, device=first.device)
        for row, layer in enumerate(layers):
            layer.routed_tokens = self.counts[row]
        pinned = self.counts.is_cuda
        self._host = torch.zeros(first.numel(), dtype=first.dtype, pin_memory=pinned)

    def poll(self) -> float | None:
        """Called once per step: the imbalance over the pairs routed since the previous read, when a
        read has completed by now; otherwise None (and a new read may be started)."""
        if self.counts is None:
            return None
        result = None
        if self._pending and (self._event is None or self._event.query()):
            self._pending = False
            result = load_imbalance(self._host, self.ep_size)
        if not self._pending and time.monotonic() - self._last_read >= self.read_interval_s:
            self._start_read()
        return result

    def _start_read(self) -> None:
        """Sum the layers' counters into the host buffer (non-blocking on CUDA) and zero them."""
        self._last_read = time.monotonic()
        self._host.copy_(self.counts.sum(0), non_blocking=self.counts.is_cuda)
        self.counts.zero_()
        self._pending = True
        if self.counts.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
