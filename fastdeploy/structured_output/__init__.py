"""Structured outputs (grammar-guided decoding) with xgrammar: constraint → grammar, compile cache,
per-request matchers and the bitmask of each step (applied by the worker's sampler)."""
