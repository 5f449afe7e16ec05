"""`response_format` and vLLM's `structured_outputs` over HTTP, on the fake engine (which, like the real one,
generates only what the grammar allows): the output parses, ends with "stop" when complete, and a grammar that
cannot be compiled is a 400 before anything runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from app_helpers import fake_client, sse_chunks
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

CHAT = {"messages": [{"role": "user", "content": "Answer in JSON."}]}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "tags": {"type": "array", "maxItems": 2}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with fake_client(FakeEngine(capacity=16, max_model_len=256)) as c:
        yield c


def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 100, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_json_object_is_a_json_object_that_ends_the_sequence(client: TestClient) -> None:
    body = chat(client, response_format={"type": "json_object"}, n=2)
    for choice in body["choices"]:
        assert isinstance(json.loads(choice["message"]["content"]), dict)
        assert choice["finish_reason"] == "stop"


def test_json_schema_output_conforms_streamed_and_not(client: TestClient) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    value = json.loads(chat(client, response_format=response_format)["choices"][0]["message"]["content"])
    assert set(value) == {"name", "tags"} and len(value["name"]) <= 5 and len(value["tags"]) <= 2
    body = {**CHAT, "stream": True, "response_format": response_format}
    chunks = sse_chunks(client, body, "/v1/chat/completions")
    streamed = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert json.loads(streamed) == value


def test_structured_outputs_choice_regex_and_completions(client: TestClient) -> None:
    picked = chat(client, structured_outputs={"choice": ["zebra", "yak"]})["choices"][0]["message"]["content"]
    assert picked in ("zebra", "yak")
    digits = chat(client, structured_outputs={"regex": "[0-9]{3}-x"})["choices"][0]["message"]["content"]
    assert len(digits) == 5 and digits[:3].isdigit() and digits.endswith("-x")
    completion = client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}})
    assert json.loads(completion.json()["choices"][0]["text"]) == {}


def test_a_budget_that_ends_first_gives_length(client: TestClient) -> None:
    choice = chat(client, structured_outputs={"regex": "a{50}"}, max_tokens=10)["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "a" * 10


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "not a schema"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_before_anything_runs(client: TestClient, fields: dict, param: str) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
