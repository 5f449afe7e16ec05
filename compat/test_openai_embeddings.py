"""Embeddings on the bundled all-MiniLM-L6-v2 through the official client: vectors equal sentence-transformers'
``encode(normalize_embeddings=True)`` (the SDK asks for base64 and decodes it), token-id input equals text input,
a batch equals each input alone, usage counts the model's special tokens, truncation keeps the beginning, the
served models route both ways, and embeddings and chat streams run at the same time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model

EMBEDDING = "all-MiniLM-L6-v2"
TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog",
    "Ünïcødé, emoji 🙂 and CJK 你好, all at once",
    "word " * 400,  # over the model's 256 tokens: cut as sentence-transformers cuts it
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    from engine.runtime.encoder import default_path

    model = SentenceTransformer(str(default_path()), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


def vectors(response: object) -> np.ndarray:
    return np.array([item.embedding for item in response.data])  # type: ignore[attr-defined]


def test_vectors_equal_sentence_transformers(client: OpenAI, reference: np.ndarray) -> None:
    response = client.embeddings.create(model=EMBEDDING, input=TEXTS, extra_body={"truncate_prompt_tokens": -1})
    ours = vectors(response)  # the SDK asked for base64 and decoded it
    cosines = (ours * reference).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999, cosines
    floats = client.embeddings.create(model=EMBEDDING, input=TEXTS, encoding_format="float",
                                      extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert np.abs(vectors(floats) - ours).max() < 1e-6  # base64 = float (float32 rounding)
    assert response.model == EMBEDDING and response.usage.prompt_tokens == response.usage.total_tokens


def test_token_ids_batches_and_usage(client: OpenAI) -> None:
    from engine.runtime.encoder import SentenceEncoder, default_path

    texts = TEXTS[:3]
    batch = client.embeddings.create(model=EMBEDDING, input=texts)
    alone = [client.embeddings.create(model=EMBEDDING, input=text) for text in texts]
    assert np.abs(vectors(batch) - np.vstack([vectors(one) for one in alone])).max() < 1e-5

    encoder = SentenceEncoder(default_path(), EMBEDDING)
    ids = [encoder.tokenize(text, None) for text in texts]
    by_ids = client.embeddings.create(model=EMBEDDING, input=ids)
    assert np.abs(vectors(by_ids) - vectors(batch)).max() < 1e-5
    assert batch.usage.prompt_tokens == sum(len(row) for row in ids)  # [CLS] and [SEP] counted


def test_over_the_limit_without_truncation_is_a_400(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=EMBEDDING, input=["short", "word " * 400])
    assert bad.value.body["param"] == "input[1]" and "256" in bad.value.body["message"]


def test_models_route_both_ways(client: OpenAI) -> None:
    assert [model.id for model in client.models.list().data] == [MODEL, EMBEDDING]
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model=MODEL, input="hi")
    assert bad.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=EMBEDDING, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="hi")


def test_embeddings_and_chat_streams_at_the_same_time(client: OpenAI) -> None:
    def chat(i: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}."}], max_tokens=32,
            stream=True, temperature=0,
        )  # fmt: skip
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    def embeddings(i: int) -> int:
        return len(client.embeddings.create(model=EMBEDDING, input=[f"sentence {i} {j}" for j in range(8)]).data)

    with ThreadPoolExecutor(12) as pool:
        chats = [pool.submit(chat, i) for i in range(4)]
        embedded = [pool.submit(embeddings, i) for i in range(8)]
        assert all(future.result(timeout=300) for future in chats)
        assert [future.result(timeout=300) for future in embedded] == [8] * 8
