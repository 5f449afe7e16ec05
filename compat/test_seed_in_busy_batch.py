"""A seeded request gives the same text alone and inside a busy batch, in the default dtype: its random numbers are
keyed by token index, and the probabilities it draws from do not depend on the batch, where batch invariance is on
(README: "Greedy output that does not depend on the batch")."""

from __future__ import annotations

import threading

import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model


def test_seed_reproduces_alone_and_in_a_busy_batch(invariant_client: OpenAI) -> None:
    client = invariant_client

    def seeded() -> str:
        return (
            client.completions.create(
                model=MODEL, prompt="My favourite animal is", max_tokens=20, temperature=1.0, seed=2024
            )
            .choices[0]
            .text
        )

    alone = seeded()

    def background(i: int) -> None:
        client.completions.create(
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
