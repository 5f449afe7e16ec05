"""Prefix-caching benchmark: shared-preamble and multi-turn chat workloads, smolserve with and without its prefix
cache, and llama.cpp's server (its per-slot prompt cache) on the same requests.

    .venv/bin/python bench/bench_prefix.py                                   # smolserve: cache on, then off
    .venv/bin/python bench/bench_prefix.py --llama-server "$(../shared/tools/build-llama-server.sh)"

Shared preamble: one warm-up request sends the ~1,000-token preamble; then `--bursts` (2) bursts, one after
another, of `--streams` (16) chat requests at once, each the preamble + a distinct question, `--new-tokens` (64)
greedy tokens each (ignore_eos). Reported per burst: TTFT p50/p99, aggregate tokens/s, and the cached prompt tokens
the server reported. (llama.cpp keeps a prompt cache per slot: in the first burst only the warmed slot holds the
preamble, in the second every slot does.)

Multi-turn: `--users` (8) simulated users at once, each a conversation of `--turns` (6) turns, each turn re-sending
the whole history with the previous answers, `--turn-tokens` (48) tokens per answer. Reported: TTFT p50 of each turn.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import sse_chunks  # noqa: E402
from llama import start_llama  # noqa: E402

from compat.conftest import FACTS, start_server, stop_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PREAMBLE = "You answer questions using only these facts.\n" + "\n".join(FACTS * 12)  # ~1,000 tokens
QUESTIONS = [f"Question {i}: which of the facts above is the most surprising, and why?" for i in range(64)]
FOLLOW_UPS = ["Tell me more.", "Why is that?", "Give an example.", "Say it differently.", "Summarize so far."]


async def chat(
    client: httpx.AsyncClient, base: str, messages: list[dict], new_tokens: int
) -> tuple[float, float, str, int]:
    """One streamed greedy chat request: (seconds to its first token, to its end, its text, cached tokens)."""
    body = {
        "model": MODEL, "messages": messages, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first, parts, cached = None, [], 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        async for chunk in sse_chunks(response):
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
            usage = chunk.get("usage")
            if usage:
                cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    end = time.perf_counter()
    return (first or end) - start, end - start, "".join(parts), cached


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def shared_prefix(base: str, streams: int, new_tokens: int, burst: int) -> dict[str, float]:
    """Burst number ``burst`` (0, 1, ...) of ``streams`` requests at once, each the preamble and its own question;
    before the first, one request warms the cache with the preamble."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        if burst == 0:
            await chat(client, base, [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "Hi."}], 4)
        started = time.perf_counter()
        runs = await asyncio.gather(*(
            chat(client, base, [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": q}], new_tokens)
            for q in QUESTIONS[burst * streams : (burst + 1) * streams]
        ))  # fmt: skip
        wall = time.perf_counter() - started
    ttfts = [run[0] for run in runs]
    return {
        "ttft_p50": statistics.median(ttfts), "ttft_p99": pct(ttfts, 0.99), "tok_s": streams * new_tokens / wall,
        "cached_mean": statistics.mean(run[3] for run in runs),
    }  # fmt: skip


async def multi_turn(base: str, users: int, turns: int, new_tokens: int) -> list[float]:
    """TTFT p50 of each turn over the users."""
    per_turn: list[list[float]] = [[] for _ in range(turns)]

    async def user(client: httpx.AsyncClient, index: int) -> None:
        history = [
            {"role": "system", "content": "You are a friendly guide. " + FACTS[index % len(FACTS)]},
            {"role": "user", "content": f"I am user {index}. Tell me about the fact you know."},
        ]
        for turn in range(turns):
            ttft, _, text, _ = await chat(client, base, history, new_tokens)
            per_turn[turn].append(ttft)
            history += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UPS[turn % 5]}]

    async with httpx.AsyncClient(
        timeout=900, limits=httpx.Limits(max_connections=users + 4, max_keepalive_connections=0)
    ) as client:
        await asyncio.gather(*(user(client, i) for i in range(users)))
    return [statistics.median(ttfts) for ttfts in per_turn]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bursts", type=int, default=2, help="shared-preamble bursts, one after another")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server, to compare against")
    parser.add_argument("--only", choices=["shared", "turns"], default=None)
    args = parser.parse_args()
    targets: list[tuple[str, object]] = [
        ("smolserve, prefix cache", []),
        ("smolserve, --no-prefix-caching", ["--no-prefix-caching"]),
    ]
    if args.llama_server:
        targets.append(("llama.cpp server", args.llama_server))
    for name, spec in targets:
        if isinstance(spec, str):
            proc, base = start_llama(spec, max(args.streams, args.users), context=2048)
        else:
            proc, base = start_server("--model", MODEL, *spec)
        try:
            for burst in range(args.bursts if args.only != "turns" else 0):
                shared = asyncio.run(shared_prefix(base, args.streams, args.new_tokens, burst))
                print(f"{name}: shared preamble, burst {burst + 1} of {args.streams} streams: TTFT p50 "
                      f"{shared['ttft_p50']:.2f} s, p99 {shared['ttft_p99']:.2f} s, {shared['tok_s']:.1f} tok/s, "
                      f"cached prompt tokens (mean) {shared['cached_mean']:.0f}", flush=True)  # fmt: skip
            if args.only != "shared":
                turns = asyncio.run(multi_turn(base, args.users, args.turns, args.turn_tokens))
                listed = ", ".join(f"{t:.2f}" for t in turns)
                print(f"{name}: multi-turn, {args.users} users: TTFT p50 per turn [{listed}] s; "
                      f"turn {args.turns} / turn 1 = {turns[-1] / turns[0]:.2f}", flush=True)  # fmt: skip
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
