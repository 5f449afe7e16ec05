"""What a client sees of the prefix cache: `usage.prompt_tokens_details.cached_tokens` (whole responses and
streams), the access log's cached prompt tokens, and the KV block and prefix-cache metrics. Over the fake
engine, planned by the real planner over 16-token blocks (one token per byte): a newcomer takes the whole cached
blocks its prompt starts with, then the shared start of the next cached block (copied), so its cached tokens are
the prompt start it shares with an earlier request."""

from __future__ import annotations

import json

import pytest
from app_helpers import fake_client, sse_events
from starlette.testclient import TestClient

from engine.core.fake_engine import FakeEngine

PREAMBLE = "You are a careful assistant. Answer in one short sentence, and never invent facts. " * 2  # 166 bytes


def make_client() -> TestClient:
    return fake_client(FakeEngine(max_model_len=1024))


def completion(client: TestClient, prompt: str, **extra: object) -> dict:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_second_request_sharing_a_prefix_reports_its_cached_tokens() -> None:
    with make_client() as client:
        first = completion(client, PREAMBLE + "What is 2 + 2?")
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = completion(client, PREAMBLE + "Name a colour.")
        assert second["usage"]["prompt_tokens"] == len(PREAMBLE) + len("Name a colour.")
        # The first prompt filled 11 blocks; the second shares 10 of them and the start of the 11th.
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": len(PREAMBLE)}


def test_the_stream_s_usage_chunk_reports_cached_tokens() -> None:
    with make_client() as client:
        completion(client, PREAMBLE + "one")
        body = {"prompt": PREAMBLE + "two", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        usage = json.loads(sse_events(client, body)[-2])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 160  # the first prompt filled 10 blocks


def test_chat_usage_reports_cached_tokens() -> None:
    with make_client() as client:
        messages = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "hi"}]
        for expected_positive in (False, True):
            response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert (cached >= len(PREAMBLE)) is expected_positive


def test_the_access_log_counts_cached_prompt_tokens(caplog: pytest.LogCaptureFixture) -> None:
    with make_client() as client, caplog.at_level("INFO", logger="smolserve.access"):
        completion(client, PREAMBLE + "a")
        completion(client, PREAMBLE + "b")
    lines = [r.getMessage() for r in caplog.records if r.name == "smolserve.access"]
    assert "cached_prompt_tokens=0 " in lines[0] and "cached_prompt_tokens=160 " in lines[1]


def test_metrics_expose_blocks_prefix_cache_traffic_and_preemptions() -> None:
    with make_client() as client:
        completion(client, PREAMBLE + "a")
        completion(client, PREAMBLE + "b")
        text = client.get("/metrics").text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    queried = 2 * (len(PREAMBLE) + 1)
    assert values["smolserve:prefix_cache_queries_total"] == queried
    assert values["smolserve:prefix_cache_hits_total"] == 160
    assert values["smolserve:num_preemptions_total"] == 0
    for gauge in ("kv_blocks_in_use", "kv_blocks_cached", "kv_blocks_free", "kv_cache_usage_perc"):
        assert f"smolserve:{gauge}" in values
