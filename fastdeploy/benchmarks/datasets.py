"""Benchmark prompts: ``random``, ``sharegpt`` and ``prefix-repetition``.

Prompts are text, so the same samples work for ``/v1/completions`` and
``/v1/chat/completions`` and for any server. Their length in tokens is made
exact (up to re-tokenization at word seams) with a tokenizer:

* a local one (``--tokenizer PATH``, or the engine's own offline), or
* the server's ``POST /tokenize`` and ``POST /detokenize`` (ours and vLLM's),
  so nothing has to be downloaded to benchmark a remote server.

Random text is built from random common words, encoded, cut to the wanted
number of tokens and decoded. Words (rather than random token ids, which
decode to byte soup that re-tokenizes to a different length) keep the count
stable; a per-prompt random start keeps prompts from sharing a cached prefix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Protocol

WORDS: tuple[str, ...] = tuple(
    """time person year way day thing man world life hand part child eye woman place work week case
    point government company number group problem fact be have do say get make go know take see come
    think look want give use find tell ask seem feel try leave call good new first last long great little
    own other old right big high different small large next early young important few public bad same
    able to of in for on with at by from up about into over after beneath under above the and a that
    river mountain garden window silver orange quiet rapid gentle bright cloud stone forest ocean
    letter market village engine signal pattern theory music paper light shadow number winter summer
    answer question story bridge travel simple yellow purple animal valley island desert thunder""".split()
)


class Tokenizer(Protocol):
    """What the datasets need from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class SampleRequest:
    """One benchmark prompt and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


class HFTokenizer:
    """A ``transformers`` tokenizer behind the :class:`Tokenizer` protocol."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str) -> HFTokenizer:
        """``path``: an HF tokenizer folder or name, a ``.gguf`` file, or ``default`` (the embedded model's)."""
        if path == "default" or path.endswith(".gguf"):
            from fastdeploy.model_executor.model_loader.default_model import default_model_path
            from fastdeploy.model_executor.model_loader.gguf_loader import load_gguf_tokenizer

            return cls(load_gguf_tokenizer(default_model_path() if path == "default" else path))
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TokenizerUnavailableError(RuntimeError):
    """The server offers no usable ``/tokenize`` / ``/detokenize`` (llama.cpp's, OpenAI's): the user
    must name a local tokenizer (``--tokenizer``)."""


class ServerTokenizer:
    """The server's ``/tokenize`` and ``/detokenize`` endpoints (synchronous; used before the run).

    Raises :class:`TokenizerUnavailableError` when the server cannot be reached, lacks the
    endpoints, or answers them in another shape.
    """

    def __init__(self, base_url: str, model: str | None = None, headers: dict[str, str] | None = None):
        import httpx

        self.model = model
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers or {}, timeout=60)

    def _post(self, path: str, body: dict[str, Any], key: str) -> Any:
        import httpx

        if self.model:
            body = {"model": self.model, **body}
        where = f"{self.client.base_url}{path}"
        try:
            response = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise TokenizerUnavailableError(f"cannot reach {where} ({type(exc).__name__}: {exc})") from None
        if response.status_code != 200:
            raise TokenizerUnavailableError(f"{where} answered HTTP {response.status_code}")
        try:
            return response.json()[key]
        except (ValueError, KeyError, TypeError):
            raise TokenizerUnavailableError(f"{where} answered without a {key!r} field") from None

    def encode(self, text: str) -> list[int]:
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False}, "tokens"))

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"tokens": ids}, "prompt"))

    def close(self) -> None:
        self.client.close()


def random_text(tokenizer: Tokenizer, num_tokens: int, rng: random.Random) -> tuple[str, int]:
    """Text of about ``num_tokens`` tokens of random words; returns it with its exact token count."""
    if num_tokens <= 0:
        return "", 0
    words = [rng.choice(WORDS) for _ in range(num_tokens + 8)]
    ids = tokenizer.encode(" ".join(words))
    while len(ids) < num_tokens:  # words shorter than a token each: add more
        words += [rng.choice(WORDS) for _ in range(num_tokens)]
        ids = tokenizer.encode(" ".join(words))
    text = tokenizer.decode(ids[:num_tokens])
    return text, len(tokenizer.encode(text))


