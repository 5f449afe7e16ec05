"""The wire shapes of logprobs, as a client reads them: OpenAI's documented counts, special tokens' text, tokens
that hold part of a character, offsets into the text."""

from __future__ import annotations

import pytest

from app.wire.openai.chat import ChatFormat
from app.wire.openai.choices import Choice, token_string
from app.wire.openai.completions import CompletionFormat
from engine.core.streams import Delta
from engine.core.tokenizer import ByteTokenizer
from engine.core.types import TokenLogprob

BYTES = ByteTokenizer()
A, B, C = ord("a"), ord("b"), ord("c")


def completion_logprobs(entries: list[TokenLogprob], prompt: list[int] | None = None) -> dict:
    choice = Choice(0, logprobs=entries, token_ids=[e.token_id for e in entries])
    return CompletionFormat(BYTES, [prompt or [A]]).choice(0, choice, want_logprobs=True)["logprobs"]


def test_completions_top_logprobs_always_hold_the_sampled_token() -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to logprobs+1
    elements"."""
    sampled_outside = TokenLogprob(C, -3.0, ((A, -0.5), (B, -1.0)))  # logprobs: 2, sampled the third likeliest
    sampled_inside = TokenLogprob(A, -0.5, ((A, -0.5), (B, -1.0)))
    zero = TokenLogprob(B, -1.0, ())  # logprobs: 0
    top = completion_logprobs([sampled_outside, sampled_inside, zero])["top_logprobs"]
    assert top == [{"a": -0.5, "b": -1.0, "c": -3.0}, {"a": -0.5, "b": -1.0}, {"b": -1.0}]


def test_chat_top_logprobs_hold_exactly_the_number_asked_for() -> None:
    entry = TokenLogprob(C, -3.0, ((A, -0.5), (B, -1.0)))
    content = ChatFormat(BYTES).choice(0, Choice(0, logprobs=[entry]), want_logprobs=True)["logprobs"]["content"]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "b"]
    assert content[0]["token"] == "c" and content[0]["bytes"] == [C]


def test_special_tokens_keep_their_text_and_partial_characters_are_spelled_as_bytes() -> None:
    eos, e_acute = ByteTokenizer.EOS, "é".encode()  # two bytes, two tokens
    entries = [TokenLogprob(t, -1.0, ((t, -1.0), (eos, -2.0))) for t in [A, *e_acute, eos]]
    logprobs = completion_logprobs(entries)
    assert logprobs["tokens"] == ["a", "bytes:\\xc3", "bytes:\\xa9", "<eos>"]
    assert logprobs["text_offset"] == [0, 1, 1, 2]  # the character starts where its first byte does
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])  # no two keys collapsed into one
    chat = ChatFormat(BYTES).choice(0, Choice(0, logprobs=entries[1:3]), want_logprobs=True)["logprobs"]["content"]
    assert [entry["bytes"] for entry in chat] == [[0xC3], [0xA9]]  # the token's own bytes, not U+FFFD's


def test_tokens_that_share_a_string_are_all_kept() -> None:
    class Colliding(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            return b"x" if token_id in (A, B) else super().token_bytes(token_id)

    fmt = CompletionFormat(Colliding(), [[A]])
    top = fmt.choice(0, Choice(0, logprobs=[TokenLogprob(A, -0.5, ((A, -0.5), (B, -0.9)))]), True)["logprobs"]
    assert top["top_logprobs"] == [{"x": -0.5, f"token_id:{B}": -0.9}]


def test_streamed_offsets_continue_across_deltas() -> None:
    fmt, choice = CompletionFormat(BYTES, [[A]]), Choice(0)
    offsets = []
    for token, text in [(A, "a"), (0xC3, ""), (0xA9, "é"), (B, "b")]:
        delta = Delta(text, [token], None, [TokenLogprob(token, -1.0, ())])
        choice.parts.append(text)
        offsets += fmt.delta(0, choice, delta, want_logprobs=True, first=False)["logprobs"]["text_offset"]
    assert offsets == [0, 1, 1, 2]


@pytest.mark.real_model
def test_the_real_tokenizers_special_and_multibyte_tokens(real_model) -> None:
    from engine.core.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(real_model.tokenizer, real_model.eos_token_ids)
    text = "<|im_start|>user\nhéllo 日本<|im_end|>"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(t) for t in ids).decode() == text
    strings = [token_string(tokenizer, t) for t in ids]
    assert strings[0] == "<|im_start|>" and strings[-1] == "<|im_end|>"
    assert any(s.startswith("bytes:") for s in strings)  # 日 spans tokens here
    assert tokenizer.info()["eos_token"] == "<|im_end|>" and tokenizer.info()["chat_template"]
