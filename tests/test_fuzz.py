"""Arbitrary JSON bodies never produce a 5xx, and every 4xx carries the OpenAI error envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from app_helpers import fake_client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

KEYS = [
    "model", "prompt", "max_tokens", "stream", "stream_options", "include_usage", "ignore_eos", "messages",
    "temperature", "top_p", "n", "stop", "logprobs", "echo", "seed", "logit_bias", "user", "tokens",
    "add_special_tokens", "role", "content",
]  # fmt: skip

# Any code point, unpaired surrogates included: JSON may escape one ("\\udbff") though it is no character.
texts = st.text(st.characters(exclude_categories=()), max_size=20)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)  # fmt: skip
bodies = json_values | st.dictionaries(st.sampled_from(KEYS) | texts, json_values, max_size=6)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with fake_client() as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_arbitrary_json_bodies(client: TestClient, path: str, body: object) -> None:
    response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
