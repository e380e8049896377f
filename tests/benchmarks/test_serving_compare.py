"""``benchmarks/serving_compare.py``: every client run of one server draws its own prompts."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import serving_compare  # noqa: E402


def test_each_run_has_its_own_prompt_seed_and_both_servers_the_same():
    runs = list(itertools.product(serving_compare.WORKLOADS, serving_compare.CLIENTS))
    seeds = [serving_compare.prompt_seed(workload, client) for workload, client in runs]
    assert len(set(seeds)) == len(runs)  # no run meets an earlier run's prompts in the prefix cache
    for (workload, client), seed in zip(runs, seeds):
        cmd = serving_compare.client_command(client, workload, 8100, "tok", 1.0, "/tmp/out.json")
        assert cmd[cmd.index("--seed") + 1] == str(seed)  # a function of the run alone: same on both servers
