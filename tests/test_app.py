"""The HTTP layer over the fake engine: the wire format a client sees, and every error as an envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from app_helpers import fake_client, sse_events
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

MODEL = "fake-model"


def make_client(engine: FakeEngine | None = None, **config: Any) -> TestClient:
    return fake_client(engine, served_model_name=MODEL, **config)


@pytest.fixture
def client() -> Iterator[TestClient]:
    with make_client() as c:
        yield c


def assert_envelope(response: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_completion_wire_format(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "abcde", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_max_tokens_defaults_to_16(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_stop_token_gives_finish_reason_stop_and_ignore_eos_runs_on() -> None:
    with make_client(FakeEngine(max_model_len=64, eos_after=3)) as client:
        stopped = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10}).json()
        assert stopped["choices"][0]["text"] == "ab"
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == 3  # the stop token counts, as in vLLM
        ignored = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "ignore_eos": True}).json()
        assert ignored["choices"][0]["finish_reason"] == "length"
        assert ignored["usage"]["completion_tokens"] == 10


def test_stream_format(client: TestClient) -> None:
    events = sse_events(client, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcd"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes == [None] * (len(chunks) - 1) + ["length"]
    assert all("finish_reason" in c["choices"][0] for c in chunks)


def test_stream_include_usage_adds_a_final_usage_chunk(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [json.loads(e) for e in sse_events(client, body)[:-1]]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks[:-1])


def test_models_and_health(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.get("/health").status_code == 200


def test_unknown_model_is_404(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    error = assert_envelope(response, 404, "model")
    assert error["code"] == "model_not_found"


def test_a_prompt_that_leaves_no_room_is_400(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x" * 64, "max_tokens": 10})
    error = assert_envelope(response, 400, "prompt")
    assert "context length" in error["message"] and "64 tokens" in error["message"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 64}]})
    assert_envelope(chat, 400, "messages")
    responses = client.post("/v1/responses", json={"input": "x" * 64})
    assert_envelope(responses, 400, "input")


USER = [{"role": "user", "content": "x" * 40}]


@pytest.mark.parametrize(
    ("path", "body", "read"),
    [
        ("/v1/completions", {"prompt": "x" * 60, "max_tokens": 32_768},
         lambda a: (a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"])),
        ("/v1/completions", {"prompt": ["x" * 60, "y" * 50], "max_tokens": 100, "min_tokens": 90},
         lambda a: ([c["finish_reason"] for c in a["choices"]], a["usage"]["completion_tokens"])),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 32_768},
         lambda a: (a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"])),
        ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 32_768},
         lambda a: a["choices"][0]["finish_reason"]),
        ("/v1/responses", {"input": "x" * 40, "max_output_tokens": 32_768},
         lambda a: (a["status"], a["incomplete_details"])),
        ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 32_000},
         lambda a: a["stop_reason"]),
        ("/api/chat", {"model": MODEL, "messages": USER, "stream": False, "options": {"num_predict": 32_768}},
         lambda a: (a["done_reason"], 0 < a["eval_count"] < 64)),
    ],
)  # fmt: skip
def test_max_tokens_beyond_the_context_is_clamped_on_every_api(client: TestClient, path: str, body: dict[str, Any],
                                                               read: Any) -> None:  # fmt: skip
    """Agents ask for the whole context every turn (Qwen Code: 32,768 of a 32,768-token model): the reply stops
    where the context ends, with ``length``, as llama.cpp's server and Anthropic's API answer; it was a 400. One rule
    decides it for every endpoint (``app/pipeline/reply_budget.py``), Ollama's ``num_predict`` too."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    expected = {
        ("/v1/completions", 1): (4, "length"), ("/v1/completions", 2): (["length", "length"], 4 + 14),
        ("/v1/chat/completions", 3): None, ("/v1/chat/completions", 4): "length",
        ("/v1/responses", 5): ("incomplete", {"reason": "max_output_tokens"}), ("/v1/messages", 6): "max_tokens",
        ("/api/chat", 7): ("length", True),
    }  # fmt: skip
    got = read(response.json())
    if path == "/v1/chat/completions" and "max_tokens" in body:
        assert got[1] == "length" and 0 < got[0] < 64
        return
    assert got in [value for (where, _), value in expected.items() if where == path]


def test_unknown_route_and_method_are_enveloped(client: TestClient) -> None:
    assert_envelope(client.get("/v1/nothing"), 404)
    assert_envelope(client.get("/v1/completions"), 405)


