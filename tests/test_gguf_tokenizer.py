"""A SentencePiece GGUF's tokenizer (``engine/runtime/gguf_tokenizer.py``) puts spaces where SentencePiece and
llama.cpp put them: the leading "▁" before every text, each space a "▁" of its own, however many there are, and the
text after a special token prefixed too. (Against llama.cpp's own ``/tokenize`` on a file its converter wrote from
a trained SentencePiece model: ``tests/test_user_model.py``.)"""

from __future__ import annotations

import pytest
from gguf import GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

SPACE = "\u2581"
#: Pieces besides the specials and bytes, best merge first (SentencePiece BPE's scores).
PIECES = [SPACE * 4, SPACE * 2, "de", "ep", SPACE + "d", SPACE + "x", SPACE, "d", "e", "p", "x"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from engine.runtime import gguf_tokenizer

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 8), ("attention.head_count", 1)):  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *PIECES]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(PIECES))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(PIECES))  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_tokenizer.convert(path)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=" dexp", min_size=1, max_size=40))
def test_every_space_is_a_piece_s_and_a_prefix_comes_first(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids[0] == 1  # the file's add_bos_token
    assert "".join(tokenizer.convert_ids_to_tokens(ids[1:])) == SPACE + text.replace(" ", SPACE)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_indentation_and_text_after_a_special_token(tokenizer) -> None:
    """32 spaces of indentation: 33 "▁" (the prefix and one each; transformers' own conversion gave 32); after
    ``<s>`` the text is prefixed again, as llama.cpp does."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(" " * 32 + "deep"))
    assert pieces == ["<s>", *[SPACE * 4] * 8, SPACE, "de", "ep"]  # "de" outranks "▁d": merged first
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("<s>x", add_special_tokens=False)) == ["<s>", SPACE + "x"]


def test_byte_level_special_tokens_outside_the_byte_alphabet_keep_their_ids(tmp_path) -> None:
    """DeepSeek-R1 distills' control tokens (full-width bars, "▁") in a byte-level vocabulary: each is the token of
    its id, whole in text, left out of decoded text; BOS and EOS are those ids and nothing is appended past the
    vocabulary (transformers had appended them, and a chat prompt's BOS crashed the model's embedding lookup)."""
    from gguf_files import tiny_model, write_gguf

    from engine.runtime import gguf_tokenizer, loader

    bar = "\uff5c"
    names = {1: f"<{bar}begin{SPACE}of{SPACE}sentence{bar}>", 2: f"<{bar}end{SPACE}of{SPACE}sentence{bar}>",
             5: f"<{bar}User{bar}>", 6: f"<{bar}Assistant{bar}>"}  # fmt: skip
    path = tmp_path / "r1.gguf"
    write_gguf(tiny_model("llama", vocab=49152), "llama", path, loader._default_gguf(), {}, renamed=names)
    converted = gguf_tokenizer.convert(path)
    assert len(converted) == 49152
    assert converted.convert_tokens_to_ids([converted.bos_token, converted.eos_token]) == [1, 2]
    ids = converted.encode(f"{names[5]}Hi{names[6]}", add_special_tokens=False)
    assert ids[0] == 5 and ids[-1] == 6 and converted.decode(ids, skip_special_tokens=True) == "Hi"
