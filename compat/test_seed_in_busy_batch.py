"""A seeded request gives the same text alone and inside a busy batch (float32 serving)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from openai import OpenAI

from compat.conftest import MODEL, start_server, stop_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def fp32_client() -> Iterator[OpenAI]:
    proc, base = start_server("--model", MODEL, "--dtype", "float32")
    try:
        with OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            yield client
    finally:
        stop_server(proc)


def test_seed_reproduces_alone_and_in_a_busy_batch(fp32_client: OpenAI) -> None:
    def seeded() -> str:
        return (
            fp32_client.completions.create(
                model=MODEL, prompt="My favourite animal is", max_tokens=20, temperature=1.0, seed=2024
            )
            .choices[0]
            .text
        )

    alone = seeded()

    def background(i: int) -> None:
        fp32_client.completions.create(
            model=MODEL, prompt=f"Write about topic {i}:" * (i + 1), max_tokens=40, temperature=0.8,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    threads = [threading.Thread(target=background, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    in_batch = seeded()
    for t in threads:
        t.join()
    assert in_batch == alone