def test_unknown_fields_are_ignored(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": [1, {"a": 2}]})
    assert response.status_code == 200


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b"\xff\xfe", None),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None),
        (b"[1, 2]", None),
        (b'"a string"', None),
        (b"{}", "prompt"),
        (b'{"prompt": null}', "prompt"),
        (b'{"prompt": ""}', "prompt"),
        (b'{"prompt": []}', "prompt"),
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": [1, "a"]}', "prompt"),
        (b'{"prompt": [-1]}', "prompt"),
        (b'{"prompt": [999999]}', "prompt"),
        (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": -3}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens"),
        (b'{"prompt": "x", "model": 3}', "model"),
        (b'{"prompt": "x", "stream": "yes"}', "stream"),
        (b'{"prompt": "x", "stream": true, "stream_options": 1}', "stream_options"),
        (b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": 1}}', "stream_options.include_usage"),
        (b'{"prompt": "x", "ignore_eos": "no"}', "ignore_eos"),
        (b'{"prompt": "x", "temperature": -0.1}', "temperature"),
        (b'{"prompt": "x", "temperature": 2.5}', "temperature"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "x", "temperature": true}', "temperature"),
        (b'{"prompt": "x", "top_p": 0}', "top_p"),
        (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
        (b'{"prompt": "x", "top_k": -2}', "top_k"),
        (b'{"prompt": "x", "top_k": 2.5}', "top_k"),
        (b'{"prompt": "x", "seed": "42"}', "seed"),
        (b'{"prompt": "x", "seed": 1.5}', "seed"),
        (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "repetition_penalty": 1e400}', "repetition_penalty"),
        (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
    ],
)
def test_malformed_requests_are_400_envelopes(client: TestClient, raw: bytes, param: str | None) -> None:
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_envelope(response, 400, param)


def test_engine_fault_is_a_500_envelope_then_the_server_serves_again() -> None:
    engine = FakeEngine(max_model_len=64)
    engine.fail_on_step = 1
    with make_client(engine) as client:
        error = assert_envelope(client.post("/v1/completions", json={"prompt": "x"}), 500)
        assert "injected engine fault" in error["message"]
        assert (
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()["choices"][0]["text"] == "ab"
        )


def test_engine_fault_mid_stream_sends_an_error_event_then_done() -> None:
    engine = FakeEngine(max_model_len=64)
    engine.fail_on_step = 3
    with make_client(engine) as client:
        events = sse_events(client, {"prompt": "x", "max_tokens": 10, "stream": True})
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
        error = json.loads(events[-2])["error"]
        assert "injected engine fault" in error["message"]


def test_api_key_guards_v1_but_not_health() -> None:
    with make_client(api_key="sekret") as client:
        body = {"prompt": "x", "max_tokens": 1}
        missing = client.post("/v1/completions", json=body)
        assert assert_envelope(missing, 401)["code"] == "invalid_api_key"
        assert_envelope(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_envelope(client.get("/v1/models", headers={"Authorization": "sekret"}), 401)
        ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200
        assert 'requests_rejected_total{reason="invalid_api_key"} 3.0' in client.get("/metrics").text


def test_request_id_is_echoed_or_generated(client: TestClient) -> None:
    given = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "req-42"})
    assert given.headers["x-request-id"] == "req-42"
    made_up = client.get("/health").headers["x-request-id"]
    assert len(made_up) >= 16 and made_up != client.get("/health").headers["x-request-id"]


def test_a_request_id_cannot_forge_the_access_log(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    """An id with blanks, quotes or a log line's own shape is replaced by one of ours, echoed and logged."""
    forged = 'r1 "POST /v1/admin" 200 prompt_tokens=0'
    with caplog.at_level("INFO", logger="smolserve.access"):
        for bad in (forged, "a" * 129, "x\tq", "id;drop"):
            response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                   headers={"X-Request-Id": bad})  # fmt: skip
            assert response.headers["x-request-id"] != bad and len(response.headers["x-request-id"]) == 32
        client.get('/v1/x%0A2026 INFO smolserve.access: forged "GET /v1/ok" 200')
    lines = [r.getMessage() for r in caplog.records if r.name == "smolserve.access"]
    assert len(lines) == 5
    assert all(line.count('"') - line.count('\\"') == 2 and "/v1/admin" not in line for line in lines)
    assert all("\n" not in line for line in lines)


def test_access_log_has_one_line_with_token_counts(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="smolserve.access"):
        client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 4}, headers={"X-Request-Id": "r1"})
    lines = [r.getMessage() for r in caplog.records if r.name == "smolserve.access"]
    assert len(lines) == 1
    assert lines[0].startswith(
        'r1 "POST /v1/completions" 200 prompt_tokens=3 cached_prompt_tokens=0 completion_tokens=4 accepted_tokens=0 '
        "latency="
    )


