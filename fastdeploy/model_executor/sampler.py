"""Batched token sampling: greedy, temperature, top-k, top-p and min-p, per row.

All rows are processed with tensor operations; a greedy-only batch takes the
argmax fast path. Seeded rows draw their noise from their own generator, so
their tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of the rows being sampled this step."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    """0 means no top-k limit."""
    min_p: torch.Tensor
    generators: dict[int, torch.Generator]
    """Row index → generator for seeded rows."""
    all_greedy: bool


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus / min-p set to -inf (ties at the edge are kept)."""
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    keep_floor = torch.full_like(top_p, float("-inf"))
    has_k = top_k > 0
    if bool(has_k.any()):
        kth = sorted_logits.gather(-1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1)).squeeze(-1)
        keep_floor = torch.where(has_k, kth, keep_floor)
        # top-p then applies to the distribution renormalised over the top-k set
        sorted_logits = sorted_logits.masked_fill(sorted_logits < keep_floor.unsqueeze(-1), float("-inf"))
    has_p = top_p < 1.0
    if bool(has_p.any()):
        probs = sorted_logits.softmax(-1)
        cum_before = probs.cumsum(-1) - probs
        # the smallest prefix whose mass reaches top_p: token i is kept if the mass before it < top_p
        inside = cum_before < top_p.unsqueeze(-1)
        last_inside = inside.sum(-1).clamp(min=1) - 1
        pth = sorted_logits.gather(-1, last_inside.unsqueeze(-1)).squeeze(-1)
        keep_floor = torch.where(has_p, torch.maximum(keep_floor, pth), keep_floor)
    has_min_p = min_p > 0
    if bool(has_min_p.any()):
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        mth = sorted_logits[:, 0] + torch.log(min_p.clamp(min=1e-30))
        keep_floor = torch.where(has_min_p, torch.maximum(keep_floor, mth), keep_floor)
    return logits.masked_fill(logits < keep_floor.unsqueeze(-1), float("-inf"))


class Sampler:
    """Turns float32 logits ``[rows, vocab]`` into one token id per row."""

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if params.all_greedy:
            return greedy_tokens
        temperature = params.temperature
        is_greedy = temperature == 0
        scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
        scaled = apply_top_k_top_p_min_p(scaled, params.top_k, params.top_p, params.min_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in params.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)
