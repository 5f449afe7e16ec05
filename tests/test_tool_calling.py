"""Tool calling over HTTP on the fake engine (which, like the real one, generates only what the grammar allows):
the response's shape for each tool_choice, streamed calls that join into the non-streamed ones, conversations
carrying tool traffic, and a 400 naming the field for every malformed tool request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from app_helpers import fake_client, sse_chunks
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time", "strict": True}}
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with fake_client(FakeEngine(capacity=16, max_model_len=4096)) as c:
        yield c


def chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 300, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def conforms(call: dict[str, Any]) -> bool:
    tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    parameters = tool["function"].get("parameters", {"type": "object"})
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)
    return call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_conforming_calls(client: TestClient, parallel: bool) -> None:
    choice = chat(client, tool_choice="required", parallel_tool_calls=parallel)["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert calls and all(conforms(call) for call in calls)
    assert parallel or len(calls) == 1


def test_a_named_choice_calls_that_function(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, tool_choice=named)["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and conforms(call)


def test_none_and_auto_without_a_call_return_text(client: TestClient) -> None:
    for tool_choice in ("none", "auto"):  # the fake engine writes the alphabet: never the trigger
        choice = chat(client, tool_choice=tool_choice, max_tokens=5)["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": "abcde"}
        assert choice["finish_reason"] == "length"


def stream(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 300, "stream": True, **fields}
    return sse_chunks(client, body, "/v1/chat/completions")


def test_streamed_calls_join_into_the_non_streamed_ones(client: TestClient) -> None:
    fields = {"tool_choice": "required", "n": 2}
    whole = chat(client, **fields)["choices"]
    joined: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    finish = {}
    for chunk in stream(client, **fields):
        for choice in chunk["choices"]:
            assert not choice["delta"].get("content")  # a required call has no text around it
            for delta in choice["delta"].get("tool_calls", []):
                calls = joined[choice["index"]]
                if "id" in delta:  # the first delta of a call: its id, type and name
                    assert delta["index"] == len(calls) and delta["function"]["arguments"] == ""
                    calls.append({"name": delta["function"]["name"], "arguments": ""})
                else:
                    calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    for index, choice in enumerate(whole):
        expected = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in choice["message"]["tool_calls"]
        ]
        assert joined[index] == expected and finish[index] == "tool_calls"


def test_a_call_cut_by_max_tokens_ends_with_length(client: TestClient) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    head = len('<tool_call>\n{"name": "get_weather", "arguments": ')
    choice = chat(client, tool_choice=named, max_tokens=head + 6)["choices"][0]
    assert choice["finish_reason"] == "length"
    [call] = choice["message"]["tool_calls"]  # the call as far as it got: its arguments a prefix of valid JSON
    assert call["function"] == {"name": "get_weather", "arguments": '{"city'}


ROUND_TRIP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "It is noon."},
]


def test_a_conversation_with_tool_traffic_is_answered(client: TestClient) -> None:
    choice = chat(client, messages=ROUND_TRIP, max_tokens=3)["choices"][0]
    assert choice["message"]["content"] == "abc"
    tokens = client.post("/tokenize", json={"messages": ROUND_TRIP, "tools": TOOLS}).json()["tokens"]
    prompt = bytes(tokens).decode()
    assert '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>' in prompt
    assert "<tool_response>\nIt is noon.\n</tool_response>" in prompt and '"name": "get_weather"' in prompt


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"tools": [NOW, {"type": "function", "function": {"name": "now"}}]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [NOW, {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools[1].function.parameters",
        ),
        ({"tools": "get_weather"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"min_tokens": 3}, "min_tokens"),
        ({"messages": [{"role": "assistant"}]}, "messages[0]"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1]"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": ROUND_TRIP[1]["tool_calls"]}]}, "messages[0]"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
    ],
)
def test_every_malformed_tool_request_is_a_400_naming_the_field(client: TestClient, fields: dict, param: str) -> None:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"].startswith(param) or param in ("tool_choice", "response_format", "min_tokens")


def test_tools_are_a_chat_feature(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "tools": TOOLS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
