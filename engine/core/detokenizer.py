"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding token by token is wrong for byte-level BPE: one character can span several tokens, and a token's
text can depend on its neighbours (leading spaces). So each delta decodes the tokens since the previous
delta's start again as context and emits only what is new, holding back text that ends in an incomplete
UTF-8 character (U+FFFD) until the next token completes it. The joined deltas equal ``decode(all_ids)``.

Special tokens are left out of the text, but for those ``keep`` names (a tool call's markers, which the parser
must see where the model wrote them): their spelling stays, and the text either side is decoded as before.
"""

from __future__ import annotations

from engine.core.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._keep = keep
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this have been emitted as text

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back, replacement characters included."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        if not self._keep or self._keep.isdisjoint(ids):
            return self._tokenizer.decode(ids)
        return decode_keeping(self._tokenizer, ids, self._keep)


def decode_keeping(tokenizer: Tokenizer, ids: list[int], keep: frozenset[int]) -> str:
    """``ids`` as text without special tokens but those in ``keep``, which keep their spelling."""
    parts: list[str] = []
    start = 0
    for i, token in enumerate(ids):
        if token in keep:
            parts += [tokenizer.decode(ids[start:i]), tokenizer.token_bytes(token).decode("utf-8", "replace")]
            start = i + 1
    parts.append(tokenizer.decode(ids[start:]))
    return "".join(parts)
