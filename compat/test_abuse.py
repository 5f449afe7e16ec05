"""A hostile client against the real server (default flags) while a greedy stream runs: bodies of 5, 20 and
60 MB, a list of 100,000 prompts, and large-but-legal requests that must be parsed and tokenized. Each oversized
one is refused at once, the stream keeps flowing, and the memory comes back. Prints what it measured.

Before: the 60 MB prompt took 30 s to refuse (400, after tokenizing it on the event loop), the stream saw no token
for 31.6 s, the 100,000 prompts were a 429, and the server's RSS stayed 4.3 GB above where it started."""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, start_server, stop_server

#: Refusals: a generous bound for a busy 2-core CI machine (measured: README "Limits").
REFUSED_WITHIN_S = 2.0
#: The running stream's largest gap under the abuse, as a part of the time the abuse took (the same run's measure:
#: a neighbour's load stretches both). Before the limits the stream stopped for 31.6 s of the 32 s (0.99); with
#: them 0.25 s of 4.6 s (0.05) here, and 1.13 s once on a busy machine, where a fixed 1.0 s bound failed.
GAP_SHARE = 0.3
RSS_GROWTH_MIB = 300


def rss_mib(pid: int) -> float:
    fields = Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()
    return int(fields[0]) / 1024


READER = """
import httpx, json, sys, time
body = {"model": sys.argv[2], "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
with httpx.Client(timeout=300) as client, client.stream("POST", sys.argv[1] + "/v1/completions", json=body) as r:
    for line in r.iter_lines():
        if line.startswith("data:"):
            print(time.time(), flush=True)
"""


class Stream:
    """A long greedy stream, read in a process of its own (a thread of the test's would share the test's GIL with
    the client sending megabytes, and time that instead of the server), recording when each event arrives."""

    def __init__(self, base: str) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", READER, base, MODEL], stdout=subprocess.PIPE, text=True)
        self.stamps: list[float] = []
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.stamps.append(float(line))

    def largest_gap(self, since: float, until: float = float("inf")) -> float:
        stamps = [s for s in self.stamps if since <= s <= until]
        return max((b - a for a, b in itertools.pairwise(stamps)), default=float("inf"))

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[int, str]]:
    proc, base = start_server("--model", MODEL)
    try:
        yield proc.pid, base
    finally:
        stop_server(proc)


def post(base: str, path: str, content: bytes) -> tuple[int, dict, float]:
    began = time.perf_counter()
    headers = {"content-type": "application/json"}
    try:
        response = httpx.post(f"{base}{path}", content=content, headers=headers, timeout=120)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        # The server answered 413 and closed before the client finished sending: nothing more was read.
        return 413, {"error": {"code": "request_too_large"}}, time.perf_counter() - began
    return response.status_code, response.json(), time.perf_counter() - began


@pytest.mark.real_model
def test_oversized_and_large_requests_do_not_stall_a_stream_or_keep_memory(server: tuple[int, str]) -> None:
    pid, base = server
    httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 4}, timeout=60)
    before = rss_mib(pid)
    stream = Stream(base)
    try:
        while len(stream.stamps) < 80:
            time.sleep(0.05)
        idle_gap = stream.largest_gap(stream.stamps[20])
        began = time.time()
        text = "The quick brown fox jumps over the lazy dog. "
        oversized = {
            f"{mb} MB prompt": json.dumps({"model": MODEL, "prompt": text * (mb * 2**20 // len(text))}).encode()
            for mb in (5, 20, 60)
        }
        report = []
        for name, body in oversized.items():
            status, answer, seconds = post(base, "/v1/completions", body)
            report.append((name, status, seconds))
            assert status == 413 and answer["error"]["code"] == "request_too_large", name
            assert seconds < REFUSED_WITHIN_S, (name, seconds)
        many = json.dumps({"model": MODEL, "prompt": [[5, 6]] * 100_000}).encode()
        status, answer, seconds = post(base, "/v1/completions", many)
        report.append(("100,000 prompts", status, seconds))
        assert status == 400 and answer["error"]["param"] == "prompt"
        # Legal in bytes and in characters, over the context once tokenized: parsed and tokenized in full.
        legal = {"model": MODEL, "messages": [{"role": "user", "content": text * 13000}]}  # 585,000 characters
        status, answer, seconds = post(base, "/v1/chat/completions", json.dumps(legal).encode())
        report.append(("585,000-character chat", status, seconds))
        assert status == 400 and answer["error"]["param"] == "messages"
        status, answer, seconds = post(base, "/tokenize", json.dumps({"model": MODEL, "prompt": text * 60000}).encode())
        report.append(("2.7 MB /tokenize", status, seconds))
        assert status == 200 and answer["count"] > 500_000
        gap, took = stream.largest_gap(began), time.time() - began
    finally:
        stream.close()
    time.sleep(1)
    after = rss_mib(pid)
    for name, status, seconds in report:
        print(f"{name}: {status} in {seconds:.2f} s")
    print(f"the running stream's largest gap: {gap:.3f} s of {took:.1f} s (idle: {idle_gap:.3f} s); RSS "
          f"{before:.0f} -> {after:.0f} MiB")  # fmt: skip
    assert gap < GAP_SHARE * took
    assert after - before < RSS_GROWTH_MIB


def _median_gap(stamps: list[float], since: float, until: float) -> float:
    gaps = sorted(b - a for a, b in itertools.pairwise(s for s in stamps if since <= s <= until))
    return gaps[len(gaps) // 2]


@pytest.mark.real_model
def test_a_body_at_the_stop_bounds_costs_a_neighbour_nothing(server: tuple[int, str]) -> None:
    """64 stop strings of 256 characters (the bounds) on a neighbouring request, against the same request with none:
    a running stream's inter-token time within 1.2x (paired, alternated; the median of five pairs: of three, one
    full-suite run on a busy machine gave 1.33, the same test alone 0.94-1.13). Before, 250,000 stop strings were
    accepted and stretched a neighbour's 64 tokens from 6.3 s to 29.1 s."""
    import random

    _, base = server
    rng = random.Random(7)
    stops = ["".join(rng.choices("QXZJVKWqxzjvkw\x01", k=256)) for _ in range(64)]
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 160, "ignore_eos": True, "temperature": 0}
    stream = Stream(base)
    ratios = []
    try:
        while len(stream.stamps) < 20:
            time.sleep(0.05)
        for _ in range(5):
            medians = []
            for extra in ({}, {"stop": stops}):
                began = time.time()
                answer = httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=120)
                assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 160
                medians.append(_median_gap(stream.stamps, began, time.time()))
            ratios.append(medians[1] / medians[0])
    finally:
        stream.close()
    print(f"inter-token time beside 64 x 256-character stops / beside none: {[round(r, 3) for r in ratios]}")
    assert sorted(ratios)[2] <= 1.2


@pytest.mark.real_model
def test_a_body_sent_one_byte_at_a_time_holds_up_no_one(server: tuple[int, str]) -> None:
    """The body-size middleware reads bodies as they arrive, awaiting each piece: a client that trickles its body
    in (slowloris) holds only its own request, and gets its answer once the body is whole."""
    _, base = server
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}")  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=60) as slow:
        slow.sendall(head.encode() + b"\r\n\r\n")
        for byte in body[:20]:
            slow.sendall(bytes([byte]))
            time.sleep(0.02)
        other = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 4
        slow.sendall(body[20:])
        assert slow.recv(64).startswith(b"HTTP/1.1 200")
