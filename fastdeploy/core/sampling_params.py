"""Per-request sampling and output controls."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for per token by default (``--max-logprobs``, as vLLM's and
OpenAI's ``top_logprobs`` bound)."""
ALL_LOGPROBS = -1
"""A request's ``logprobs`` / ``prompt_logprobs`` (and ``--max-logprobs``) asking for the whole
vocabulary; the front end replaces it by the vocabulary size (:func:`resolve_logprobs`)."""


@dataclass
class StructuredOutputsParams:
    """The one constraint a request's output must satisfy (grammar-guided decoding).

    Exactly one field is set: ``json`` (a JSON schema, as a dict or its JSON text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings),
    ``grammar`` (an EBNF / GBNF grammar) or ``structural_tag`` (xgrammar's structural tag,
    as JSON text). The front end fills it from ``response_format``, ``structured_outputs``,
    ``guided_*`` or a forced tool call; the engine compiles it once per distinct value.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    reasoning_prefix: str | None = None
    """An EBNF grammar of the reasoning a reasoning model writes before its answer (set by the front
    end with ``--reasoning-parser``): the constraint applies to what follows it, so the model
    thinks freely and the answer alone follows the schema (not a constraint of its own)."""

    def __post_init__(self) -> None:
        chosen = [name for name in self.CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                f"exactly one structured-output constraint must be given, got {chosen or 'none'}",
            )

    CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
    """The constraint fields, one of which is set."""

    @property
    def kind(self) -> str:
        """The name of the field that is set (``"json"``, ``"regex"``, ...)."""
        return next(name for name in self.CONSTRAINTS if getattr(self, name) not in (None, False))


def _is_int(key: object) -> bool:
    """Whether a ``logit_bias`` key reads as an integer (JSON gives strings)."""
    try:
        int(key)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True


class SamplingParamsError(ValueError):
    """An out-of-range sampling field; ``param`` names the field for the 400 body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one request.

    ``temperature == 0`` means greedy. Validation happens in ``__post_init__`` so
    that a bad value fails where it is created, with the field's name.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    """> 1 discourages tokens already in the prompt or output (logit / p if > 0 else logit * p)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    logit_bias: dict[int, float] | None = None
    """Token id → bias added to its logit before sampling (OpenAI's ``logit_bias``)."""
    bad_words: list[str] = field(default_factory=list)
    """Words whose token sequences must never be generated."""
    bad_words_token_ids: list[list[int]] | None = None
    """``bad_words`` tokenized (filled by the front end, which owns the tokenizer)."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs per token (None: off)."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its logprob given the tokens before it plus
    this many top alternatives (None: off). Such a request never reads the prefix cache."""
    structured_outputs: StructuredOutputsParams | None = None
    """A grammar the output must follow (JSON schema, regex, choice, ...); None: free text."""
    cache_salt: str | None = None
    """The request's prefix-cache reads and writes are kept apart from every request without the
    same salt (vLLM's ``cache_salt``): tenants sharing a server cannot time each other's prompts."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        self._check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        self._check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self._check(
            self.top_k == -1 or 1 <= self.top_k < 1 << 63,
            "top_k",
            f"top_k must be -1 (off) or in [1, 2**63), got {self.top_k}",
        )
        self._check(
            self.seed is None or -(1 << 63) <= self.seed < 1 << 63,
            "seed",
            "seed must fit in a signed 64-bit integer",
        )
        self._check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        self._check(
            self.max_tokens is None or self.max_tokens >= 0,
            "max_tokens",
            f"max_tokens must be >= 0, got {self.max_tokens}",
        )
        self._check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        self._check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        self._check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        self._check(
            self.cache_salt is None or (isinstance(self.cache_salt, str) and bool(self.cache_salt)),
            "cache_salt",
            "cache_salt must be a non-empty string",
        )
        self._check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check(-2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}")
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        self.bad_words = list(self.bad_words or [])
        self._check(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            "bad_words must be non-empty strings",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._check(
                value is None or value >= ALL_LOGPROBS,
                name,
                f"{name} must be at least 0 (or -1: the whole vocabulary), got {value}",
            )

    @classmethod
    def _normalize_logit_bias(cls, bias: dict | None) -> dict[int, float] | None:
        """Int keys (JSON and msgpack may give strings), biases checked to be in [-100, 100]."""
        if not bias:
            return None
        not_ids = [key for key in bias if not _is_int(key)]
        if not_ids:  # (every one named: a client fixing them all at once)
            named = ", ".join(repr(key) for key in not_ids)
            raise SamplingParamsError(
                "logit_bias", f"logit_bias key{'s' if len(not_ids) > 1 else ''} {named}: not a token id"
            )
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key)
            cls._check(token >= 0, "logit_bias", f"logit_bias token id {token} is negative")
            cls._check(
                isinstance(value, (int, float)) and -100 <= value <= 100,
                "logit_bias",
                f"logit_bias value for token {token} must be in [-100, 100], got {value}",
            )
            out[token] = float(value)
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids given by the user must exist in the vocabulary (they index the logits)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            for token in ids:
                self._check(
                    token < vocab_size,
                    name,
                    f"token id {token} is out of vocabulary (vocabulary size {vocab_size})",
                )

    @staticmethod
    def _check(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token every step."""
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> SamplingParams:
        """A copy with some fields changed (used to fan out ``n`` choices)."""
        return dataclasses.replace(self, **changes)


def resolve_logprobs(
    params: SamplingParams,
    max_logprobs: int,
    vocab_size: int | None,
    field_names: dict[str, str] | None = None,
) -> SamplingParams:
    """``params`` with ``logprobs`` / ``prompt_logprobs`` of -1 replaced by ``vocab_size`` (the whole
    vocabulary), checked against the server's ``max_logprobs`` (``--max-logprobs``; -1: no bound).
    Raises :class:`SamplingParamsError` naming the field (``field_names`` maps a field to the
    request's name for it, e.g. chat's ``top_logprobs``) when a value asks for more. A copy when a
    value changes (the engine never sees -1: it means "none" there)."""
    names = field_names or {}
    changes: dict[str, int] = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        shown = names.get(name, name)
        if value == ALL_LOGPROBS:
            if vocab_size is None:
                raise SamplingParamsError(shown, f"{shown}: -1 needs the model's vocabulary size")
            value = vocab_size
        if max_logprobs != ALL_LOGPROBS and value > max_logprobs:
            asked = "-1 (the whole vocabulary)" if getattr(params, name) == ALL_LOGPROBS else str(value)
            raise SamplingParamsError(
                shown,
                f"{shown} of {asked} is more than this server allows: at most {max_logprobs} "
                "(its --max-logprobs)",
            )
        if vocab_size is not None and value > vocab_size:
            raise SamplingParamsError(
                shown, f"{shown} of {value} is more than the vocabulary ({vocab_size} tokens)"
            )
        if value != getattr(params, name):
            changes[name] = value
    return params.clone(**changes) if changes else params
