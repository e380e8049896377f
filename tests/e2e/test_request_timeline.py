"""``FD_REQUEST_TIMELINE_FILE``: one JSON line per streamed request, its stages in order."""

from __future__ import annotations

import json

STAGES = ("received", "tokenized", "arrival", "queued", "scheduled", "first_token_sent",
          "first_token_received", "first_token_detokenized", "first_chunk_written")  # fmt: skip
CLOCK_SLACK_S = 0.005
"""``scheduled`` comes from the engine's wall-clock queue time: allow for the two clocks' rounding."""


def test_streamed_requests_write_ordered_timelines(server_factory, tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("FD_REQUEST_TIMELINE_FILE", str(path))
    server = server_factory()
    client = server.openai()
    name = server.model_name()
    chunks = list(client.completions.create(model=name, prompt="Once upon a time", max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) >= 1
    list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    client.completions.create(model=name, prompt="Not streamed", max_tokens=2)  # writes nothing
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2
    for record, max_tokens in zip(records, (6, 4)):
        times = [record[k] for k in STAGES]
        assert all(t is not None for t in times), record
        for earlier, later in zip(times, times[1:]):
            assert earlier <= later + CLOCK_SLACK_S, record
        assert record["token_path_count"] <= max_tokens - 1  # at most one chunk per later token
        assert 0 <= record["token_path_s"] < 60
