"""The server closed by construction: every route behind the API key but the open list (the route table walked, so
a route added later is covered), and what a web page can send refused (a foreign ``Origin``, a body that is not
JSON, a rebinding ``Host``), in each API's envelope."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from app.server.browser_guard import host_name, is_loopback
from app.server.cli import parse_args, server_config
from app.server.middleware import OPEN_PATHS
from app.server.routes import ROUTES
from tests.app_helpers import LOCAL, fake_client

KEY = "sk-test"
COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def keyed(tmp_path) -> Iterator[TestClient]:
    with fake_client(api_key=KEY, data_dir=tmp_path) as client:
        yield client


def _requests() -> list[tuple[str, str]]:
    """(method, path) for every route of the table, path parameters filled in."""
    found = []
    for route in ROUTES:
        assert isinstance(route, Route)
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        found += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return found


@pytest.mark.parametrize(("method", "path"), _requests())
def test_every_route_but_the_open_list_needs_the_key(keyed: TestClient, method: str, path: str) -> None:
    body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}
    without = keyed.request(method, path, **body)
    with_key = keyed.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **body)
    assert with_key.status_code != 401, with_key.text
    if path in OPEN_PATHS:
        assert without.status_code == with_key.status_code == 200
        return
    assert without.status_code == 401, (method, path)
    error = without.json()["error"]
    assert error["type"] in ("invalid_request_error", "authentication_error")
    wrong = keyed.request(method, path, headers={"Authorization": "Bearer sk-wrong"}, **body)
    assert wrong.status_code == 401


def test_infill_and_unknown_paths_need_the_key(keyed: TestClient) -> None:
    """``/infill`` answered without the key; a path the table does not have is a 401 too, not a map of routes."""
    infill = keyed.post("/infill", json={"input_prefix": "def add(a, b):\n    ", "n_predict": 4})
    assert infill.status_code == 401 and infill.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get("/v1/nothing-here").status_code == 401
    assert keyed.get("/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    anthropic = keyed.post("/v1/messages", json={})
    assert anthropic.status_code == 401 and anthropic.json()["type"] == "error"
    assert keyed.post("/v1/messages", json={}, headers={"x-api-key": KEY}).status_code == 400


def test_an_empty_api_key_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for argv, env in ((["--model", "fake", "--api-key", ""], None), (["--model", "fake"], "  ")):
        if env is not None:
            monkeypatch.setenv("SMOLSERVE_API_KEY", env)
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--api-key" in capsys.readouterr().err


def test_a_web_pages_simple_requests_are_refused() -> None:
    """A cross-site form post or ``fetch`` without a preflight: ``text/plain``, a form, no type, or any body from a
    foreign ``Origin``; none runs a generation. The SDKs' requests (JSON, no Origin) pass."""
    with fake_client() as client:
        raw = '{"model": "fake", "prompt": "hi", "max_tokens": 2}'
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            response = client.post("/v1/completions", content=raw, headers={"content-type": content_type})
            assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
        assert client.post("/v1/completions", content=raw).status_code == 415
        foreign = client.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
        unload = client.post("/models/unload", headers={"Origin": "null"})
        assert unload.status_code == 403
        assert client.get("/v1/files", headers={"Origin": "https://evil.example"}).status_code == 403
        anthropic = client.post("/v1/messages", content="{}", headers={"content-type": "text/plain"})
        assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
        typed = client.post("/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"})
        assert typed.status_code == 200
        same_origin = client.post("/v1/completions", json=COMPLETION, headers={"Origin": LOCAL})
        assert same_origin.status_code == 200


def test_cors_origins_are_let_in() -> None:
    with fake_client(cors_origins=("https://app.example",)) as client:
        allowed = client.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://app.example"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        preflight = client.options("/v1/completions", headers={"Origin": "https://app.example",
                                                               "Access-Control-Request-Method": "POST"})  # fmt: skip
        assert preflight.status_code == 200
        other = client.post("/v1/completions", json=COMPLETION, headers={"Origin": "https://evil.example"})
        assert other.status_code in (400, 403)


def test_a_rebinding_host_is_refused() -> None:
    """DNS rebinding: a page's requests carry the attacker's name in ``Host``; loopback names pass."""
    with fake_client() as client:
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example"):
            response = client.get("/v1/models", headers={"Host": host})
            assert response.status_code == 421, host
            assert response.json()["error"]["code"] == "host_not_allowed"
        for host in ("localhost:8000", "127.0.0.1", "127.0.0.2:80", "[::1]:8000", "app.localhost", "LOCALHOST"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    with fake_client(allowed_hosts=("box.lan",)) as client:
        assert client.get("/v1/models", headers={"Host": "box.lan:8000"}).status_code == 200
        assert client.get("/v1/models", headers={"Host": "evil.example"}).status_code == 421
    with fake_client(allowed_hosts=None) as client:  # bound to 0.0.0.0: the operator's names are unknown
        assert client.get("/v1/models", headers={"Host": "box.lan"}).status_code == 200


def test_the_host_check_follows_the_bound_address() -> None:
    assert server_config(parse_args(["--model", "fake"])).allowed_hosts == ()
    assert server_config(parse_args(["--model", "fake", "--allowed-hosts", "box.lan"])).allowed_hosts == ("box.lan",)
    assert server_config(parse_args(["--model", "fake", "--host", "0.0.0.0"])).allowed_hosts is None
    assert is_loopback("127.9.9.9") and is_loopback("::1") and not is_loopback("10.0.0.1")
    assert host_name("[::1]:8000") == "::1" and host_name("a.b:80") == "a.b" and host_name("a.b") == "a.b"
