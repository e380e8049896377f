"""The CPU-kernel build (``fastdeploy.ops.cpu_ops``): its cache key, its lock, its messages.

Most tests replace ``_compile`` (torch's ``load``, minutes for the real kernels) by a fake that
writes the ``.so`` file a build leaves; one slow test compiles a tiny pybind11 module for real to
show that a second checkout reuses the first one's build.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fastdeploy.ops import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "fastdeploy.ops.cpu_ops"


class FakeCompile:
    """Stands in for ``cpu_ops._compile``: records its calls, checks that torch's lock file is gone,
    sleeps ``seconds`` and writes the ``.so`` a real build leaves."""

    def __init__(self, seconds: float = 0.0):
        self.seconds = seconds
        self.calls: list[tuple[str, list[str], str]] = []

    def __call__(self, name: str, sources: list[str], build_dir: str, spec: cpu_ops.BuildSpec) -> Any:
        assert not os.path.exists(os.path.join(build_dir, cpu_ops.TORCH_LOCK_FILE))
        self.calls.append((name, sources, build_dir))
        time.sleep(self.seconds)
        so = Path(build_dir) / f"{name}.so"
        so.write_bytes(b"built")
        return SimpleNamespace(__file__=str(so))


def _checkout(root: Path) -> Path:
    """A copy of the repository's ``custom_ops`` (the kernel sources) under ``root``."""
    shutil.copytree(ROOT / "custom_ops" / "cpu", root / "custom_ops" / "cpu")
    return root / "custom_ops"


@pytest.fixture
def fake(monkeypatch) -> FakeCompile:
    compile_ = FakeCompile()
    monkeypatch.setattr(cpu_ops, "_compile", compile_)
    return compile_


@pytest.fixture
def sources(tmp_path) -> Path:
    return _checkout(tmp_path / "checkout")


def _build_dir(sources: Path, cache: Path) -> Path:
    return cache / "torch_extensions" / cpu_ops.build_spec(sources).name


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ---- the cache key ------------------------------------------------------------------


def test_key_ignores_the_checkout_path(tmp_path):
    first = cpu_ops.build_spec(_checkout(tmp_path / "a"))
    second = cpu_ops.build_spec(_checkout(tmp_path / "elsewhere" / "b"))
    assert first == second and first.name == second.name
    assert str(tmp_path) not in repr(first)


def test_key_changes_with_what_the_build_depends_on(sources, monkeypatch):
    base = cpu_ops.build_spec(sources)
    assert base.name.startswith("fastdeploy_cpu_ops_")
    changed = [
        dataclasses.replace(base, cflags=(*base.cflags, "-g")),
        dataclasses.replace(base, ldflags=(*base.ldflags, "-lm")),
        dataclasses.replace(base, compiler=base.compiler + " 13.1"),
        dataclasses.replace(base, torch="9.9.9"),
        dataclasses.replace(base, python="3.99.0 cpython-399"),
        dataclasses.replace(base, cpu="another cpu"),
    ]
    assert len({base.name, *(spec.name for spec in changed)}) == len(changed) + 1

    # ... and build_spec really reads them from the environment and the files
    (sources / "cpu" / "cpu_vec.h").write_text("// edited\n", encoding="utf-8")
    assert cpu_ops.build_spec(sources).name != base.name
    edited = cpu_ops.build_spec(sources).name
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cpu_ops.build_spec(sources).name != edited
    monkeypatch.undo()
    compiler = sources.parent / "fake-c++"
    compiler.write_text("#!/bin/sh\necho 'fake c++ 99.1'\n", encoding="utf-8")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    spec = cpu_ops.build_spec(sources)
    assert "fake c++ 99.1" in spec.compiler and spec.name != edited


def test_missing_sources_fall_back(tmp_path, fake):
    assert cpu_ops.build_and_load(tmp_path / "no-custom-ops", str(tmp_path / "cache"), 5) is None
    assert fake.calls == []


