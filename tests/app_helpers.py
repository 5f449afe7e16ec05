"""Helpers the HTTP tests share: the app over the fake engine, behind a test client, and a stream's events."""

from __future__ import annotations

import json
from typing import Any

from starlette.testclient import TestClient

from app.server.app import create_app
from app.server.state import ServerConfig
from engine.chooser import ServedModel
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import ByteTokenizer

#: Where test clients send requests: a loopback name, as the browser guard requires (``app/server/browser_guard.py``).
LOCAL = "http://127.0.0.1"


def fake_client(engine: FakeEngine | None = None, **config: Any) -> TestClient:
    """The app over ``engine`` (a fake engine of 64 positions by default) and the byte tokenizer; ``config``:
    ``ServerConfig`` fields. Use it as a context manager, which runs the app's lifespan."""
    served = ServedModel("fake", engine or FakeEngine(max_model_len=64), ByteTokenizer())
    return TestClient(create_app(served, ServerConfig(**config)), base_url=LOCAL)


def sse_events(client: TestClient, body: dict[str, Any], path: str = "/v1/completions") -> list[str]:
    """The ``data:`` payloads of a stream, checked to be server-sent events."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def sse_chunks(client: TestClient, body: dict[str, Any], path: str = "/v1/completions") -> list[dict[str, Any]]:
    """A stream's chunks, parsed, checked to end with ``[DONE]``."""
    events = sse_events(client, body, path)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def named_events(client: TestClient, body: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """A stream of named events (the Responses and Messages APIs'), parsed, each checked to be named by its type."""
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    parsed = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [event["type"] for event in parsed]
    return parsed
