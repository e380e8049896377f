"""Incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 6
"""Prompt tokens kept in the decode window so the first output token keeps its leading space."""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each step decodes a small window of recent tokens twice (with and without
    the new ones) and emits the difference; a window whose text ends in an
    incomplete character (U+FFFD) waits for the next token, and at the end such
    a tail is dropped.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly readable text.

        With ``final`` (the choice ends here) everything left is returned, except
        an incomplete character at the very end (a choice cut by ``max_tokens``
        inside a multi-byte character): its bytes are dropped, never sent as U+FFFD.
        """
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if new_text.endswith("\ufffd"):
            if not final:
                return ""
            new_text = new_text.rstrip("\ufffd")
        if len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta


class StreamDetokenizer:
    """:class:`IncrementalDetokenizer`'s contract on ``tokenizers``' own ``DecodeStream`` (Rust).

    One step per token in the tokenizer's library instead of two Python decodes of a window:
    ~1 µs a token against ~4.5 (docs/benchmarks.md, fifteenth session), which the API server pays
    for every token of every stream. The stream is primed with the prompt's last tokens (their
    text is dropped), so the first output token keeps its leading space; an incomplete character
    stays buffered, and at the end the complete part of what is held back is decoded as
    :class:`IncrementalDetokenizer` does (an end inside a character drops only its bytes). Should the stream refuse a token (some
    tokenizers' decoders reject a prefix), the request goes on with :class:`IncrementalDetokenizer`
    from the last text the stream gave.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = tokenizer._tokenizer
        self._context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        """The last tokens whose text is out (a fallback detokenizer's context)."""
        self._pending: list[int] = []
        """Tokens stepped since the stream last gave text (an incomplete character, say)."""
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fallback: IncrementalDetokenizer | None = None
        self.text = ""
        try:
            for token in self._context:
                self._stream.step(self._backend, token)
        except Exception:  # noqa: BLE001 - tokenizers raises plain exceptions
            self._fall_back()

    def _complete_tail(self) -> str:
        """The text of the held-back tokens up to their incomplete last character (a token such as
        ``" ðŁ"``: a space, then half an emoji — the space is text), as the Python detokenizer ends."""
        tail = IncrementalDetokenizer(self.tokenizer, self._context, self.skip_special_tokens)
        pending, self._pending = self._pending, []
        return tail.add_tokens(pending, final=True)

    def _fall_back(self) -> None:
        self._fallback = IncrementalDetokenizer(self.tokenizer, self._context, self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly readable text (see :meth:`IncrementalDetokenizer.add_tokens`)."""
        pieces = []
        if self._fallback is None:
            for i, token in enumerate(token_ids):
                try:
                    piece = self._stream.step(self._backend, token)
                except Exception:  # noqa: BLE001
                    self._fall_back()
                    token_ids = self._pending + token_ids[i:]  # (their text was not out yet)
                    break
                self._pending.append(token)
                if piece:
                    pieces.append(piece)
                    self._context = (self._context + self._pending)[-_PROMPT_CONTEXT:]
                    self._pending = []
        if self._fallback is not None:
            pieces.append(self._fallback.add_tokens(token_ids, final=final))
        elif final and self._pending:  # the complete part of what the stream holds back, as the end
            pieces.append(self._complete_tail())
        delta = "".join(pieces)
        self.text += delta
        return delta


def new_detokenizer(
    tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True
) -> IncrementalDetokenizer | StreamDetokenizer:
    """The fastest detokenizer that gives the tokenizer's own text: :class:`StreamDetokenizer` for a
    ``tokenizers``-backed tokenizer that does not clean up spaces after decoding (the stream does
    not), else :class:`IncrementalDetokenizer`."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        try:
            import tokenizers
            from tokenizers.decoders import DecodeStream  # noqa: F401 - (tokenizers >= 0.21)
        except ImportError:
            return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        if isinstance(backend, tokenizers.Tokenizer):
            return StreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
