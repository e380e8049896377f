"""The offline ``LLM`` as node 0 of a two-"host" launch on 127.0.0.1 (its worker 1 under a
``fastdeploy serve --headless`` node 1): greedy float32 tokens of a tiny random Llama equal
``transformers``'; ``LLM(node_rank=1)`` is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastdeploy import LLM
from fastdeploy.engine.parallel_layout import ParallelLayoutError
from tests.e2e.conftest import free_port
from tests.engine.test_tensor_parallel_engine import MAX_TOKENS, TINY
from tests.greedy_tokens import TINY_ENGINE, TOKEN_PROMPTS, engine_greedy_tokens, transformers_greedy_tokens

pytestmark = pytest.mark.slow


def test_offline_llm_over_two_nodes_equals_transformers(tmp_path):
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    reference.save_pretrained(tmp_path)
    expected = transformers_greedy_tokens(reference, TOKEN_PROMPTS, MAX_TOKENS)
    nodes = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": free_port()}
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in {**TINY_ENGINE, **nodes}.items()]
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--model", str(tmp_path)]
    cmd += [*flags, "--tensor-parallel-size", "2", "--node-rank", "1", "--headless"]
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        assert engine_greedy_tokens(str(tmp_path), TOKEN_PROMPTS, MAX_TOKENS, tp=2, **nodes) == expected
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()  # shut down by node 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_offline_llm_runs_node_0_only():
    with pytest.raises(ParallelLayoutError, match="the offline LLM runs node 0"):
        LLM(tensor_parallel_size=2, nnodes=2, node_rank=1, master_addr="127.0.0.1", **TINY_ENGINE)
