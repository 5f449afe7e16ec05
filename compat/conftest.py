"""A live server on a free port, started as a user would start it, for the official openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

MODEL = "SmolLM2-135M-Instruct"
# Sentences to build long shared prompts from (prefix-cache tests and bench/bench_prefix.py).
FACTS = [
    "The Nile flows north through eleven countries before it reaches the Mediterranean Sea.",
    "Honey found in ancient Egyptian tombs was still edible thousands of years later.",
    "Octopuses have three hearts, and two of them stop beating while the animal swims.",
    "A day on Venus lasts longer than a year on Venus, because the planet spins so slowly.",
    "Bananas are berries in the botanical sense, while strawberries are not berries at all.",
]
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    *args: str, startup_timeout: float = 300, root: Path = ROOT, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m app`` from the tree at ``root`` (another checkout, for a benchmark's A/B), with ``env`` added
    to the environment. Its default ``--data-dir`` (uploads, batches, the prefix cache's blocks on disk) is a fresh
    folder, so that no server finds what an earlier one left; a test that restarts a server over the same data
    passes ``--data-dir``."""
    port = free_port()
    cmd = [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root),
           "XDG_DATA_HOME": tempfile.mkdtemp(prefix="smolserve-data-"), **(env or {})}  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=root, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, base, startup_timeout)  # a fresh machine converts the GGUF first
    return proc, base


def wait_until_healthy(proc: subprocess.Popen[bytes], base: str, timeout: float) -> None:
    """Wait for ``GET {base}/health`` to answer 200 (llama.cpp's server answers there too); kill the process
    and raise if it exits or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not start in time")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def served(*flags: str) -> Iterator[str]:
    """The default model served with ``flags``, for as long as the caller iterates."""
    proc, base = start_server("--model", MODEL, *flags)
    try:
        yield base
    finally:
        stop_server(proc)


def official_client(base: str) -> OpenAI:
    """The official client as a user points it: no retries, a long timeout."""
    return OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    yield from served()


@pytest.fixture
def client(server_url: str) -> Iterator[OpenAI]:
    """The official client on the session's server."""
    with official_client(server_url) as c:
        yield c


@pytest.fixture(scope="session")
def invariant_server_url() -> Iterator[str]:
    """A server with `--batch-invariant on`, for tests of what that promises: outputs that do not depend on their
    batchmates. The default (`auto`) turns it off where it costs more than 5% (CPUs with AMX: docs/design.md,
    "Greedy output that does not depend on the batch")."""
    yield from served("--batch-invariant", "on")


@pytest.fixture
def invariant_client(invariant_server_url: str) -> Iterator[OpenAI]:
    with official_client(invariant_server_url) as c:
        yield c
