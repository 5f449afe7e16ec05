from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.detokenizer import IncrementalDetokenizer, decode_keeping
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


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("aé世🎉 \n"), max_size=12), marks=st.lists(st.integers(0, 12), max_size=4))
def test_kept_special_tokens_keep_their_spelling_where_they_came(text: str, marks: list[int]) -> None:
    """A tool call's marker tokens (here the EOS token, ``<eos>``) stay in the text at their place, even between
    the bytes of one character; other special tokens are still left out."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    for mark in sorted(marks, reverse=True):
        ids.insert(min(mark, len(ids)), ByteTokenizer.EOS)
    keep = frozenset({ByteTokenizer.EOS})
    detok = IncrementalDetokenizer(tokenizer, keep)
    streamed = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert streamed == decode_keeping(tokenizer, ids, keep)
    assert streamed.count(ByteTokenizer.EOS_TEXT) == len(marks)
    plain = IncrementalDetokenizer(tokenizer)
    assert "".join(plain.add([t]) for t in ids) + plain.flush() == tokenizer.decode(ids)
