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
