"""A GGUF's tokenizer: transformers' conversion of the file's ``tokenizer.*`` keys, with SentencePiece files' spaces
as SentencePiece (and llama.cpp) treat them.

transformers builds a SentencePiece vocabulary (``tokenizer.ggml.model`` ``llama``: Llama 2, Mistral, Phi-3, Gemma)
with a ``Metaspace`` pre-tokenizer that adds the leading "▁" only where the text does not already start with a
space: ``" x"`` became ``"▁x"``, where SentencePiece makes ``"▁▁x"``, and 32 spaces of indentation came out one
short. Here the "▁" is prepended to every piece of text between special tokens when the file says so
(``tokenizer.ggml.add_space_prefix``, true unless given), and every space becomes "▁", as llama.cpp's tokenizer
does; the ids then equal llama.cpp's ``/tokenize`` and SentencePiece's own.

``load`` keeps the converted pipeline through transformers' save and load: the class ``AutoTokenizer`` chooses by
model type (``GemmaTokenizer``, ``Qwen2Tokenizer``) rebuilds its own pipeline when loaded, over whatever vocabulary
the file holds (a gemma3 file's byte-level vocabulary had every word split into bytes; Qwen2's NFC normalization, which
llama.cpp does not do, changed decomposed characters' ids). The file's ``tokenizer.*`` keys are the tokenizer, as
llama.cpp reads them.

A byte-level file's special tokens spelled outside the byte alphabet (DeepSeek's begin-of-sentence and User tokens,
written with full-width bars and "▁") are the tokens of their ids, as llama.cpp reads them: transformers skips them
as mislabelled, so the template's User marker came out as a dozen byte tokens, and BOS and EOS were appended as new
ids past the model's embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, normalizers

from engine.runtime.gguf_file import GGUFFile

SPACE = "\u2581"


def convert(gguf: Path) -> Any:
    """The transformers tokenizer of the GGUF file ``gguf``: transformers' conversion of the file's tokenizer keys,
    under its generic class. ``AutoTokenizer`` built the same pipeline, after reading the whole file's metadata with
    gguf-py's reader to choose the class (a numpy view per token string: 13 s of a Qwen file's 15, 21 s of gpt-oss's;
    and a TypeError on gpt-oss's YaRN keys)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    keys = GGUFFile(gguf).keys
    if keys.get("tokenizer.ggml.model") == "gpt2":
        tokenizer = _with_specials_as_spelled(tokenizer, gguf)
    if keys.get("tokenizer.ggml.model") == "gemma4" and not tokenizer.add_bos_token:
        tokenizer.add_bos_token = True  # (transformers' conversion leaves it out; llama.cpp always adds it for Gemma 4)
    if keys.get("tokenizer.ggml.model") == "llama":
        steps = [normalizers.Replace(" ", SPACE)]
        if keys.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend(SPACE))
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence(steps)
        backend.pre_tokenizer = None
    return tokenizer


def load(directory: Path) -> Any:
    """The tokenizer ``convert`` made and ``save_pretrained`` saved in ``directory``, as it was: under transformers'
    generic class (``AutoTokenizer`` would pick the class of the directory's model type)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def _with_specials_as_spelled(tokenizer: Any, gguf: Path) -> Any:
    """``tokenizer`` with the file's control and user-defined tokens that a byte-level vocabulary cannot spell
    (transformers respells them byte by byte and skips them) as added tokens of their own ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.reader import read_gguf_metadata

    keys, _ = read_gguf_metadata(gguf, ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    tokens = keys["tokenizer.ggml.tokens"]
    types = keys.get("tokenizer.ggml.token_type", [1] * len(tokens))
    alphabet = set(bytes_to_unicode().values())
    marked = enumerate(zip(tokens, types, strict=True))
    odd = {i: token for i, (token, kind) in marked if kind in (3, 4) and not set(token) <= alphabet}
    if not odd:
        return tokenizer
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    spelled = {index: token for token, index in vocab.items() if index in odd}
    for index, token in odd.items():
        vocab.pop(spelled.get(index, token), None)
        vocab[token] = index
    kept = [added for added in state["added_tokens"] if added["id"] < len(tokens)]
    state["added_tokens"] = kept + [
        {"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[index] == 3}
        for index, token in odd.items()
    ]  # fmt: skip
    names = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    rebuilt = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)), chat_template=tokenizer.chat_template,
        **{name: value for name, value in names.items() if value is not None},
    )  # fmt: skip
    return rebuilt
