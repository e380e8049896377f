"""Batched token sampling for one step: logit processing, sampling and logprobs, per row.

Order (as vLLM): logprobs of the raw logits are taken first; then the structured-output
bitmask (tokens a request's grammar forbids become -inf), logit_bias,
banned tokens (bad words, EOS / stop ids before ``min_tokens``), penalties
(repetition on prompt+output tokens, presence/frequency on output tokens),
temperature, top-k / top-p / min-p, and sampling. Every step is a tensor
operation over ``[rows, vocab]``; a batch without any of these takes the argmax
fast path. Seeded rows draw their noise from their own generator, so their
tokens do not depend on what else is in the batch.

Returned logprobs follow vLLM's default: ``log_softmax`` of the *raw* model
logits, before bias, penalties and temperature. They describe the model, not
the sampling settings, which is what clients comparing logprobs across
requests expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyTensors:
    """Per-row penalty values and token histories of the rows being sampled."""

    repetition: torch.Tensor
    """[rows] float; 1.0 = off."""
    presence: torch.Tensor
    """[rows] float; 0.0 = off."""
    frequency: torch.Tensor
    """[rows] float; 0.0 = off."""
    prompt_mask: torch.Tensor
    """[rows, vocab] bool: the token occurs in the row's prompt."""
    output_counts: torch.Tensor
    """[rows, vocab] float: how often the row has generated the token."""


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
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """Sparse (rows, token ids, biases) to add to the logits."""
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    """Sparse (rows, token ids) whose logits become -inf (bad words, EOS before min_tokens)."""
    penalties: PenaltyTensors | None = None
    max_num_logprobs: int | None = None
    """Largest top-logprobs count requested in the batch; None: no row wants logprobs."""
    max_top_k: int | None = None
    """Host-side summary: the largest top-k of the batch (0: none). None: read from the device."""
    any_top_p: bool | None = None
    any_min_p: bool | None = None
    token_bitmask: tuple[torch.Tensor, torch.Tensor | list[int]] | None = None
    """Structured outputs: (``[rows, ceil(vocab / 32)]`` int32 bitmask, the rows it masks, best as a
    tensor on the logits' device): those rows may sample only the tokens whose bit is set (bit
    ``t % 32`` of word ``t // 32``)."""


