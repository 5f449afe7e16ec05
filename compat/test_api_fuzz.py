"""Schemathesis over the whole API of a live server (``python -m app --model fake``, behind a key), from the server's
own ``GET /openapi.json`` (generated from the route table and the request models): every operation, bodies that
fit the schema and bodies that break it, a bounded number of examples each. No answer is a 500, every error is in
its API's envelope, and the server serves a normal request afterwards. The number of cases run is printed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from app.server.openapi import describe
from app.server.routes import ROUTES
from compat.conftest import start_server, stop_server

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Examples per operation and mode (26 operations, valid and invalid inputs).
EXAMPLES = 40
_ran: dict[str, int] = {}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data = tmp_path_factory.mktemp("fuzz-data")
    proc, base = start_server("--model", "fake", "--api-key", KEY, "--data-dir", str(data), "--max-model-len", "256",
                              "--max-file-bytes", str(1 << 20), startup_timeout=60)  # fmt: skip
    try:
        yield base
    finally:
        stop_server(proc)


#: The document ``GET /openapi.json`` serves (checked below), read here so that each operation is a test of its own.
DOCUMENT = describe(ROUTES)
SCHEMA = schemathesis.openapi.from_dict(DOCUMENT)


def _cases() -> list[tuple[Any, GenerationMode]]:
    """Each operation with valid inputs, and with invalid ones where it has any (a body or a query; a path's
    parameters are any string)."""
    cases = []
    for operation in (result.ok() for result in SCHEMA.get_all_operations()):
        described = DOCUMENT["paths"][operation.path][operation.method.lower()]
        cases.append((operation, GenerationMode.POSITIVE))
        if "requestBody" in described or any(param["in"] != "path" for param in described["parameters"]):
            cases.append((operation, GenerationMode.NEGATIVE))
    return cases


def _in_envelope(path: str, body: Any) -> bool:
    """OpenAI's ``{"error": {"message", "type", ...}}``, Anthropic's ``{"type": "error", "error": {...}}`` on the
    Messages API's routes, Ollama's ``{"error": "..."}`` on its ``/api/*``."""
    if path.startswith("/api/"):
        return isinstance(body, dict) and isinstance(body.get("error"), str)
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    error = body["error"]
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(error.get("message"), str)
    return isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def test_the_served_description_is_the_route_table_s(live: str) -> None:
    served = httpx.get(f"{live}/openapi.json", headers=AUTH, timeout=10)
    assert served.status_code == 200 and served.json() == describe(ROUTES)
    assert httpx.get(f"{live}/openapi.json", timeout=10).status_code == 401


@pytest.mark.parametrize(("operation", "mode"), _cases(), ids=lambda value: getattr(value, "label", value))
def test_no_request_is_a_server_error(live: str, operation: Any, mode: GenerationMode) -> None:
    """Bodies, paths and queries that fit the schema (positive) and that break it (negative)."""

    @given(case=operation.as_strategy(mode))
    # derandomize: the same cases every run, so that a CI run is decided by the tree, not the draw.
    @settings(
        max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
    )
    def run(case: Any) -> None:
        response = case.call(base_url=live, headers=AUTH, timeout=60)
        _ran[operation.label] = _ran.get(operation.label, 0) + 1
        assert response.status_code < 500, (operation.label, response.status_code, response.text[:500])
        if response.status_code >= 400:
            body = json.loads(response.text)
            assert _in_envelope(case.path, body), (operation.label, response.status_code, response.text[:500])

    run()


def test_the_server_serves_on_after_the_fuzzing(live: str) -> None:
    answer = httpx.post(f"{live}/v1/completions", headers=AUTH, timeout=60,
                        json={"model": "fake", "prompt": "after", "max_tokens": 4})  # fmt: skip
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    assert httpx.get(f"{live}/health", timeout=10).json()["status"] == "ok"
    total = sum(_ran.values())
    print(f"\nschemathesis: {total} cases over {len(_ran)} operations, no 5xx")
    assert len(_ran) >= 20 and total >= 10 * len(_ran), _ran
