"""The start-up summary: one INFO block, printed by ``python -m app`` once the models are ready, naming the
address, each served model with its kind and weights, the KV pool, the batch limits and speculative decoding; and
the same facts on ``/health``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from app.server.app import create_app
from app.server.state import ServerConfig, server_state
from app.server.summary import startup_summary
from engine import chooser
from engine.core.config import EngineConfig
from tests.app_helpers import LOCAL


def test_the_summary_names_what_runs() -> None:
    served = chooser.build(EngineConfig(model="fake", max_batch_size=4))
    app = create_app(served, ServerConfig(served_model_name="chat", model_aliases=("alias",)))
    summary = startup_summary(server_state(app), served.engine.runtime_info(), "http://127.0.0.1:9")
    lines = summary.splitlines()
    assert lines[0] == "smolserve ready on http://127.0.0.1:9"
    assert lines[1].startswith("  generate model chat, alias: none (the fake engine")
    assert lines[2].startswith("  embed model fake-embedding: float32, 8 dimensions")
    assert "KV cache:" in summary and "up to 4 sequences" in summary and "speculative decoding: none" in summary


def test_the_summary_and_health_name_the_speculative_mode() -> None:
    from starlette.testclient import TestClient

    served = chooser.build(EngineConfig(model="fake", speculative="ngram"))
    app = create_app(served, ServerConfig())
    summary = startup_summary(server_state(app), served.engine.runtime_info(), "http://127.0.0.1:9")
    assert "speculative decoding: ngram (prompt lookup" in summary
    with TestClient(app, base_url=LOCAL) as client:
        assert client.get("/health").json()["speculative"].startswith("ngram (prompt lookup")


def test_python_m_app_prints_it_once_the_models_are_ready() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "app", "--model", "fake", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert [model["kind"] for model in health["models"]] == ["generate", "embed"]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    [start] = [i for i, line in enumerate(output.splitlines()) if "smolserve ready on" in line]
    block = output.splitlines()[start : start + 6]
    assert f"http://127.0.0.1:{port}" in block[0] and "INFO smolserve:" in block[0]
    assert any("generate model fake" in line for line in block) and any("embed model" in line for line in block)