def test_two_checkouts_share_one_build_folder(tmp_path, fake, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    cache = tmp_path / "cache"
    first = cpu_ops.build_and_load(_checkout(tmp_path / "a"), str(cache), 5)
    src = Path(fake.calls[0][2]) / "src"
    mtimes = {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()}
    assert len(mtimes) == len(cpu_ops.SOURCES) + len(cpu_ops.HEADERS)
    second = cpu_ops.build_and_load(_checkout(tmp_path / "b"), str(cache), 5)
    assert first.__file__ == second.__file__
    assert [c[2] for c in fake.calls] == [str(src.parent)] * 2
    # both compile the copies in the build folder, which the second load did not rewrite
    assert fake.calls[0][1] == fake.calls[1][1] == [str(src / s) for s in cpu_ops.SOURCES]
    assert {p: p.stat().st_mtime_ns for p in src.rglob("*") if p.is_file()} == mtimes
    assert sum("compiling CPU kernels (first start only" in m for m in _messages(caplog)) == 1


# ---- messages -------------------------------------------------------------------------


def test_a_build_reports_start_progress_and_outcome(sources, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_ops, "_compile", fake := FakeCompile(seconds=0.45))
    monkeypatch.setattr(cpu_ops, "PROGRESS_INTERVAL_S", 0.1)
    caplog.set_level(logging.WARNING, LOGGER)
    assert cpu_ops.build_and_load(sources, str(tmp_path / "cache"), 5) is not None
    messages = _messages(caplog)
    assert messages[0].startswith(f"compiling CPU kernels (first start only, {cpu_ops.TYPICAL_BUILD_TIME})")
    assert sum(m.startswith("still compiling CPU kernels: ") for m in messages) >= 2
    assert messages[-1].startswith("compiled CPU kernels in ")

    caplog.clear()  # a cached build loads (quickly: ninja finds nothing to do) without a word
    fake.seconds = 0.0
    assert cpu_ops.build_and_load(sources, str(tmp_path / "cache"), 5) is not None
    assert _messages(caplog) == []


def test_a_failed_build_says_why(sources, tmp_path, monkeypatch, caplog):
    def broken(*args: Any) -> Any:
        raise RuntimeError("Error building extension 'x': c++: fatal error: no input files\nmore")

    monkeypatch.setattr(cpu_ops, "_compile", broken)
    caplog.set_level(logging.WARNING, LOGGER)
    assert cpu_ops.build_and_load(sources, str(tmp_path / "cache"), 5) is None
    assert _messages(caplog)[-1] == (
        "CPU kernels unavailable, using the torch fallback: "
        "Error building extension 'x': c++: fatal error: no input files"
    )


def test_messages_reach_stderr_of_a_process_without_logging_config(sources, tmp_path):
    """A worker process configures no logging; WARNING records still reach its (the console's) stderr."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cpu_ops_build import FakeCompile
        from fastdeploy.ops import cpu_ops
        cpu_ops._compile = FakeCompile()
        assert cpu_ops.build_and_load(Path({str(sources)!r}), {str(tmp_path / "cache")!r}, 5) is not None
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "compiling CPU kernels (first start only" in result.stderr
    assert "compiled CPU kernels in " in result.stderr


# ---- the lock -----------------------------------------------------------------------


def _hold_lock(build_dir: Path) -> int:
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / cpu_ops.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_held_lock_times_out_to_the_fallback(sources, tmp_path, fake, monkeypatch, caplog):
    cache = tmp_path / "cache"
    monkeypatch.setattr(cpu_ops, "PROGRESS_INTERVAL_S", 0.1)
    caplog.set_level(logging.WARNING, LOGGER)
    fd = _hold_lock(_build_dir(sources, cache))  # an open file of its own: flock conflicts in-process too
    try:
        start = time.monotonic()
        assert cpu_ops.build_and_load(sources, str(cache), 0.5) is None
        assert 0.5 <= time.monotonic() - start < 5
    finally:
        os.close(fd)
    assert fake.calls == []
    messages = _messages(caplog)
    assert sum(m.startswith("another process is compiling the CPU kernels; waited") for m in messages) >= 3
    assert messages[-1].startswith("CPU kernels unavailable, using the torch fallback: another process held")
    assert "FD_CPU_OPS_BUILD_TIMEOUT_S" in messages[-1]


def test_a_waiter_loads_the_build_it_waited_for(sources, tmp_path, monkeypatch, caplog):
    """Two loads at once: one compiles, the other waits for it and then loads the result."""
    monkeypatch.setattr(cpu_ops, "_compile", fake := FakeCompile(seconds=0.5))
    caplog.set_level(logging.WARNING, LOGGER)
    cache = str(tmp_path / "cache")
    results: list[Any] = []
    threads = [
        threading.Thread(target=lambda: results.append(cpu_ops.build_and_load(sources, cache, 10)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and None not in results
    assert len(fake.calls) == 2  # torch's load; for the second, ninja finds nothing to do
    messages = _messages(caplog)
    assert sum("compiling CPU kernels (first start only" in m for m in messages) == 1
    assert any(m.startswith("another process is compiling the CPU kernels") for m in messages)


def test_locks_of_dead_builds_do_not_block(sources, tmp_path, fake, caplog):
    cache = tmp_path / "cache"
    build_dir = _build_dir(sources, cache)
    build_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(build_dir / cpu_ops.LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cpu_ops.build_and_load(sources, str(cache), 0.3) is None  # held by a live process
    finally:
        holder.kill()  # a build killed mid-way: its flock goes with it...
        holder.wait()
    (build_dir / cpu_ops.TORCH_LOCK_FILE).write_text("")  # ... but torch's lock file stays
    caplog.set_level(logging.WARNING, LOGGER)
    start = time.monotonic()
    assert cpu_ops.build_and_load(sources, str(cache), 30) is not None
    assert time.monotonic() - start < 5
    assert len(fake.calls) == 1  # FakeCompile checked that torch's lock file was gone
    assert not (build_dir / cpu_ops.TORCH_LOCK_FILE).exists()
    assert any(m.startswith("removed the lock file of a killed CPU-kernel build") for m in _messages(caplog))


# ---- start-up -------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "loads"), [("float32", 1), ("bfloat16", 1), ("float16", 0)])
def test_a_cpu_worker_loads_the_kernels_while_starting(monkeypatch, dtype, loads):
    """``Worker.__init__`` (which runs before a worker process reports ready) builds or waits for the
    kernels, whenever its ops would use them later, not only when the attention kernel fits."""
    from fastdeploy.config import EngineConfig
    from fastdeploy.model_executor.model_loader import resolve_model
    from fastdeploy.worker.worker import Worker

    calls: list[int] = []
    monkeypatch.setattr(cpu_ops, "load_cpu_ops", lambda: calls.append(1))
    overrides = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=128,
    )  # fmt: skip
    config = EngineConfig.from_kwargs(
        model=str(ROOT / "benchmarks" / "configs" / "llama-3.2-1b"),
        load_format="dummy", skip_tokenizer_init=True, hf_config_overrides=overrides, dtype=dtype,
        device="cpu", num_threads=1, max_num_seqs=2, max_model_len=32,
    )  # fmt: skip
    Worker(config, resolve_model(config.model), 32)  # head_dim 32: the attention backend loads nothing
    assert len(calls) == loads


# ---- a real build -------------------------------------------------------------------------

TINY_SOURCE = """\
#include <pybind11/pybind11.h>
#include "tiny.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return TINY_ANSWER; }); }
"""


@pytest.mark.slow
def test_a_second_checkout_reuses_the_compiled_module(tmp_path, monkeypatch):
    """Compiles a tiny pybind11 module from checkout ``a``; a fresh process loading it from checkout
    ``b`` finds the build current (ninja compiles nothing: the ``.so`` keeps its mtime)."""
    for checkout in ("a", "b"):
        (tmp_path / checkout / "cpu").mkdir(parents=True)
        (tmp_path / checkout / "cpu" / "tiny.cpp").write_text(TINY_SOURCE, encoding="utf-8")
        (tmp_path / checkout / "cpu" / "tiny.h").write_text("#define TINY_ANSWER 42\n", encoding="utf-8")
    monkeypatch.setattr(cpu_ops, "SOURCES", ["cpu/tiny.cpp"])
    monkeypatch.setattr(cpu_ops, "HEADERS", ["cpu/tiny.h"])
    cache = tmp_path / "cache"
    module = cpu_ops.build_and_load(tmp_path / "a", str(cache), 60)
    assert module is not None and module.answer() == 42
    so = Path(module.__file__)
    built = so.stat().st_mtime_ns
    ninja = (so.parent / "build.ninja").read_text(encoding="utf-8")
    assert str(tmp_path / "a") not in ninja

    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from fastdeploy.ops import cpu_ops
        cpu_ops.SOURCES, cpu_ops.HEADERS = ["cpu/tiny.cpp"], ["cpu/tiny.h"]
        module = cpu_ops.build_and_load(Path({str(tmp_path / "b")!r}), {str(cache)!r}, 60)
        print(module.__file__, module.answer())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(so), "42"]
    assert "compiling" not in result.stderr
    assert so.stat().st_mtime_ns == built
    assert (so.parent / "build.ninja").read_text(encoding="utf-8") == ninja


def _load_on(cpu_id: str, monkeypatch) -> list[str]:
    """``load_cpu_ops()`` on an x86 CPU with the flags of ``cpu_id``; a build is recorded, not run."""
    builds: list[str] = []
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ops, "_cpu_id", lambda: cpu_id)
    monkeypatch.setattr(cpu_ops, "build_and_load", lambda *a: builds.append(cpu_id) or SimpleNamespace())
    monkeypatch.delenv("FD_DISABLE_CUSTOM_OPS", raising=False)
    cpu_ops.load_cpu_ops.cache_clear()
    try:
        cpu_ops.load_cpu_ops()
    finally:
        cpu_ops.load_cpu_ops.cache_clear()
    return builds


@pytest.mark.parametrize(
    "flags", ["fpu sse2 avx avx2 fma f16c", "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16"]
)
def test_an_avx2_or_avx512_cpu_builds(flags, monkeypatch):
    assert _load_on(f"x86_64 x86_64 Some CPU {flags}", monkeypatch) == [f"x86_64 x86_64 Some CPU {flags}"]
    assert cpu_ops.missing_cpu_flags(f"x86_64 x86_64 CPU {flags}") == []


def test_a_cpu_without_avx2_skips_the_build(monkeypatch, caplog):
    """A CPU with neither AVX-512 nor AVX2 + FMA would fail the build after minutes, at every start:
    it is not tried."""
    caplog.set_level(logging.WARNING, LOGGER)
    assert _load_on("x86_64 x86_64 Old CPU fpu sse2 sse4_2 avx f16c", monkeypatch) == []
    assert _messages(caplog)[-1] == (
        "CPU kernels unavailable, using the torch fallback: they need AVX-512 or AVX2 + FMA and this CPU "
        "lacks avx2, fma"
    )
    # AVX-512F without BW/VL counts for nothing: such a CPU needs AVX2 + FMA (and cpu_vec.h takes that path)
    assert cpu_ops.missing_cpu_flags("x86_64 x86_64 CPU avx avx512f fma") == ["avx2"]
    assert cpu_ops.missing_cpu_flags("x86_64 x86_64 CPU avx avx2 fma avx512f") == []
