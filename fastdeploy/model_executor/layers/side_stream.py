"""Work run beside the current CUDA stream: the shared experts of a MoE block next to its routed ones.

A MoE block with shared experts (Qwen2-MoE, ERNIE-4.5) runs two independent computations on the
same normed hidden states: a dense MLP (the shared experts) and the routed experts (routing, the
sort, two grouped GEMMs). At small batches each is a few short kernels that leave most of the GPU
idle, so :func:`start_beside` runs the first on a second stream while the current stream goes on
with the second, and :meth:`Beside.result` joins them. On a CUDA stream that is being captured
into a graph the fork and the join are captured too (the side stream waits on an event of the
captured stream, and the other way round), so replays overlap the same way. On by default (it paid
on the GPU at batch 1 and at throughput; docs/benchmarks.md, seventeenth session). Elsewhere (a
CPU, or ``FD_SIDE_STREAM=0``) the work simply runs first, in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdeploy import envs

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


class Beside:
    """The pending result of :func:`start_beside`."""

    def __init__(self, out: torch.Tensor, stream: torch.cuda.Stream | None):
        self._out = out
        self._stream = stream

    def result(self) -> torch.Tensor:
        """The work's output, usable on the current stream (which now waits for the side stream)."""
        if self._stream is not None:
            current = torch.cuda.current_stream(self._out.device)
            current.wait_stream(self._stream)
            if not torch.cuda.is_current_stream_capturing():  # (a capture's memory is the graph's own)
                self._out.record_stream(current)  # allocated on the side stream, used and freed here
            self._stream = None
        return self._out


def start_beside(work: Callable[[], torch.Tensor], device: torch.device) -> Beside:
    """Start ``work`` (kernels only: no host synchronisation, no collective) on the side stream of
    ``device`` after everything already queued on the current stream; :meth:`Beside.result` joins."""
    if device.type != "cuda" or not envs.FD_SIDE_STREAM:
        return Beside(work(), None)
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        out = work()
    return Beside(out, side)
