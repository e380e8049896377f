"""Benchmark suite behind ``fastdeploy bench serve | throughput | latency``.

``datasets`` makes the prompts, ``serve`` drives an OpenAI-compatible server,
``metrics`` turns per-request timings into the reported statistics,
``throughput`` and ``latency`` measure the offline engine.
"""
