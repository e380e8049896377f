"""Sections and helpers of ``benchmarks/gpu_benchmark.py`` (issue #7's GPU benchmark)."""
