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
llama.cpp reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import normalizers

from engine.runtime.gguf_file import GGUFFile

SPACE = "\u2581"


def convert(gguf: Path) -> Any:
    """The transformers tokenizer of the GGUF file ``gguf``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    keys = GGUFFile(gguf).keys
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
