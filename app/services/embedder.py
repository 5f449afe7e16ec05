"""The embedding model as ``/v1/embeddings`` (``app/api/embeddings.py``) uses it: inputs checked and tokenized, encoded
by the dynamic batcher on the engine's thread (``engine/core/embedding_batcher.py``), answered in OpenAI's list shape,
counted in the metrics. Torch-free: the encoder is the engine's."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from app.services.served_models import ServedEntry
from app.wire.openai.embeddings import EmbeddingsRequest, embedding_list
from app.wire.openai.errors import bad_request
from engine.core.embedding_batcher import EmbeddingBatcher
from engine.core.encoder import Encoder

#: Inputs one request may carry, as OpenAI's limit.
MAX_INPUTS = 2048


class EmbeddingService:
    def __init__(
        self,
        encoder: Encoder,
        entry: ServedEntry,
        executor: Executor | None,
        registry: CollectorRegistry,
        chat_step_seconds: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.encoder = encoder
        self.entry = entry
        labels = ["model"]
        self._requests = Counter("smolserve:embedding_requests", "Embedding requests answered", labels,
                                 registry=registry).labels(entry.name)  # fmt: skip
        self._inputs = Counter("smolserve:embedding_inputs", "Inputs embedded", labels, registry=registry).labels(
            entry.name
        )
        self._tokens = Counter("smolserve:embedding_prompt_tokens", "Tokens of the inputs embedded", labels,
                               registry=registry).labels(entry.name)  # fmt: skip
        buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        self._batch_sizes = Histogram("smolserve:embedding_batch_size", "Inputs per encoder call", labels,
                                      buckets=buckets, registry=registry).labels(entry.name)  # fmt: skip
        self.batcher = EmbeddingBatcher(encoder, executor, chat_step_seconds, self._observe_batch)

    def _observe_batch(self, inputs: int, tokens: int) -> None:
        self._batch_sizes.observe(inputs)

    def token_ids(self, req: EmbeddingsRequest) -> list[list[int]]:
        """On a worker: each input's token ids (special tokens included), cut as ``truncate_prompt_tokens`` asks
        (keeping the beginning); an input over the model's ``max_seq_length`` is a 400 naming it and the limit."""
        encoder, limit = self.encoder, self.encoder.max_seq_length
        if req.dimensions is not None and req.dimensions not in encoder.matryoshka_dims:
            offered = f"one of {list(encoder.matryoshka_dims)}" if encoder.matryoshka_dims else "not settable"
            raise bad_request(f"dimensions: this model was not trained to shorten its vectors ({offered})",
                              "dimensions")  # fmt: skip
        cut = None if req.truncate is None else limit if req.truncate == -1 else min(req.truncate, limit)
        batch = []
        for index, item in enumerate(req.inputs):
            param = "input" if len(req.inputs) == 1 else f"input[{index}]"
            if isinstance(item, str):
                ids = encoder.tokenize(item, cut)
            else:
                if any(token >= encoder.vocab_size for token in item):
                    raise bad_request(f"{param}: token ids must be below the vocabulary size {encoder.vocab_size}",
                                      param)  # fmt: skip
                ids = item if cut is None else item[:cut]
            if len(ids) > limit:
                raise bad_request(
                    f"{param} is {len(ids)} tokens; this model takes at most {limit} (max_seq_length). Shorten it, "
                    "or set truncate_prompt_tokens (-1 keeps the first max_seq_length tokens).",
                    param,
                )
            batch.append(ids)
        return batch

    async def answer(self, req: EmbeddingsRequest, batch: list[list[int]]) -> dict[str, Any]:
        vectors = await self.batcher.encode(batch)
        if req.dimensions is not None:
            vectors = [_shorten(vector, req.dimensions) for vector in vectors]
        tokens = sum(len(ids) for ids in batch)
        self._requests.inc()
        self._inputs.inc(len(batch))
        self._tokens.inc(tokens)
        return embedding_list(self.entry.name, vectors, req.base64, tokens)


def _shorten(vector: list[float], size: int) -> list[float]:
    """A Matryoshka model's vector: its first ``size`` values, normalized again."""
    head = vector[:size]
    norm = math.sqrt(sum(value * value for value in head)) or 1.0
    return [value / norm for value in head]
