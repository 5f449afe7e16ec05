"""/v1/responses over the fake engine: the response object's fields, the stream's events (order, numbering, function
call items), the store (bounded, least recently used first, on /metrics), input items' pages, previous_response_id,
truncation, a failure mid-stream, and the errors that name their field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from app_helpers import fake_client, named_events
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
}
#: Every field the SDK's ``Response`` type requires, and those this server always fills.
RESPONSE_FIELDS = {
    "id", "object", "created_at", "status", "error", "incomplete_details", "instructions", "model", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "usage", "metadata", "store", "text",
    "truncation", "previous_response_id", "max_output_tokens",
}  # fmt: skip


def create(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/responses", json={"max_output_tokens": 5, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def events(client: TestClient, **fields: Any) -> list[dict[str, Any]]:
    return named_events(client, {"max_output_tokens": 5, "stream": True, **fields}, "/v1/responses")


@pytest.fixture
def client() -> Any:
    with fake_client(FakeEngine(max_model_len=2048), responses_store_size=3) as c:
        yield c


def test_the_response_object_and_its_usage(client: TestClient) -> None:
    body = create(client, input="hi", instructions="Be brief.", metadata={"k": "v"}, temperature=0.5, user="u1")
    assert set(body) >= RESPONSE_FIELDS and body["object"] == "response" and body["id"].startswith("resp_")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    assert message["content"] == [{"type": "output_text", "text": "abcde", "annotations": []}]
    assert (body["instructions"], body["metadata"], body["temperature"], body["user"]) == (
        "Be brief.",
        {"k": "v"},
        0.5,
        "u1",
    )
    usage = body["usage"]
    assert usage["output_tokens"] == 5 and usage["total_tokens"] == usage["input_tokens"] + 5
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    assert body["text"] == {"format": {"type": "text"}} and body["truncation"] == "disabled" and body["store"] is True


def test_greedy_output_and_tokens_equal_chat_completions(client: TestClient) -> None:
    body = create(client, instructions="sys", input=[{"role": "user", "content": "hello"}], store=False)
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}],
            "max_tokens": 5,
        },
    ).json()
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_a_stream_s_events_in_order_numbered_from_zero(client: TestClient) -> None:
    stream = events(client, input="hi")
    assert [event["sequence_number"] for event in stream] == list(range(len(stream)))
    kinds = [event["type"] for event in stream]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * 5, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert stream[0]["response"]["status"] == "in_progress" and stream[0]["response"]["output"] == []
    final = stream[-1]["response"]
    text = "".join(event["delta"] for event in stream if event["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == stream[-4]["text"] == "abcde"
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_function_calls_are_items_and_stream_their_arguments(client: TestClient) -> None:
    whole = create(client, input="weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert json.loads(call["arguments"])["city"] and whole["status"] == "completed"
    assert whole["tools"] == [WEATHER] and whole["tool_choice"] == "required"
    stream = events(client, input="weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    kinds = [event["type"] for event in stream]
    assert kinds[2] == "response.output_item.added" and stream[2]["item"]["type"] == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    joined = "".join(event["delta"] for event in stream if event["type"] == "response.function_call_arguments.delta")
    assert joined == stream[-3]["arguments"] == call["arguments"]


def test_a_call_cut_by_the_limit_is_an_incomplete_call(client: TestClient) -> None:
    body = create(client, input="weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=52)
    [call] = body["output"]  # cut inside its arguments ({"city": ...)
    assert call["type"] == "function_call" and call["status"] == "incomplete" and body["status"] == "incomplete"
    assert call["name"] == "get_weather" and call["arguments"].startswith("{")
    assert "<tool_call>" not in json.dumps(body["output"])


def test_the_store_is_bounded_least_recently_used_first_and_on_metrics(client: TestClient) -> None:
    ids = [create(client, input=f"turn {i}")["id"] for i in range(3)]
    assert client.get(f"/v1/responses/{ids[0]}").status_code == 200  # now the most recently used
    newest = create(client, input="turn 3")["id"]
    assert client.get(f"/v1/responses/{ids[1]}").status_code == 404  # the least recently used left
    for kept in (ids[0], ids[2], newest):
        assert client.get(f"/v1/responses/{kept}").status_code == 200
    assert "smolserve:responses_stored 3.0" in client.get("/metrics").text
    assert client.delete(f"/v1/responses/{newest}").json() == {
        "id": newest,
        "object": "response.deleted",
        "deleted": True,
    }
    missing = client.delete(f"/v1/responses/{newest}")
    assert missing.status_code == 404 and newest in missing.json()["error"]["message"]
    unstored = create(client, input="x", store=False)["id"]
    assert client.get(f"/v1/responses/{unstored}").status_code == 404


def test_the_store_is_bounded_in_bytes() -> None:
    """Each stored response can carry megabytes (tools' schemas, a long input): a count alone let 1,000 of them
    hold gigabytes. Past ``responses_store_bytes`` the least recently used leave; one larger alone is not kept."""
    with fake_client(FakeEngine(max_model_len=1 << 19), responses_store_bytes=300_000) as client:
        big = "word " * 20_000  # 100 KB of input each
        ids = [create(client, input=[{"role": "user", "content": big + str(i)}])["id"] for i in range(4)]
        assert client.get(f"/v1/responses/{ids[0]}").status_code == 404  # four of ~200 KB: the first left
        assert client.get(f"/v1/responses/{ids[3]}").status_code == 200
        huge = create(client, input="hi", metadata={f"k{i}": "v" * 512 for i in range(16)},
                      tools=[{"type": "function", "name": f"f{i}", "parameters": {"type": "object", "description":
                              "d" * 3000}} for i in range(100)])["id"]  # fmt: skip
        assert client.get(f"/v1/responses/{huge}").status_code == 404
        assert client.app.state.server.responses.num_bytes <= 300_000


def test_input_items_in_pages(client: TestClient) -> None:
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    rid = create(client, input=items)["id"]
    page = client.get(f"/v1/responses/{rid}/input_items", params={"limit": 2}).json()
    assert [item["content"][0]["text"] for item in page["data"]] == ["m4", "m3"] and page["has_more"]
    rest = client.get(f"/v1/responses/{rid}/input_items", params={"after": page["last_id"], "order": "desc"}).json()
    assert [item["content"][0]["text"] for item in rest["data"]] == ["m2", "m1", "m0"] and not rest["has_more"]
    ascending = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 100}).json()
    assert [item["content"][0]["text"] for item in ascending["data"]] == [f"m{i}" for i in range(5)]
    assert client.get(f"/v1/responses/{rid}/input_items", params={"limit": 0}).status_code == 400


def test_previous_response_id_continues_with_the_earlier_turns_cached(client: TestClient) -> None:
    first = create(client, input="a" * 40)
    second = create(client, input="next", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= 32
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 5
    # instructions are not inherited: the continued prompt is the first's conversation, without them
    with_sys = create(client, input="b" * 40, instructions="sys")
    follow = create(client, input="c", previous_response_id=with_sys["id"])
    assert follow["instructions"] is None
    assert follow["usage"]["input_tokens"] < with_sys["usage"]["input_tokens"] + 5 + len("c") + 20


def test_truncation_auto_drops_the_oldest_items(client: TestClient) -> None:
    long = [{"role": "user", "content": "x" * 700}, {"role": "assistant", "content": "y" * 700}]
    fields = {"input": [*long, {"role": "user", "content": "last"}], "max_output_tokens": 700}
    clamped = create(client, **fields)  # truncation disabled: the whole input, the output clamped to what is left
    assert clamped["usage"]["input_tokens"] > 1400 and clamped["usage"]["output_tokens"] <= 2048 - 1400
    assert clamped["status"] == "incomplete"
    body = create(client, **fields, truncation="auto")
    assert body["truncation"] == "auto" and body["usage"]["input_tokens"] < 2048 - 700
    huge = {"input": [{"role": "user", "content": "x" * 2100}]}
    refused = client.post("/v1/responses", json=huge)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed() -> None:
    engine = FakeEngine(max_model_len=512)
    with fake_client(engine) as client:
        engine.fail_on_step = engine.num_steps + 3
        stream = events(client, input="hi", max_output_tokens=20)
    assert [event["type"] for event in stream][-2:] == ["error", "response.failed"]
    assert stream[-1]["response"]["status"] == "failed" and stream[-1]["response"]["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "top_p": 0}, "top_p"),
        ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom"}]}]},
         "tools[0].tools[0].type"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "frob"}}], "tool_choice": "required"},
         "tools[0].parameters"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "frob"}}}}, "text.format"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
        ({"input": "hi", "include": ["everything"]}, "include[0]"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "hi", "max_tokens": 2}, "max_tokens"),
        ({"input": "hi", "functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_field(client: TestClient, fields: dict[str, Any], param: str) -> None:
    response = client.post("/v1/responses", json={"max_output_tokens": 5, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] is not None and response.json()["error"]["param"].startswith(param)


def test_unknown_ids_and_models_are_404s(client: TestClient) -> None:
    for path in ("/v1/responses/resp_nope", "/v1/responses/resp_nope/input_items"):
        response = client.get(path)
        assert response.status_code == 404 and "resp_nope" in response.json()["error"]["message"]
    previous = client.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert previous.status_code == 404 and previous.json()["error"]["param"] == "previous_response_id"
    assert client.post("/v1/responses", json={"input": "hi", "model": "gpt-4o"}).status_code == 404
