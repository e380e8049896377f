"""``benchmarks/gpu_benchmark.py --device cpu --smoke``: every section runs and results.json has its keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_benchmark.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpubench.engine_bench import analyze_trace  # noqa: E402
from gpubench.measure import GpuMonitor, parameter_count, sustained_matmul_rate  # noqa: E402
from gpubench.report import _throughput  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_smoke")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_every_section_ran(smoke):
    results, markdown = smoke
    meta = results["meta"]
    assert meta["device_info"]["gpu"] == "none (CPU)" and meta["device_info"]["torch"] == torch.__version__
    assert meta["copy_bandwidth"]["bytes_per_s"] > 0 and meta["matmul_bf16"]["flop_per_s"] > 0
    held = meta["matmul_bf16_sustained"]
    assert held["flop_per_s"] > 0 and len(held["windows"]) >= 2 and held["seconds"] == 0.05
    assert "--smoke" in meta["command"] and meta["date"]
    sections = results["sections"]
    assert list(sections) == ["correctness", "ops", "itl", "throughput", "overlap"]
    for name, entry in sections.items():
        assert entry["status"] == "ok", (name, entry.get("error"))
        assert entry["seconds"] >= 0
    for title in (
        "### Correctness",
        "### Kernel bandwidth",
        "### Decode inter-token",
        "### Offline throughput",
    ):
        assert title in markdown


def test_section_contents(smoke):
    sections = smoke[0]["sections"]
    correctness = sections["correctness"]["result"]
    assert correctness["greedy_equal"] is True  # CPU against CPU in the smoke run
    assert correctness["logits"]["within_tolerance"] is True

    ops = sections["ops"]["result"]["rows"]
    written = [r for r in ops if r["op"] == "reshape_and_cache_flash"]
    assert {r["kv_cache_dtype"] for r in written} == {"bfloat16", "fp8_e4m3"}
    assert all(r["bytes_per_s"] > 0 and r["fraction_of_copy"] > 0 for r in written)
    assert all(r.get("skipped") == "needs CUDA" for r in ops if r["op"].startswith("decode_attention"))

    itl = sections["itl"]["result"]["rows"]
    assert [(r["model"], r["cuda_graphs"]) for r in itl] == [
        ("Llama-3.2-1B", True), ("Llama-3.2-1B", False), ("Llama-3.1-8B", True), ("Llama-3.1-8B", False),
    ]  # fmt: skip
    assert all(r["tokens"] == 8 and r["itl_ms_mean"] > 0 and r["ratio_to_floor"] > 0 for r in itl)

    rows = sections["throughput"]["result"]["rows"]
    assert [r["engine"] for r in rows] == ["fastdeploy", "fastdeploy", "transformers generate"]
    assert [r["output_tokens"] for r in rows] == [4 * 8, 4 * 8, 4 * 8]
    assert all(r["output_tok_per_s"] > 0 and r["fraction_of_compute_floor"] > 0 for r in rows)
    for r in rows:  # the held rate is measured apart from the burst one: the floors differ
        expected = r["compute_floor_s"] * sections["throughput"]["result"]["matmul_flop_per_s"]
        assert r["sustained_floor_s"] * sections["throughput"]["result"]["sustained_matmul_flop_per_s"] == (
            pytest.approx(expected)
        )
        assert r["fraction_of_sustained_floor"] == pytest.approx(r["sustained_floor_s"] / r["elapsed_s"])
        assert r["gpu"] == {}  # no GPU to sample on a CPU
    assert rows[2]["batch_size"] == 2

    overlap = sections["overlap"]["result"]
    assert overlap["status"] in ("ok", "skipped")


def test_analyze_trace_finds_the_overlap():
    def step(n: int, t: float, overlapped: bool) -> list[tuple[str, int, float]]:
        events = [("execute_start", n, t), ("execute_end", n, t + 1)]
        if n > 0:  # save of the previous step: inside this step's window, or after it
            at = t + 0.5 if overlapped else t + 3
            events += [("save_start", n - 1, at), ("save_end", n - 1, at + 0.2)]
        return events + [("postprocess_end", n, t + 2)]

    good = [e for n in range(6) for e in step(n, 10.0 * n, True)]
    result = analyze_trace(good)
    assert (result["step_pairs_checked"], result["step_pairs_overlapped"], result["all_overlapped"]) == (
        5,
        5,
        True,
    )
    assert any("save_start" in line for line in result["excerpt"])
    bad = [e for n in range(6) for e in step(n, 10.0 * n, n != 3)]
    result = analyze_trace(bad)
    assert (result["step_pairs_overlapped"], result["all_overlapped"]) == (4, False)


@pytest.mark.parametrize("name, expected", [("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248)])
def test_parameter_count_matches_the_model(name, expected):
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import resolve_model
    from fastdeploy.model_executor.models import MODEL_REGISTRY

    arch = resolve_model(ModelConfig(model=str(ROOT / "benchmarks" / "configs" / name))).arch
    arch.max_position_embeddings = 16  # the rotary table is a buffer, not a parameter
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch.architecture](arch)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(arch) == expected


def test_sustained_matmul_rate_keeps_the_settled_half():
    result = sustained_matmul_rate(torch.device("cpu"), 64, seconds=0.02)
    windows = result["windows"]
    assert len(windows) >= 2 and all(w > 0 for w in windows)
    assert result["flop_per_s"] == pytest.approx(
        sum(windows[len(windows) // 2 :]) / len(windows[len(windows) // 2 :])
    )


def test_gpu_monitor_parses_nvidia_smi_lines_and_summarizes():
    assert GpuMonitor.parse("1512, 693.12, 700.00, 0x0000000000000004") == (1512.0, 693.12, 700.0, 4)
    assert GpuMonitor.parse("[N/A], 693.12, 700.00, 0x4") is None  # a field the driver cannot read
    assert GpuMonitor.parse("") is None
    monitor = GpuMonitor(torch.device("cpu"))
    with monitor:
        pass
    assert monitor.summary() == {}  # nothing sampled without a GPU
    monitor.samples = [
        (1500.0, 700.0, 700.0, 0x4),
        (1980.0, 300.0, 700.0, 0x0),
        (1200.0, 650.0, 700.0, 0x4 | 0x40),
    ]
    summary = monitor.summary()
    assert summary["samples"] == 3 and summary["sm_clock_mhz_mean"] == pytest.approx(1560.0)
    assert summary["power_w_mean"] == pytest.approx(550.0) and summary["power_limit_w"] == 700.0
    assert summary["power_capped_share"] == pytest.approx(2 / 3)
    assert summary["hw_slowdown_share"] == pytest.approx(1 / 3)


def test_throughput_table_shows_both_floors_and_the_gpu_state():
    row = {"engine": "fastdeploy", "async_scheduling": True, "cuda_graphs": True, "attention_backend": "triton",
           "num_prompts": 256, "elapsed_s": 6.4, "output_tok_per_s": 10240.0, "total_tok_per_s": 30720.0,
           "fraction_of_compute_floor": 0.64, "fraction_of_sustained_floor": 0.74,
           "gpu": {"sm_clock_mhz_mean": 1512.0, "power_w_mean": 693.0, "power_limit_w": 700.0,
                   "power_capped_share": 1.0}}  # fmt: skip
    result = {"parameters": 8.03e9, "input_len": 512, "output_len": 256, "matmul_flop_per_s": 771e12,
              "sustained_matmul_flop_per_s": 665e12, "matmul_n": 8192, "rows": [row]}  # fmt: skip
    text = "\n".join(_throughput(result))
    assert "771 TFLOP/s in a burst, 665 TFLOP/s held for seconds" in text
    assert "| 64.0% | 74.0% | 1512 MHz, 693 W of 700, capped 100% |" in text
