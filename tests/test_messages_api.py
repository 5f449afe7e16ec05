"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the fake engine: the
message object and its usage, the stream's events (order, names, blocks), stop sequences, tool use and tool results,
Claude Code's request shape, ``x-api-key``, and every error in Anthropic's envelope. (With the anthropic SDK
against a real server: ``compat/test_anthropic_client.py``.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from app_helpers import fake_client, named_events
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

MODEL = "fake"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.fixture
def client() -> Any:
    with fake_client(FakeEngine(max_model_len=4096)) as c:
        yield c


def create(client: TestClient, status: int = 200, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 5, "messages": ASK, **fields}
    response = client.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    return response.json()


def events(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "max_tokens": 5, "messages": ASK, "stream": True, **fields}
    return named_events(client, body, "/v1/messages")


def test_the_message_object_and_its_usage(client: TestClient) -> None:
    body = create(client)
    assert body["type"] == "message" and body["role"] == "assistant" and body["id"].startswith("msg_")
    assert body["model"] == MODEL and body["content"] == [{"type": "text", "text": "abcde"}]
    assert body["stop_reason"] == "max_tokens" and body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["output_tokens"] == 5 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    again = create(client)  # the same prompt: read from the prefix cache, counted apart as Anthropic counts it
    assert again["usage"]["cache_read_input_tokens"] > 0
    total = again["usage"]["input_tokens"] + again["usage"]["cache_read_input_tokens"]
    assert total == usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_the_stream_s_events_build_the_same_message(client: TestClient) -> None:
    stream = events(client)
    kinds = [event["type"] for event in stream]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[2] == "content_block_start" and kinds[-3] == "content_block_stop"
    text = "".join(e["delta"]["text"] for e in stream if e["type"] == "content_block_delta")
    assert text == "abcde" and stream[0]["message"]["content"] == [] and stream[0]["message"]["stop_reason"] is None
    assert stream[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert stream[-2]["usage"]["output_tokens"] == 5


def test_a_stop_sequence_ends_the_reply_and_is_named_but_not_written(client: TestClient) -> None:
    body = create(client, max_tokens=10, stop_sequences=["xyz", "cd"])
    assert body["content"] == [{"type": "text", "text": "ab"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "cd")
    stream = events(client, max_tokens=10, stop_sequences=["cd"])
    text = "".join(e["delta"]["text"] for e in stream if e["type"] == "content_block_delta")
    assert text == "ab" and stream[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "cd"}


def test_a_forced_tool_call_is_a_tool_use_block_and_streams_its_input(client: TestClient) -> None:
    body = create(client, max_tokens=200, tools=[WEATHER], tool_choice={"type": "any"})
    [block] = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["id"].startswith("toolu_")
    assert isinstance(block["input"]["city"], str) and body["stop_reason"] == "tool_use"
    stream = events(client, max_tokens=200, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    start = next(e for e in stream if e["type"] == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for e in stream if e["type"] == "content_block_delta")
    assert json.loads(partial) == block["input"] and stream[-2]["delta"]["stop_reason"] == "tool_use"


def test_a_tool_result_continues_the_conversation(client: TestClient) -> None:
    turn = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "is_error": False,
                                      "content": [{"type": "text", "text": "18 C, sunny"}]},
                                     {"type": "text", "text": "Thanks"}]},
    ]  # fmt: skip
    body = create(client, messages=turn, tools=[WEATHER])
    assert body["content"][0]["type"] == "text"
    thought = {"type": "thinking", "thinking": "hm", "signature": "s"}
    with_thinking = [turn[0], {"role": "assistant", "content": [thought, *turn[1]["content"]]}, turn[2]]
    assert create(client, messages=with_thinking, tools=[WEATHER])["content"]


