"""The official openai client against a live server on the real model."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model


def test_completion_and_its_stream_agree(client: OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens <= 8

    chunks = list(
        client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage(client: OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 20
    assert chunks[-2].choices[0].finish_reason == "length"


def test_seeded_sampling_reproduces(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(42)
    assert sample(42) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1


def test_models_lists_the_served_models(client: OpenAI) -> None:
    """The chat model first, then the embedding model served beside it."""
    assert [m.id for m in client.models.list().data] == [MODEL, "all-MiniLM-L6-v2"]


def test_unknown_model_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


def test_context_overflow_is_bad_request(client: OpenAI, server_url: str) -> None:
    """A prompt that leaves no room is a 400; a ``max_tokens`` past what it leaves ends the reply there."""
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="hello " * 8200, max_tokens=8)
    prompt = "hello " * 8170
    count = httpx.post(f"{server_url}/tokenize", json={"model": MODEL, "prompt": prompt}, timeout=60).json()["count"]
    assert count < 8192
    clamped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8190, extra_body={"ignore_eos": True})
    assert clamped.choices[0].finish_reason == "length"
    assert (clamped.usage.prompt_tokens, clamped.usage.completion_tokens) == (count, 8192 - count)


@pytest.mark.parametrize(
    "raw", [b"{oops", b"[]", b'{"model": "SmolLM2-135M-Instruct"}', b'{"prompt": "x", "max_tokens": "8"}']
)
def test_malformed_bodies_are_400(server_url: str, raw: bytes) -> None:
    response = httpx.post(f"{server_url}/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_twenty_concurrent_streams_progress_together(client: OpenAI) -> None:
    """Every stream has received tokens before any stream finishes: they share the batch, not take turns."""
    num_streams, max_tokens = 20, 24
    first_chunk: dict[int, float] = {}
    finished: dict[int, float] = {}
    texts: dict[int, str] = {}

    def consume(i: int) -> None:
        parts = []
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            first_chunk.setdefault(i, time.monotonic())
            parts.append(chunk.choices[0].text)
        finished[i] = time.monotonic()
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(finished) == num_streams
    assert max(first_chunk.values()) < min(finished.values())
    assert all(texts[i] for i in range(num_streams))
