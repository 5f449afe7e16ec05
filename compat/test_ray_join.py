"""``--ray-address``: the application joins a Ray cluster started with ``ray start`` (here a one-machine cluster on
127.0.0.1, as the multi-node steps in the README start one), autoscales its replicas under load, and on SIGTERM
removes only itself: the cluster stays up. In its own module: it stops that cluster at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from compat.conftest import MODEL, free_port, start_server

pytestmark = pytest.mark.real_model

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a one-machine cluster on 127.0.0.1
    address = f"127.0.0.1:{free_port()}"
    head = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", address.split(":")[1]]
    subprocess.run([*head, "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats"], check=True)
    try:
        yield address
    finally:
        subprocess.run([RAY, "stop", "--force"], check=False, capture_output=True)


def live(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=5).json()["replicas"]["live"]


def until_live(base: str, replicas: int, seconds: float) -> int:
    """The live replicas once they are ``replicas``, or when ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while live(base) < replicas and time.monotonic() < deadline:
        time.sleep(1)
    return live(base)


def keep_busy(base: str, stop: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True}
    while not stop.is_set():
        httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def test_joined_application_scales_up_under_load_and_leaves_the_cluster_running(ray_cluster: str) -> None:
    flags = ["--ray-address", ray_cluster, "--min-replicas", "1", "--max-replicas", "2", "--max-batch-size", "2"]
    proc, base = start_server("--model", MODEL, *flags)
    stop = threading.Event()
    clients = [threading.Thread(target=keep_busy, args=(base, stop)) for _ in range(6)]
    try:
        assert until_live(base, 1, 60) >= 1  # /health answered as the first replica's count was still coming in
        for client in clients:
            client.start()
        assert until_live(base, 2, 150) == 2  # Serve's upscale delay, then a replica loading the model
    finally:
        stop.set()
        for client in clients:
            if client.is_alive():
                client.join(timeout=150)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # as the launcher sets it to join
    status = subprocess.run([RAY, "status", "--address", ray_cluster], capture_output=True, text=True, env=env)
    assert status.returncode == 0, status.stderr  # the cluster outlived the application
