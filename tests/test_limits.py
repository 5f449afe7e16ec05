"""One client cannot stall or bloat the server: a body over `--max-request-bytes` is a 413 before it is read,
text that could never fit the context a 400 before it is tokenized, lists over their limits a 400 naming the
field (never a 429), and what is parsed, tokenized and rendered runs off the event loop. HTTP level, the real
tokenizer (a spy counts its calls), the fake engine."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from app.server.app import create_app
from app.server.limits import BodyLimitMiddleware, RequestLimits
from app.server.state import ServerConfig
from engine.chooser import ServedModel
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import HFTokenizer
from tests.app_helpers import LOCAL

MODEL = "SmolLM2-135M-Instruct"
JSON_TYPE = {"content-type": "application/json"}
CONTEXT = 8192


class SpyTokenizer(HFTokenizer):
    """The real tokenizer, counting its work and the threads it runs on."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        self.calls.append(threading.current_thread().name)
        return super().chat_prompt(messages, tools, extra)


@pytest.fixture(scope="module")
def tokenizer(real_model) -> SpyTokenizer:
    return SpyTokenizer(real_model.tokenizer, real_model.eos_token_ids)


@pytest.fixture
def client(tokenizer: SpyTokenizer) -> Iterator[TestClient]:
    tokenizer.calls.clear()
    served = ServedModel(MODEL, FakeEngine(capacity=8, max_model_len=CONTEXT), tokenizer)
    config = ServerConfig(max_queue=64, limits=RequestLimits(max_request_bytes=1 << 20))
    with TestClient(create_app(served, config), base_url=LOCAL) as client:
        yield client


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_body_over_the_limit_is_refused_from_its_content_length(client: TestClient, tokenizer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * (1 << 20)})
    error = error_of(client.post("/v1/completions", content=body, headers=JSON_TYPE), 413)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "at most 1048576" in error["message"]
    assert tokenizer.calls == []
    metrics = client.get("/metrics").text
    assert 'smolserve:requests_rejected_total{reason="request_too_large"} 1.0' in metrics


def test_a_streamed_body_is_refused_once_it_passes_the_limit_and_the_rest_is_never_read() -> None:
    """No Content-Length (chunked): the body is counted as it arrives. Driven at the ASGI level, since the test
    client reads a request's whole body before the app sees it."""
    received: list[int] = []
    sent: list[dict[str, Any]] = []
    called: list[bool] = []

    async def receive() -> dict[str, Any]:  # 16 chunks of 256 KiB: 4 MiB, against a limit of 1 MiB
        received.append(1)
        return {"type": "http.request", "body": b"y" * (1 << 18), "more_body": len(received) < 16}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(True)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(BodyLimitMiddleware(app, 1 << 20)(scope, receive, send))
    assert not called and len(received) == 5, "read past the limit"
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def test_a_body_within_the_limit_reaches_the_app_whole_and_a_disconnect_after_it() -> None:
    messages = [{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"c"},
                {"type": "http.disconnect"}]  # fmt: skip
    seen: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.extend([await receive(), await receive()])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"3")]}
    asyncio.run(BodyLimitMiddleware(app, 3)(scope, receive, lambda message: asyncio.sleep(0)))
    assert seen == [{"type": "http.request", "body": b"abc", "more_body": False}, {"type": "http.disconnect"}]


