"""/v1/responses (or Anthropic's /v1/messages) against /v1/chat/completions on the same greedy prompts, and a
continued conversation's first token.

    .venv/bin/python bench/bench_responses.py [--concurrency 1 32] [--repeats 3] [--new-tokens 64]
    .venv/bin/python bench/bench_responses.py --against messages --turns 0

``--against messages``: the Messages API takes no ``ignore_eos`` (its fields are Anthropic's), so neither side sends
it there: greedy, the same prompt rendered the same way, both replies are the same tokens and end at the same place.

One server (default flags). For each level, N concurrent streaming clients send the same conversation (a distinct
question each) through each endpoint in turn, greedy, ``ignore_eos``; the median run of each side is reported, as
output tokens per second over the run. Then the second turn of a ``previous_response_id`` conversation (its
earlier turn from the prefix cache) against a first turn of the same new input's length: time to the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import MODEL, start_server, stop_server  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer carefully."
WORDS = [
    "river",
    "stone",
    "maple",
    "cloud",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "ember",
    "orchard",
    "falcon",
]


def question(index: int, run: int) -> str:
    picked = [WORDS[(index * 7 + run * 3 + k) % len(WORDS)] for k in range(4)]
    return f"Run {run}, client {index}: write about {', '.join(picked)}."


async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def chat_stream(
    client: httpx.AsyncClient, base: str, text: str, tokens: int, to_eos: bool = False
) -> tuple[int, float]:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": not to_eos, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first, count = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        async for chunk in events(response):
            if chunk["choices"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    return count, first or 0.0


async def response_stream(
    client: httpx.AsyncClient, base: str, text: str, tokens: int, **extra: Any
) -> tuple[int, float, str]:
    body = {"model": MODEL, "instructions": SYSTEM, "input": text, "max_output_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **extra}  # fmt: skip
    start, first, count, rid = time.perf_counter(), None, 0, ""
    async with client.stream("POST", f"{base}/v1/responses", json=body) as response:
        async for event in events(response):
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete"):
                count, rid = event["response"]["usage"]["output_tokens"], event["response"]["id"]
    return count, first or 0.0, rid


async def message_stream(client: httpx.AsyncClient, base: str, text: str, tokens: int) -> tuple[int, float]:
    body = {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    start, first, count = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/messages", json=body) as response:
        async for event in events(response):
            if event["type"] == "content_block_delta" and first is None:
                first = time.perf_counter() - start
            if event["type"] == "message_delta":
                count = event["usage"]["output_tokens"]
    return count, first or 0.0


async def level(base: str, endpoint: str, n: int, tokens: int, run: int, to_eos: bool = False) -> float:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        if endpoint == "chat":
            results = await asyncio.gather(
                *(chat_stream(client, base, question(i, run), tokens, to_eos) for i in range(n))
            )
        elif endpoint == "messages":
            results = await asyncio.gather(*(message_stream(client, base, question(i, run), tokens) for i in range(n)))
        else:
            results = await asyncio.gather(
                *(response_stream(client, base, question(i, run), tokens, store=False) for i in range(n))
            )
        elapsed = time.perf_counter() - start
    return sum(result[0] for result in results) / elapsed


async def second_turn(base: str, rounds: int) -> tuple[list[float], list[float]]:
    """TTFT of a continued turn (previous_response_id) and of a first turn whose prompt (its instructions made
    unique, so that nothing of it is cached) is as long as what the continued turn adds: the new input."""
    continued, fresh = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for r in range(rounds):
            opening = " ".join(WORDS[(r + k) % len(WORDS)] for k in range(60)) + f" (round {r})"
            _, _, rid = await response_stream(client, base, opening, 48)
            follow = f"Now summarize that in one line, round {r}."
            _, ttft, _ = await response_stream(client, base, follow, 8, previous_response_id=rid)
            continued.append(ttft)
            fresh_turn = {"instructions": f"Round {r}, fresh. {SYSTEM}"}
            _, ttft, _ = await response_stream(
                client, base, f"Summarize a harbor in one line, round {r} x.", 8, **fresh_turn
            )
            fresh.append(ttft)
    return continued, fresh


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--turns-only", action="store_true", help="only the continued conversation's first token")
    parser.add_argument("--against", choices=["responses", "messages"], default="responses")
    parser.add_argument("--turns", type=int, default=5, help="rounds of the continued conversation (0: none)")
    args = parser.parse_args()
    proc, base = start_server("--model", MODEL)
    other, to_eos = args.against, args.against == "messages"
    try:
        asyncio.run(level(base, "chat", 4, 8, -1))  # warm-up
        print(f"| streams | chat tok/s | {other} tok/s | {other} / chat |\n|---|---|---|---|")
        for n in [] if args.turns_only else args.concurrency:
            runs: dict[str, list[float]] = {"chat": [], other: []}
            for run in range(args.repeats):
                for endpoint in ("chat", other):
                    runs[endpoint].append(asyncio.run(level(base, endpoint, n, args.new_tokens, run, to_eos)))
            chat, resp = statistics.median(runs["chat"]), statistics.median(runs[other])
            print(f"| {n} | {chat:.1f} | {resp:.1f} | {resp / chat:.3f}x |", flush=True)
        if not args.turns:
            return
        continued, fresh = asyncio.run(second_turn(base, args.turns))
        c, f = statistics.median(continued), statistics.median(fresh)
        print(f"\nsecond turn (previous_response_id) TTFT p50 {c * 1000:.0f} ms; a first turn of the same new input "
              f"{f * 1000:.0f} ms; ratio {c / f:.2f}")  # fmt: skip
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
