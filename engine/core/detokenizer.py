"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding token by token is wrong for byte-level BPE: one character can span several tokens, and a token's
text can depend on its neighbours (leading spaces). So each delta decodes the tokens since the previous
delta's start again as context and emits only what is new, holding back text that ends in an incomplete
UTF-8 character (U+FFFD) until the next token completes it. The joined deltas equal ``decode(all_ids)``.
"""

from __future__ import annotations

from engine.core.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this have been emitted as text

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, replacement characters included."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