def test_claude_code_s_request_shape_is_accepted(client: TestClient) -> None:
    """As Claude Code 2.1 sends it: system text blocks with cache_control (the first its billing header), tools with
    cache_control and defer_loading, adaptive thinking, context management, effort, metadata, a system message
    inside ``messages``, the beta query and headers."""
    body = {
        "model": MODEL, "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "cache_control": {"type": "ephemeral"},
                    "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=a5145;\nYou are Claude Code."},
                   {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "tools": [{**WEATHER, "cache_control": {"type": "ephemeral"}},
                  {**WEATHER, "name": "later", "defer_loading": True}],
        "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc"},
        "messages": [{"role": "user",
                      "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "Remember the plan."}],
    }  # fmt: skip
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "k"}
    with client.stream("POST", "/v1/messages?beta=true", json=body, headers=headers) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1][6:])["type"] == "message_stop"
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"})
    assert counted.status_code == 200
    shown = client.post("/v1/messages/count_tokens", json={**body, "system": "You are Claude Code.\nBe concise."})
    assert counted.json() == shown.json()  # the billing header is left out of the prompt


def test_count_tokens_counts_the_prompt_the_message_runs(client: TestClient) -> None:
    counted = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]})
    body = create(client, tools=[WEATHER])
    assert counted.json()["input_tokens"] == body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


@pytest.mark.parametrize(
    ("fields", "status", "kind", "says"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"bogus": 1}, 400, "invalid_request_error", "bogus"),
        ({"model": "claude-x"}, 404, "not_found_error", "claude-x"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "vision"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
         "tools[0].type"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400, "invalid_request_error", "nope"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error", "role"),
        ({"mcp_servers": [{}]}, 400, "invalid_request_error", "mcp_servers"),
        ({"max_tokens": 5000}, 200, "", ""),  # past the context's room: the reply stops at its end
    ],
)  # fmt: skip
def test_errors_come_in_anthropic_s_envelope(
    client: TestClient, fields: dict, status: int, kind: str, says: str
) -> None:
    body = {k: v for k, v in {"model": MODEL, "max_tokens": 5, "messages": ASK, **fields}.items() if v is not None}
    response = client.post("/v1/messages", json=body)
    assert response.status_code == status
    if status == 200:
        assert response.json()["stop_reason"] == "max_tokens"
        return
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"]


def test_a_body_that_is_not_json_and_a_missing_route_too(client: TestClient) -> None:
    response = client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    missing = client.get("/v1/messages")
    assert missing.status_code in (404, 405) and missing.json()["type"] == "error"


def test_the_api_key_comes_as_x_api_key() -> None:
    with fake_client(FakeEngine(), api_key="secret") as c:
        body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
        assert c.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).status_code == 200
        refused = c.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        bearer = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2},
                        headers={"Authorization": "Bearer secret"})  # fmt: skip
        assert bearer.status_code == 200


def test_the_models_list_is_anthropic_s_page_for_the_anthropic_api() -> None:
    """With ``anthropic-version`` (the anthropic SDK's header): Anthropic's model objects, paged by ``limit``,
    ``after_id`` and ``before_id``, a model not served a ``not_found_error``; without it, OpenAI's list."""
    version = {"anthropic-version": "2023-06-01"}
    with fake_client(FakeEngine(max_model_len=64), model_aliases=("a", "b", "c")) as c:
        page = c.get("/v1/models", headers=version, params={"limit": 2}).json()
        assert [m["id"] for m in page["data"]] == ["fake", "a"] and page["has_more"] is True
        assert (page["first_id"], page["last_id"]) == ("fake", "a")
        assert set(page["data"][0]) == {"type", "id", "display_name", "created_at"}
        assert page["data"][0]["created_at"].endswith("Z") and page["data"][0]["type"] == "model"
        after = c.get("/v1/models", headers=version, params={"limit": 2, "after_id": "a"}).json()
        assert [m["id"] for m in after["data"]] == ["b", "c"] and after["has_more"] is False
        before = c.get("/v1/models", headers=version, params={"limit": 2, "before_id": "c"}).json()
        assert [m["id"] for m in before["data"]] == ["a", "b"] and before["has_more"] is True
        assert c.get("/v1/models/b", headers=version).json()["id"] == "b"
        missing = c.get("/v1/models/claude-opus-4-1", headers=version)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert c.get("/v1/models", headers=version, params={"limit": 0}).json()["error"]["type"] == (
            "invalid_request_error"
        )
        assert c.get("/v1/models").json()["object"] == "list" and c.get("/v1/models/b").json()["object"] == "model"
