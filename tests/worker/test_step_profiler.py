"""The worker's step-window profiler (``FD_TORCH_PROFILER_DIR``): the window it parses, what it
writes, and a whole offline run that profiles its steps."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from fastdeploy.worker.step_profiler import StepProfiler, parse_window


def test_parse_window():
    assert parse_window("200:20") == (200, 20)
    for bad in ("200", "a:b", "-1:5", "3:0"):
        with pytest.raises(ValueError, match="FD_PROFILE_STEPS"):
            parse_window(bad)


def test_off_unless_the_folder_is_set(monkeypatch):
    monkeypatch.delenv("FD_TORCH_PROFILER_DIR", raising=False)
    assert StepProfiler.from_env("dp0-rank0", torch.device("cpu")) is None


def test_profiles_the_window_and_writes_trace_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("FD_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("FD_PROFILE_STEPS", "2:3")
    profiler = StepProfiler.from_env("dp0-rank0", torch.device("cpu"))
    x = torch.randn(64, 64)
    for step in range(7):
        profiler.step_begin(num_tokens=10 + step)
        torch.mm(x, x)
        profiler.step_end()
    assert [t.tokens for t in profiler.timings] == [12, 13, 14]  # steps 2, 3, 4 only
    stem = tmp_path / "prof" / f"dp0-rank0-pid{os.getpid()}"
    summary = stem.with_suffix(".txt").read_text()
    assert "steps 2-4 (3 timed)" in summary and "tokens per step: min 12" in summary
    assert "aten::mm" in summary  # the operator table
    with gzip.open(f"{stem}.trace.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])


def test_offline_run_writes_the_profile(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastdeploy import LLM, SamplingParams
    from tests.greedy_tokens import TINY_ENGINE, TOKEN_PROMPTS

    folder = str(tmp_path / "model")
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    monkeypatch.setenv("FD_TORCH_PROFILER_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("FD_PROFILE_STEPS", "1:2")
    llm = LLM(model=folder, **TINY_ENGINE)
    try:
        llm.generate(TOKEN_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    (summary_file,) = (tmp_path / "prof").glob("dp0-rank0-pid*.txt")
    summary = summary_file.read_text()
    assert "steps 1-2 (2 timed)" in summary and "tokens per step: min 1" in summary
