"""Front-end request preparation: tokenization, validation, fan-out of ``n`` choices."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastdeploy.core.mm_item import MMItem
from fastdeploy.core.pooling_params import PoolingParams
from fastdeploy.core.request import EngineCoreRequest, longest_prompt
from fastdeploy.core.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    resolve_logprobs,
)
from fastdeploy.engine.output_processor import child_request_id


class PromptTooLongError(ValueError):
    """The prompt (plus requested output) does not fit the model's context."""


class PromptTokenError(ValueError):
    """A prompt token id outside the model's vocabulary (a client's ids, or a mismatched tokenizer)."""


class InputProcessor:
    """Turns user prompts into engine-core requests."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        eos_token_ids: list[int],
        vocab_size: int | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        if max_logprobs < -1:
            raise ValueError(f"max_logprobs must be at least 0, or -1 for no bound (got {max_logprobs})")
        self.max_logprobs = max_logprobs
        """Most logprobs a request may ask for per token (``--max-logprobs``; -1: the vocabulary)."""

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """Check token ids against the vocabulary and the logprobs asked against ``max_logprobs`` (-1
        made the vocabulary size), tokenize ``bad_words`` (a new object when needed)."""
        if self.vocab_size is not None:
            params.check_vocab(self.vocab_size)
        params = resolve_logprobs(params, self.max_logprobs, self.vocab_size)
        if params.stop and self.tokenizer is None:
            # stop strings are matched on detokenized text, which needs a tokenizer
            raise SamplingParamsError("stop", "stop strings need a tokenizer; use stop_token_ids")
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise SamplingParamsError("bad_words", "bad_words need a tokenizer")
            params = params.clone(bad_words_token_ids=bad_words_token_ids(self.tokenizer, params.bad_words))
        return params

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "no tokenizer is loaded (the model has none, or skip_tokenizer_init is set); "
                "pass prompt token ids instead of text"
            )
        return self.tokenizer.encode(prompt)

    def validate(
        self, prompt_token_ids: list[int], pooling: bool = False, max_tokens: int | None = None
    ) -> None:
        """Refuse an empty prompt, one too long for the context (a generated prompt needs room for
        one output token; an embedded one, or one only scored, ``max_tokens == 0``, does not) and
        token ids outside the vocabulary."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        longest = longest_prompt(self.max_model_len, pooling, max_tokens)
        if len(prompt_token_ids) > longest:
            room = "" if longest == self.max_model_len else " (prompt plus at least one generated token)"
            raise PromptTooLongError(
                f"the prompt has {len(prompt_token_ids)} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens{room}"
            )
        if self.vocab_size is not None:
            low, high = min(prompt_token_ids), max(prompt_token_ids)
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise PromptTokenError(
                    f"prompt token id {bad} is out of vocabulary (vocabulary size {self.vocab_size}); "
                    "does the tokenizer belong to this model?"
                )

    def make_core_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        mm_items: Sequence[MMItem] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine-core request per choice; seeded choices get distinct seeds.

        ``mm_items`` (placed by :func:`fastdeploy.multimodal.items.expand_placeholders`)
        travel with every choice, features included. ``pooling_params``: an embedding request
        (pooled after its prefill, never sampled; ``params.n`` must be 1).
        """
        self.validate(prompt_token_ids, pooling=pooling_params is not None, max_tokens=params.max_tokens)
        mm_wire = validate_mm_items(mm_items, len(prompt_token_ids)) if mm_items else None
        params = self.prepare_params(params)
        arrival_time = time.time() if arrival_time is None else arrival_time
        requests = []
        for i in range(params.n):
            child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            requests.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, i, params.n),
                    prompt_token_ids=list(prompt_token_ids),
                    sampling_params=child_params,
                    eos_token_ids=list(self.eos_token_ids),
                    arrival_time=arrival_time,
                    mm_items=mm_wire,
                    pooling_params=pooling_params,
                )
            )
        return requests


def validate_mm_items(items: Sequence[MMItem], num_prompt_tokens: int) -> list[dict[str, Any]]:
    """Wire form of a prompt's multimodal items; ValueError unless they lie in order inside the prompt."""
    end = 0
    for item in sorted(items, key=lambda it: it.offset):
        if item.offset < end or item.length <= 0 or item.end > num_prompt_tokens:
            raise ValueError(
                f"multimodal item at tokens {item.offset}..{item.end} overlaps another or lies outside "
                f"the prompt of {num_prompt_tokens} tokens"
            )
        if item.features is None or tuple(item.features.shape[:1]) != (item.length,):
            raise ValueError(f"multimodal item at token {item.offset} needs features with {item.length} rows")
        end = item.end
    return [item.to_wire() for item in items]


def eos_ids_of(arch_eos: list[int], tokenizer: Any) -> list[int]:
    """EOS ids from the model config plus the tokenizer's EOS token."""
    ids = set(arch_eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Token sequences of each bad word, as vLLM does: the word alone and with a leading space.

    Mid-sentence a word is usually tokenized with its leading space ("Ġword"), at
    the start without; both forms are banned. Duplicates are dropped.
    """
    seqs: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return seqs
