"""Ollama's ``/api/chat`` against ``/v1/chat/completions`` on one server (the bundled model unless ``--model``):
the same conversations, greedy, streamed, at 1 and 32 concurrent streams, the two endpoints measured in turn,
``--rounds`` times each; generated tokens per second of wall time, and their ratio per round (paired).

    .venv/bin/python bench/bench_ollama.py [--model FILE.gguf] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import start_server, stop_server  # noqa: E402

TOPICS = ["the sea", "a city at night", "bread", "mountains", "a library", "rain", "trains", "a garden"]


def conversation(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short paragraph about {TOPICS[index % len(TOPICS)]} ({index})."}]


async def ollama_one(client: httpx.AsyncClient, model: str, index: int, tokens: int) -> int:
    body = {"model": model, "messages": conversation(index), "options": {"temperature": 0, "num_predict": tokens}}
    async with client.stream("POST", "/api/chat", json=body) as response:
        lines = [json.loads(line) async for line in response.aiter_lines() if line]
    return lines[-1]["eval_count"]


async def openai_one(client: httpx.AsyncClient, model: str, index: int, tokens: int) -> int:
    body = {"model": model, "messages": conversation(index), "temperature": 0, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    usage = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", usage)
    return usage


async def rate(base: str, model: str, one, streams: int, tokens: int) -> float:
    """Generated tokens per second with ``streams`` requests at once."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(client, model, i, tokens) for i in range(streams)))
        return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF (default: the bundled model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    flags = ["--model", args.model] if args.model else []
    proc, base = start_server(*flags, "--embedding-model", "none")
    try:
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        asyncio.run(rate(base, model, openai_one, 4, 8))  # warm up both paths
        asyncio.run(rate(base, model, ollama_one, 4, 8))
        for streams in (1, 32):
            ratios, native, openai = [], [], []
            for _ in range(args.rounds):
                openai.append(asyncio.run(rate(base, model, openai_one, streams, args.tokens)))
                native.append(asyncio.run(rate(base, model, ollama_one, streams, args.tokens)))
                ratios.append(native[-1] / openai[-1])
            print(f"{streams:>2} streams: /api/chat {statistics.median(native):7.1f} tok/s, /v1/chat/completions "
                  f"{statistics.median(openai):7.1f} tok/s, ratio (median of paired rounds) "
                  f"{statistics.median(ratios):.3f} [{', '.join(f'{r:.3f}' for r in ratios)}]")  # fmt: skip
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
