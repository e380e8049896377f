"""setup_ops.py: FD_CUDA_ARCHS → nvcc -gencode flags, and the sources it builds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fastdeploy import envs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup_ops():
    spec = importlib.util.spec_from_file_location("setup_ops", ROOT / "setup_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: setup() runs under __main__
    return module


def test_default_archs_are_sm90a_and_portable_sm80(setup_ops, monkeypatch):
    monkeypatch.delenv("FD_CUDA_ARCHS", raising=False)
    assert envs.FD_CUDA_ARCHS == "9.0a;8.0+PTX"
    assert setup_ops.cuda_arch_flags(envs.FD_CUDA_ARCHS) == [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_80,code=compute_80",
    ]


@pytest.mark.parametrize(
    "archs, expected",
    [
        ("8.9", ["-gencode=arch=compute_89,code=sm_89"]),
        (
            "10.0a, 12.0+PTX",
            [
                "-gencode=arch=compute_100a,code=sm_100a",
                "-gencode=arch=compute_120,code=sm_120",
                "-gencode=arch=compute_120,code=compute_120",
            ],
        ),
        ("9.0 9.0", ["-gencode=arch=compute_90,code=sm_90"]),
    ],
)
def test_arch_lists_translate_to_gencode_flags(setup_ops, archs, expected):
    assert setup_ops.cuda_arch_flags(archs) == expected


@pytest.mark.parametrize("archs", ["", "sm_90", "9", "9.0b", "Hopper"])
def test_malformed_arch_lists_are_refused(setup_ops, archs):
    with pytest.raises(ValueError, match="FD_CUDA_ARCHS"):
        setup_ops.cuda_arch_flags(archs)


def test_nvcc_flags_keep_ieee_division_and_the_sources_exist(setup_ops):
    flags = setup_ops.nvcc_flags("9.0a")
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert not any(
        "fast-math" in f or "fast_math" in f for f in flags
    )  # the fp8 scale must match the fallback
    assert all((ROOT / source).is_file() for source in setup_ops.SOURCES)
    assert {Path(s).suffix for s in setup_ops.SOURCES} == {".cpp", ".cu"}
