"""openai-harmony's ``o200k_harmony`` encoding for a model that speaks harmony, loaded from the model's own
vocabulary: the library would download o200k_base's ranks, and this server reads nothing from the network. The
first 199,998 tokens of the model's vocabulary, written as a tiktoken ranks file, must be o200k_base's byte for byte
(the library's own SHA-256 of that file), and harmony's markers the model's tokens of the same ids: else the model
is not served as harmony (its chat template and raw text are used, with a warning)."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from engine.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

#: o200k_base's ranks file (``o200k_base.tiktoken``) as OpenAI publishes it, and as openai-harmony checks it.
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_SIZE = 199_998
#: The markers a harmony reply is written and read with.
START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

#: The library reads the ranks file's folder from the environment: one load at a time.
_LOADING = threading.Lock()


@dataclass(slots=True, frozen=True)
class Harmony:
    """One model's harmony encoding and its markers' token ids."""

    encoding: HarmonyEncoding
    ids: dict[str, int]

    @property
    def stop_ids(self) -> frozenset[int]:
        """What ends a reply: ``<|return|>`` (done) and ``<|call|>`` (a call waits for its result)."""
        return frozenset(self.encoding.stop_tokens_for_assistant_actions())

    @property
    def marker_ids(self) -> frozenset[int]:
        """The markers whose spelling the generated text keeps, for the reader to see."""
        return frozenset(self.ids.values())


def speaks_harmony(template: str | None, added: dict[str, int]) -> bool:
    """Whether a chat template writes harmony (gpt-oss's) with markers that are the vocabulary's tokens."""
    return template is not None and CHANNEL in template and all(marker in added for marker in MARKERS)


def load(tokenizer: Tokenizer) -> Harmony | None:
    """The encoding of a model whose template writes harmony; None (with a warning saying why) where its
    vocabulary is not o200k_harmony's."""
    if not speaks_harmony(tokenizer.info().get("chat_template"), tokenizer.added):
        return None
    harmony = _harmony(tokenizer)
    if isinstance(harmony, Harmony):
        return harmony
    log.warning("the chat template writes harmony, but %s: replies are read as text", harmony)
    return None


def _harmony(tokenizer: Tokenizer) -> Harmony | str:
    """The encoding, or why the vocabulary is not its."""
    if tokenizer.vocab_size < O200K_SIZE:
        return f"the vocabulary has {tokenizer.vocab_size} tokens, fewer than o200k's {O200K_SIZE}"
    ranks = _ranks(tokenizer)
    if hashlib.sha256(ranks).hexdigest() != O200K_SHA256:
        return f"its first {O200K_SIZE} tokens are not o200k_base's"
    encoding = _load_encoding(ranks)
    ids = {marker: tokenizer.added[marker] for marker in MARKERS}
    wrong = [marker for marker, i in ids.items() if encoding.encode(marker, allowed_special="all") != [i]]
    if wrong:
        return f"its {', '.join(wrong)} are other ids than harmony's"
    return Harmony(encoding, ids)


def _ranks(tokenizer: Tokenizer) -> bytes:
    """The vocabulary's first ``O200K_SIZE`` tokens as a tiktoken ranks file: each token's bytes in base64, its id."""
    return b"".join(b"%s %d\n" % (base64.b64encode(tokenizer.token_bytes(i)), i) for i in range(O200K_SIZE))


def _load_encoding(ranks: bytes) -> HarmonyEncoding:
    """The library's encoding, its ranks read from a file written here (checked by it against the same hash)."""
    with _LOADING, tempfile.TemporaryDirectory(prefix="smolserve-harmony-") as folder:
        (Path(folder) / "o200k_base.tiktoken").write_bytes(ranks)
        saved = {name: os.environ.get(name) for name in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR")}
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = os.environ["TIKTOKEN_RS_CACHE_DIR"] = folder
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
