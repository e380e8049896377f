"""``fastdeploy serve`` logs its effective engine limits once at start-up."""

from __future__ import annotations

import re


def test_effective_limits_logged_once(server):
    text = server.log_path.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "engine limits:" in line]
    assert len(lines) == 1, lines
    m = re.search(r"max_num_batched_tokens=(\d+), max_num_seqs=(\d+), max_model_len=(\d+), "
                  r"async_scheduling=(\w+), KV cache (\d+) blocks", lines[0])  # fmt: skip
    assert m, lines[0]
    assert m.groups()[:4] == ("2048", "256", str(server.max_model_len), "False")  # the CPU's defaults
    assert int(m.group(5)) > 0