@dataclass
class LogprobsTensors:
    """Logprobs of the sampled tokens: ``[rows, k]`` top ids/values (sorted descending) and the sampled one."""

    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor
    """1-based rank of the sampled token among the vocabulary by logprob (1 = most likely)."""


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    max_top_k: int | None = None,
    any_top_p: bool | None = None,
    any_min_p: bool | None = None,
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus / min-p set to -inf (ties at the edge are kept).

    Only top-p needs the full-vocabulary sort (the expensive part on a CPU);
    top-k alone uses ``topk`` of the largest k in the batch, min-p only the row max.
    ``max_top_k`` / ``any_top_p`` / ``any_min_p``, when the caller knows them on the host,
    spare the device round trips (GPU syncs) that reading them from the tensors costs.
    """
    vocab = logits.shape[-1]
    keep_floor = torch.full_like(top_p, float("-inf"))
    has_k, has_p, has_min_p = top_k > 0, top_p < 1.0, min_p > 0
    any_p = bool(has_p.any()) if any_top_p is None else any_top_p
    if max_top_k is None:
        max_top_k = int(top_k.max()) if bool(has_k.any()) else 0
    sorted_logits = logits.sort(dim=-1, descending=True)[0] if any_p else None
    if max_top_k > 0:
        kth_index = (top_k.clamp(1, vocab) - 1).unsqueeze(-1)
        if sorted_logits is None:
            largest = logits.topk(min(max_top_k, vocab), dim=-1)[0]
            kth = largest.gather(-1, kth_index).squeeze(-1)
        else:
            kth = sorted_logits.gather(-1, kth_index).squeeze(-1)
        keep_floor = torch.where(has_k, kth, keep_floor)
        if sorted_logits is not None:
            # top-p then applies to the distribution renormalised over the top-k set
            sorted_logits = sorted_logits.masked_fill(sorted_logits < keep_floor.unsqueeze(-1), float("-inf"))
    if any_p:
        probs = sorted_logits.softmax(-1)
        cum_before = probs.cumsum(-1) - probs
        # the smallest prefix whose mass reaches top_p: token i is kept if the mass before it < top_p
        inside = cum_before < top_p.unsqueeze(-1)
        last_inside = inside.sum(-1).clamp(min=1) - 1
        pth = sorted_logits.gather(-1, last_inside.unsqueeze(-1)).squeeze(-1)
        keep_floor = torch.where(has_p, torch.maximum(keep_floor, pth), keep_floor)
    if bool(has_min_p.any()) if any_min_p is None else any_min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        mth = logits.max(dim=-1)[0] + torch.log(min_p.clamp(min=1e-30))
        keep_floor = torch.where(has_min_p, torch.maximum(keep_floor, mth), keep_floor)
    return logits.masked_fill(logits < keep_floor.unsqueeze(-1), float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | list[int]) -> None:
    """In place: ``-inf`` for every token the rows ``rows`` may not sample (xgrammar's batched kernel:
    C++ on a CPU, Triton on a GPU). ``rows`` on the logits' device spares a host-to-device copy
    from pageable memory (which the driver may make wait for the stream) at every step.

    ``bitmask`` is ``[len(logits), words]`` int32 (bit ``t % 32`` of word ``t // 32`` allows token t);
    only the listed rows are masked. Tokens past the bitmask's width (an LM head padded past the
    grammar's vocabulary) are never allowed.
    """
    import xgrammar as xgr

    width = bitmask.shape[-1] * 32
    vocab = logits.shape[-1]
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab, width), indices=rows)
    if vocab > width:
        logits[rows, width:] = float("-inf")


def apply_penalties(logits: torch.Tensor, p: PenaltyTensors) -> torch.Tensor:
    """vLLM's penalty formulas, in place on ``logits``.

    repetition (tokens in prompt or output): ``l / r`` if ``l > 0`` else ``l * r``;
    then ``l -= frequency * count + presence * (count > 0)`` over output tokens.
    """
    output_mask = p.output_counts > 0
    rep = torch.where(p.prompt_mask | output_mask, p.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits -= p.frequency.unsqueeze(1) * p.output_counts
    logits -= p.presence.unsqueeze(1) * output_mask
    return logits


def compute_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """Top-``k`` logprobs (sorted descending), the sampled token's logprob and its rank."""
    logprobs = raw_logits.log_softmax(dim=-1)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], sampled[:, None][:, :0])
    sampled_lp = logprobs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    ranks = (logprobs > sampled_lp.unsqueeze(-1)).sum(-1) + 1
    return LogprobsTensors(top_ids, top_lp, sampled_lp, ranks)


class Sampler:
    """Turns float32 logits ``[rows, vocab]`` into one token id per row (plus logprobs when asked)."""

    def __call__(
        self, logits: torch.Tensor, params: SamplingTensors, greedy_tokens: torch.Tensor | None = None
    ) -> SamplerOutput:
        """``greedy_tokens``: the argmax of ``logits`` when already known (the decode CUDA graphs
        compute it); used only if no logit processing (bias, bans, penalties) applies."""
        raw = logits
        logits = self.process_logits(logits, params)
        if greedy_tokens is None or logits is not raw:
            greedy_tokens = logits.argmax(dim=-1)
        if params.all_greedy:
            tokens = greedy_tokens
        else:
            tokens = self._sample(logits, greedy_tokens, params)
        logprobs = None
        if params.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw.float(), tokens, params.max_num_logprobs)
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        """The grammar bitmask, logit_bias, banned tokens, then penalties; returns the input itself
        when none apply."""
        if (
            params.logit_bias is None
            and params.banned is None
            and params.penalties is None
            and params.token_bitmask is None
        ):
            return logits
        logits = logits.clone()
        if params.token_bitmask is not None:
            apply_token_bitmask(logits, *params.token_bitmask)
        if params.logit_bias is not None:
            rows, cols, values = params.logit_bias
            logits.index_put_((rows, cols), values.to(logits.dtype), accumulate=True)
        if params.banned is not None:
            rows, cols = params.banned
            logits[rows, cols] = float("-inf")
        if params.penalties is not None:
            logits = apply_penalties(logits, params.penalties)
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, greedy_tokens: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        temperature = params.temperature
        is_greedy = temperature == 0
        scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
        scaled = apply_top_k_top_p_min_p(
            scaled,
            params.top_k,
            params.top_p,
            params.min_p,
            params.max_top_k,
            params.any_top_p,
            params.any_min_p,
        )
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in params.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, sampled)