def test_text_that_cannot_fit_the_context_is_refused_without_tokenizing(client: TestClient, tokenizer) -> None:
    longest = tokenizer.max_token_chars
    assert longest >= 16  # SmolLM2's vocabulary spells runs of white space and code
    too_long = "word " * (CONTEXT * longest // 4 + 1)  # more characters, white space aside, than the bound
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": too_long}), 400)
    assert error["param"] == "prompt" and "maximum context length of 8192 tokens" in error["message"]
    batch = {"model": MODEL, "prompt": ["fine", too_long]}
    assert error_of(client.post("/v1/completions", json=batch), 400)["param"] == "prompt[1]"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": too_long[: len(too_long) // 2]}] * 2}
    assert error_of(client.post("/v1/chat/completions", json=chat), 400)["param"] == "messages"
    assert tokenizer.calls == []
    # White space alone is not counted: a tokenizer may fold a run of it into a token or none.
    spaces = {"model": MODEL, "prompt": "a" + " " * (CONTEXT * longest + 10), "max_tokens": 1}
    error = error_of(client.post("/v1/completions", json=spaces), 400)
    assert error["param"] == "prompt" and tokenizer.calls  # tokenized, then over the context


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", ["a"] * 257),
        ("stop", ["x"] * 65),
        ("stop_token_ids", [1] * 1025),
        ("logit_bias", {str(i): 1 for i in range(1025)}),
    ],
)
def test_completions_lists_over_their_limits_are_a_400_naming_the_field(client, tokenizer, field, value) -> None:
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", field: value}), 400)
    assert error["param"] == field and "at most" in error["message"]
    assert tokenizer.calls == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x" * 257]}, "stop[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["y" * 300]}, "stop[0]"),
        ("/infill", {"input_prefix": "a", "stop": ["z" * 257]}, "stop[0]"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 250_000},
            "stop_sequences",
        ),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x" * 257]},
            "stop_sequences[0]",
        ),
    ],
)
def test_stop_strings_are_bounded_on_every_api(client, tokenizer, path, body, param) -> None:
    """Before: 250,000 ``stop_sequences`` (3.5 MB) ran, 25 s for 64 tokens, and slowed a neighbouring stream 4.6x."""
    response = client.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error.get("param", param) == param and "at most" in error["message"]
    assert tokenizer.calls == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("messages", [{"role": "user", "content": "hi"}] * 2049),
        ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
    ],
)
def test_chat_lists_over_their_limits_are_a_400_naming_the_field(client, tokenizer, field, value) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == field
    assert tokenizer.calls == []


def test_more_sequences_than_the_queue_holds_is_a_400_not_a_429(client: TestClient) -> None:
    """Before: a list of 100,000 prompts was a 429 (queue full), which tells a client to retry what never fits."""
    many = {"model": MODEL, "prompt": [[5, 6]] * 100_000}
    assert error_of(client.post("/v1/completions", json=many), 400)["param"] == "prompt"
    sampled = {"model": MODEL, "prompt": ["a"] * 20, "n": 4, "temperature": 1}  # 80 sequences, the queue holds 64
    error = error_of(client.post("/v1/completions", json=sampled), 400)
    assert error["param"] == "n" and "80 sequences" in error["message"]
    fits = {"model": MODEL, "prompt": ["a"] * 16, "n": 4, "temperature": 1, "max_tokens": 2}
    assert len(client.post("/v1/completions", json=fits).json()["choices"]) == 64


def test_requests_are_tokenized_and_rendered_off_the_event_loop(client: TestClient, tokenizer) -> None:
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "Hello"}).json()["count"] >= 1
    assert len(tokenizer.calls) >= 3 and all(name.startswith("prepare") for name in tokenizer.calls), tokenizer.calls


def test_a_full_context_of_text_and_a_long_history_fit_the_default_body_limit(tokenizer) -> None:
    """The default --max-request-bytes (4 MiB) holds a conversation filling the context many times over, escaped
    at worst (every character a \\uXXXX escape), with 128 tools."""
    history = [{"role": "user", "content": "é" * 4000} for _ in range(64)]  # 256,000 characters
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object",
              "properties": {f"p{j}": {"type": "string", "description": "d" * 40} for j in range(20)}}}}
             for i in range(128)]  # fmt: skip
    body = json.dumps({"model": MODEL, "messages": history, "tools": tools}, ensure_ascii=True)
    assert len(body) < RequestLimits().max_request_bytes
