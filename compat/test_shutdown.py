"""SIGTERM on a live server with the real model: in-flight streams finish, newcomers get 503, exit status 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from compat.conftest import MODEL, start_server

pytestmark = pytest.mark.real_model


def stream_events(base: str, max_tokens: int, started: threading.Event, events: list[str]) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


def wait_until_draining(base: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health", timeout=5).json()["status"] != "draining":
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.02)


def sigterm_during_a_stream(*server_args: str, max_tokens: int) -> tuple[list[str], httpx.Response, int]:
    proc, base = start_server("--model", MODEL, *server_args)
    started, events = threading.Event(), []
    reader = threading.Thread(target=stream_events, args=(base, max_tokens, started, events))
    reader.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    wait_until_draining(base)
    newcomer = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=30)
    reader.join(timeout=120)
    return events, newcomer, proc.wait(timeout=60)


def test_sigterm_lets_the_stream_finish_and_exits_0() -> None:
    # Long enough (a few seconds even at one stream's full speed) that the stream is still running when the
    # newcomer arrives: a 48-token stream once finished, and the server exited, before it did.
    events, newcomer, status = sigterm_during_a_stream(max_tokens=600)
    assert newcomer.status_code == 503
    assert newcomer.json()["error"]["code"] == "shutting_down"
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 600
    assert status == 0


def test_shutdown_timeout_ends_the_stream_with_an_error_and_done() -> None:
    events, _, status = sigterm_during_a_stream("--shutdown-timeout", "1", max_tokens=2000)
    assert events[-1] == "[DONE]"
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    assert status == 0
