"""The handler's side of a streamed request's :class:`~fastdeploy.core.timeline.RequestTimeline`.

The engine client fills the engine-side stamps; :class:`TimelineRecorder` adds when the
request was received and tokenized, when each chunk was written, and appends the finished
timeline as one JSON line to ``FD_REQUEST_TIMELINE_FILE`` (only when that is set).
"""

from __future__ import annotations

import json
import time

from fastdeploy import envs
from fastdeploy.core.outputs import RequestOutput
from fastdeploy.core.timeline import RequestTimeline


class TimelineRecorder:
    """Stamps the chunks of one streamed API request (one timeline per engine request behind it)."""

    def __init__(self, received: float | None, tokenized: float | None):
        self.received = received
        self.tokenized = tokenized
        self.timelines: dict[int, RequestTimeline] = {}

    def written(self, out: RequestOutput) -> None:
        """A chunk holding tokens of ``out`` was just handed to the connection."""
        timeline = out.timeline
        if timeline is None:
            return
        now = time.monotonic()
        if timeline.first_chunk_written is None:
            timeline.first_chunk_written = now
            self.timelines[id(timeline)] = timeline
        elif out.sent_at is not None:
            timeline.token_path_s += now - out.sent_at
            timeline.token_path_count += 1

    def finish(self) -> None:
        """Append the timelines to ``FD_REQUEST_TIMELINE_FILE`` (a no-op when it is not set)."""
        path = envs.FD_REQUEST_TIMELINE_FILE
        if not path or not self.timelines:
            return
        lines = []
        for timeline in self.timelines.values():
            timeline.received, timeline.tokenized = self.received, self.tokenized
            lines.append(json.dumps(timeline.to_dict()) + "\n")
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(lines))