def _lengths(mean: int, range_ratio: float, num: int, rng: random.Random) -> list[int]:
    """``num`` lengths drawn uniformly from ``[mean·(1−r), mean·(1+r)]`` (at least 1)."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num)]


def random_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` random-word prompts of ``input_len`` tokens (± ``range_ratio``)."""
    rng = random.Random(seed)
    in_lens = _lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = _lengths(output_len, range_ratio, num_prompts, rng)
    samples = []
    for n_in, n_out in zip(in_lens, out_lens):
        text, count = random_text(tokenizer, n_in, rng)
        samples.append(SampleRequest(text, count, n_out))
    return samples


def prefix_repetition_dataset(
    tokenizer: Tokenizer,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts that share one of ``num_prefixes`` prefixes (to measure prefix caching), each with its own suffix.

    Prompt ``i`` uses prefix ``i % num_prefixes``; the order is shuffled so equal
    prefixes do not arrive back to back.
    """
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be at least 1")
    rng = random.Random(seed)
    prefixes = [random_text(tokenizer, prefix_len, rng)[0] for _ in range(num_prefixes)]
    samples = []
    for i in range(num_prompts):
        suffix = random_text(tokenizer, suffix_len, rng)[0]
        prompt = prefixes[i % num_prefixes] + " " + suffix
        samples.append(SampleRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    rng.shuffle(samples)
    return samples


def sharegpt_dataset(
    tokenizer: Tokenizer,
    path: str,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampleRequest]:
    """The first human turn of ShareGPT conversations, shuffled with ``seed``.

    The output length is the first reply's token count unless ``output_len`` is
    given. As in vLLM, pairs with a prompt or reply under 4 tokens, a prompt over
    ``max_prompt_len`` or a total over ``max_total_len`` are skipped.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    entries = list(data)
    rng.shuffle(entries)
    samples: list[SampleRequest] = []
    for entry in entries:
        if len(samples) >= num_prompts:
            break
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if prompt_len < 4 or out_len < (1 if output_len is not None else 4):
            continue
        if prompt_len > max_prompt_len or prompt_len + out_len > max_total_len:
            continue
        samples.append(SampleRequest(prompt, prompt_len, out_len))
    if len(samples) < num_prompts:
        raise ValueError(f"{path}: only {len(samples)} usable conversations for {num_prompts} prompts")
    return samples


DATASETS: tuple[str, ...] = ("random", "sharegpt", "prefix-repetition")


def make_dataset(args: Any, tokenizer: Tokenizer) -> list[SampleRequest]:
    """The samples a parsed ``bench`` namespace asks for (``--dataset-name`` and its options)."""
    name = args.dataset_name
    if name == "random":
        return random_dataset(
            tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
        )
    if name == "prefix-repetition":
        return prefix_repetition_dataset(
            tokenizer,
            args.num_prompts,
            args.prefix_len,
            args.suffix_len,
            args.num_prefixes,
            args.output_len,
            args.seed,
        )
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        return sharegpt_dataset(
            tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def add_dataset_args(parser: Any) -> None:
    """The dataset flags shared by ``bench serve`` and ``bench throughput``."""
    group = parser.add_argument_group("dataset options")
    group.add_argument(
        "--dataset-name", choices=DATASETS, default="random", help="Prompt source. [default: random]"
    )
    group.add_argument(
        "--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt)."
    )
    group.add_argument("--num-prompts", type=int, default=100, help="Number of requests. [default: 100]")
    group.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens. [default: 1024]")
    group.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="random / prefix-repetition: output tokens per request. [default: 128]",
    )
    group.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths drawn from [len·(1−r), len·(1+r)]. [default: 0]",
    )
    group.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens.")
    group.add_argument(
        "--suffix-len", type=int, default=256, help="prefix-repetition: per-prompt suffix tokens."
    )
    group.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes.")
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: fixed output length instead of the reply's length.",
    )