def test_cors_when_enabled() -> None:
    with make_client(cors_origins=("https://example.com",)) as client:
        preflight = client.options(
            "/v1/completions",
            headers={"Origin": "https://example.com", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "https://example.com"
    with make_client() as client:
        response = client.get("/health", headers={"Origin": "https://example.com"})
        assert "access-control-allow-origin" not in response.headers


def test_metrics_count_tokens_outcomes_and_latencies(client: TestClient) -> None:
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    sse_events(client, {"prompt": "hi", "max_tokens": 2, "stream": True})
    client.post("/v1/completions", json={"prompt": ""})
    client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = client.get("/metrics").text
    for line in [
        "smolserve:num_requests_running 0.0",
        "smolserve:num_requests_waiting 0.0",
        "smolserve:prompt_tokens_total 7.0",
        "smolserve:generation_tokens_total 5.0",
        'smolserve:request_success_total{finish_reason="length"} 2.0',
        'smolserve:requests_rejected_total{reason="invalid_request_error"} 1.0',
        'smolserve:requests_rejected_total{reason="model_not_found"} 1.0',
        "smolserve:time_to_first_token_seconds_count 2.0",
        "smolserve:inter_token_latency_seconds_count 3.0",
        "smolserve:e2e_request_latency_seconds_count 2.0",
        # One request at a time, one token per step: 5 steps of one sequence each.
        "smolserve:engine_step_seconds_count 5.0",
        "smolserve:engine_step_batch_size_sum 5.0",
    ]:
        assert line in text, line


def test_draining_server_answers_503(client: TestClient) -> None:
    client.app.state.server.draining = True
    error = assert_envelope(client.post("/v1/completions", json={"prompt": "x"}), 503)
    assert error["code"] == "shutting_down"
    health = client.get("/health").json()
    assert health["status"] == "draining"
    assert health["models"] == [{"names": [MODEL], "kind": "generate", "max_model_len": 64, "status": "loaded",
                                 "weights": "none (the fake engine writes the alphabet)"}]  # fmt: skip
    assert health["engine"]["kv_cache"]["block_size"] == 16 and health["engine"]["max_model_len"] == 64


def test_every_chunk_of_a_stream_carries_the_created_of_its_request() -> None:
    """A stream longer than a second crossed a second boundary and its chunks disagreed on `created`."""
    with make_client(FakeEngine(max_model_len=64, step_delay=0.08)) as client:
        body = {"prompt": "hi", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
        chunks = [json.loads(e) for e in sse_events(client, body)[:-1]]
    assert len(chunks) == 17  # one per token, then usage; 16 steps of 80 ms span more than one second
    assert len({c["created"] for c in chunks}) == 1


def test_a_model_is_retrieved_by_id_and_an_unknown_one_is_404(client: TestClient) -> None:
    card = client.get(f"/v1/models/{MODEL}").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert assert_envelope(client.get("/v1/models/gpt-4"), 404, "model")["code"] == "model_not_found"
    assert_envelope(client.get("/v1/models/org/other-model"), 404, "model")  # ids may hold slashes


def _stream_lines(client: TestClient) -> list[str]:
    body = {"prompt": "hi", "max_tokens": 6, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        return [line for line in response.iter_lines() if line]


def test_streams_carry_no_sse_comments_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """sse-starlette pinged every 15 s by default; OpenAI sends no comment lines and data-only parsers choke on
    them. Pings are made frequent here so that a short stream would carry some."""
    from sse_starlette import EventSourceResponse

    monkeypatch.setattr(EventSourceResponse, "DEFAULT_PING_INTERVAL", 0.02)
    with make_client(FakeEngine(max_model_len=64, step_delay=0.05)) as client:
        assert all(line.startswith("data: ") for line in _stream_lines(client))
    with make_client(FakeEngine(max_model_len=64, step_delay=0.05), sse_keepalive_s=0.02) as client:
        lines = _stream_lines(client)
    assert any(line.startswith(":") for line in lines)  # --sse-keepalive asked for them
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1] if line.startswith("data: {"))


def test_priority_is_vllm_s_integer() -> None:
    """``priority`` (vLLM's; lower values are admitted first, ``tests/test_scheduler.py``) on completions and chat:
    an integer, else a 400 naming it."""
    with fake_client() as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
            assert client.post(path, json={**body, "max_tokens": 2, "priority": -3}).status_code == 200
            for bad in ("high", 1.5, 2**40, True):
                refused = client.post(path, json={**body, "max_tokens": 2, "priority": bad})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
