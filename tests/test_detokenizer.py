from __future__ import annotations

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.tokenizer import ByteTokenizer


def test_multibyte_characters_are_held_back_until_complete() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo → 世界 🎉"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in tokenizer.encode(text)]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some bytes completed no character on their own


def test_flush_emits_an_incomplete_tail() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.add([0x61, 0xE4]) == ""  # "a" + the first byte of a 3-byte character
    assert detok.flush() == "a\ufffd"
