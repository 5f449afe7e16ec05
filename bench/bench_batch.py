"""The Batch API against the same requests sent by concurrent clients, and an interactive stream beside a batch.

    .venv/bin/python bench/bench_batch.py [--requests 2000] [--clients 64] [--tokens 64]

One server (the default model, ``--data-dir`` a temporary folder). Prints: the tokens/s of ``--requests`` greedy
chat requests (``--tokens`` each, ``ignore_eos``) sent by ``--clients`` concurrent clients, and of the same requests
as one batch (upload, create, poll until completed), and their ratio; then an interactive stream's time to first
token and inter-token time (p50 of 10 streams one after another), idle and while a batch runs, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import start_server, stop_server  # noqa: E402
from engine.core.config import DEFAULT_MODEL  # noqa: E402


def body(i: int, tokens: int) -> dict:
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": f"Write about the number {i}."}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip


async def clients(base: str, requests: int, concurrency: int, tokens: int) -> float:
    """Tokens/s of ``requests`` sent by ``concurrency`` closed-loop clients."""
    queue = list(range(requests))
    done = [0]

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            answer = await http.post("/v1/chat/completions", json=body(queue.pop(), tokens))
            got = answer.json()["usage"]["completion_tokens"]
            done[0] += got

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return done[0] / (time.perf_counter() - started)


def start_batch(http: httpx.Client, requests: int, tokens: int) -> str:
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body(i, tokens)}) + "\n" for i in range(requests))  # fmt: skip
    upload = http.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"}).json()
    batch = http.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()  # fmt: skip
    return batch["id"]


def batch_throughput(base: str, requests: int, tokens: int) -> float:
    with httpx.Client(base_url=base, timeout=600) as http:
        started = time.perf_counter()
        batch_id = start_batch(http, requests, tokens)
        while (batch := http.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
            assert batch["status"] in ("validating", "in_progress", "finalizing"), batch
            time.sleep(0.2)
        seconds = time.perf_counter() - started
    return batch["request_counts"]["completed"] * tokens / seconds


def interactive(base: str, streams: int = 10) -> tuple[float, float]:
    """p50 time to first token and p50 inter-token time (ms) of streams sent one after another."""
    ttfts, gaps = [], []
    with httpx.Client(base_url=base, timeout=600) as http:
        for i in range(streams):
            started, last = time.perf_counter(), None
            with http.stream("POST", "/v1/chat/completions", json={**body(10_000 + i, 32), "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        moment = time.perf_counter()
                        if last is None:
                            ttfts.append(moment - started)
                        else:
                            gaps.append(moment - last)
                        last = moment
    return statistics.median(ttfts) * 1000, statistics.median(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        proc, base = start_server("--model", DEFAULT_MODEL, "--embedding-model", "none", "--data-dir", data,
                                  "--log-level", "warning")  # fmt: skip
        try:
            asyncio.run(clients(base, 64, 16, 8))  # warm-up
            by_clients = asyncio.run(clients(base, args.requests, args.clients, args.tokens))
            by_batch = batch_throughput(base, args.requests, args.tokens)
            print(f"{args.requests} requests of {args.tokens} tokens: {args.clients} clients {by_clients:.0f} tok/s, "
                  f"one batch {by_batch:.0f} tok/s ({by_batch / by_clients:.2f}x)")  # fmt: skip
            idle = interactive(base)
            with httpx.Client(base_url=base, timeout=600) as http:
                batch_id = start_batch(http, args.requests, args.tokens)
                time.sleep(2)
                busy = interactive(base)
                http.post(f"/v1/batches/{batch_id}/cancel")
            print(f"interactive stream, idle: TTFT p50 {idle[0]:.0f} ms, ITL p50 {idle[1]:.1f} ms; beside a batch: "
                  f"TTFT p50 {busy[0]:.0f} ms ({busy[0] / idle[0]:.2f}x), ITL p50 {busy[1]:.1f} ms "
                  f"({busy[1] / idle[1]:.2f}x)")  # fmt: skip
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
