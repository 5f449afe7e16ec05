"""Sentence-embedding models: what a sentence-transformers folder says about itself, the seam to an encoder, and a
torch-free fake encoder for tests. Torch-free.

A sentence-transformers folder lists its modules in ``modules.json``: the transformer (its path, usually the folder
itself), a ``Pooling`` module (``1_Pooling/config.json``: CLS, mean, max, mean-sqrt-len, last token; several at
once are concatenated in that order, as sentence-transformers does) and optionally ``Normalize``;
``sentence_bert_config.json`` holds ``max_seq_length``. A plain HF directory (no ``modules.json``) is read as mean
pooling, normalized, up to the model's positions.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: Pooling modes in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "lasttoken")


@dataclass(slots=True, frozen=True)
class EncoderSpec:
    """How a folder's model turns token states into one vector."""

    transformer_path: Path
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False
    #: Output sizes the model was trained to truncate to (Matryoshka), from its config; empty: none.
    matryoshka_dims: tuple[int, ...] = ()


def read_spec(folder: str | Path) -> EncoderSpec:
    """The spec of a sentence-transformers folder, or of a plain HF directory."""
    root = Path(folder)
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return EncoderSpec(root, matryoshka_dims=_matryoshka(root))
    modules = json.loads(modules_file.read_text())
    kinds = {module["type"].rsplit(".", 1)[-1]: root / module.get("path", "") for module in modules}
    if "Transformer" not in kinds:
        raise ValueError(f"{modules_file}: no Transformer module")
    pooling: tuple[str, ...] = ("cls",)
    if "Pooling" in kinds:
        pooling = _pooling(json.loads((kinds["Pooling"] / "config.json").read_text()))
    unknown = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise ValueError(f"{modules_file}: modules this server does not run: {sorted(unknown)}")
    bert_config = kinds["Transformer"] / "sentence_bert_config.json"
    settings = json.loads(bert_config.read_text()) if bert_config.is_file() else {}
    return EncoderSpec(
        kinds["Transformer"], pooling, "Normalize" in kinds, settings.get("max_seq_length"),
        bool(settings.get("do_lower_case")), _matryoshka(kinds["Transformer"]),
    )  # fmt: skip


#: Each pooling mode's switch in ``1_Pooling/config.json``.
_POOLING_KEYS = {
    "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "lasttoken": "pooling_mode_lasttoken",
}  # fmt: skip


def _pooling(config: dict[str, Any]) -> tuple[str, ...]:
    if config.get("pooling_mode_weightedmean_tokens"):
        raise ValueError("weighted-mean pooling is not supported by this server")
    modes = tuple(mode for mode in POOLING_MODES if config.get(_POOLING_KEYS[mode]))
    if not modes:
        raise ValueError("the pooling config selects no pooling mode")
    return modes


def _matryoshka(transformer: Path) -> tuple[int, ...]:
    config_file = transformer / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    dims = config.get("matryoshka_dimensions") or ()
    return tuple(int(d) for d in dims) if config.get("is_matryoshka", bool(dims)) else ()


class Encoder(Protocol):
    """A sentence-embedding model: token ids in (special tokens included), one vector per input out."""

    name: str
    dimensions: int
    max_seq_length: int
    matryoshka_dims: tuple[int, ...]

    def tokenize(self, text: str, max_length: int | None) -> list[int]:
        """``text``'s token ids with the model's special tokens, cut to ``max_length`` keeping the beginning."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, batch: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order; run on the engine thread."""
        ...


class FakeEncoder:
    """Deterministic 8-dimensional unit vectors from the token ids, bytes as tokens (1 and 2 bracket an input as a
    model's special tokens would); for scheduler and HTTP tests. Counts its calls and the inputs of each."""

    name = "fake-embedding"
    dimensions = 8
    matryoshka_dims: tuple[int, ...] = ()

    def __init__(self, max_seq_length: int = 64) -> None:
        self.max_seq_length = max_seq_length
        self.batches: list[int] = []

    @property
    def vocab_size(self) -> int:
        return 259

    def tokenize(self, text: str, max_length: int | None) -> list[int]:
        ids = [1, *(byte + 3 for byte in text.encode()), 2]
        return ids if max_length is None or len(ids) <= max_length else [*ids[: max_length - 1], 2]

    def encode(self, batch: list[list[int]]) -> list[list[float]]:
        self.batches.append(len(batch))
        return [_unit(ids, self.dimensions) for ids in batch]


def _unit(ids: list[int], size: int) -> list[float]:
    digest = hashlib.blake2b(bytes(str(ids), "ascii"), digest_size=size).digest()
    values = [byte - 127.5 for byte in digest]
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]
