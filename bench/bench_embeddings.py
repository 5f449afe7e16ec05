"""/v1/embeddings: sentences per second over HTTP against sentence-transformers in process, chat beside
embeddings, and the memory the embedding model adds.

    .venv/bin/python bench/bench_embeddings.py [--clients 32] [--requests 8] [--repeats 3]

Alone: ``--clients`` concurrent clients each send ``--requests`` requests of 8 sentences (~12 words), against
``SentenceTransformer.encode(batch_size=32)`` on the same sentences in this process (float32 both; run after the
server has stopped, so the two never share the cores). Mixed: 4 greedy chat streams while 16 clients send embedding
requests: the chat streams' inter-token p50 against chat alone, and embedding throughput against embeddings alone.
Memory: the server's RSS idle and after the load, with the embedding model and with ``--embedding-model none``.
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

from compat.conftest import MODEL, start_server, stop_server  # noqa: E402

EMBEDDING = "all-MiniLM-L6-v2"
WORDS = ["river", "stone", "maple", "cloud", "lantern", "harbor", "meadow", "copper", "violet", "ember", "orchard"]


def sentences(count: int, seed: int) -> list[str]:
    return [" ".join(WORDS[(seed * 31 + i * 7 + k * 3) % len(WORDS)] for k in range(12)) for i in range(count)]


async def embed_clients(base: str, clients: int, requests: int, seed: int) -> float:
    """Sentences per second: ``clients`` clients, each ``requests`` requests of 8 sentences in turn."""
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(c: int) -> None:
            for r in range(requests):
                body = {"model": EMBEDDING, "input": sentences(8, seed * 1000 + c * 100 + r)}
                response = await client.post(f"{base}/v1/embeddings", json=body)
                response.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(clients)))
        return clients * requests * 8 / (time.perf_counter() - start)


async def chat_itl(base: str, streams: int, tokens: int) -> list[float]:
    """Inter-token gaps (s) of ``streams`` greedy chat streams."""
    gaps: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int) -> None:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell a story about {WORDS[i]}."}],
                    "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
            last = None
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now

        await asyncio.gather(*(one(i) for i in range(streams)))
    return gaps


async def mixed(base: str, seed: int) -> tuple[list[float], float]:
    chat = asyncio.ensure_future(chat_itl(base, 4, 128))
    rate = await embed_clients(base, 16, 4, seed)
    return await chat, rate


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def in_process(total: int, repeats: int) -> float:
    from sentence_transformers import SentenceTransformer

    from engine.runtime.encoder import default_path

    model = SentenceTransformer(str(default_path()), device="cpu")
    texts = sentences(total, 7)
    model.encode(texts[:64], batch_size=32)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.encode(texts, batch_size=32, normalize_embeddings=True)
        rates.append(total / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    proc, base = start_server("--model", MODEL)
    try:
        idle = rss_mib(proc.pid)
        asyncio.run(embed_clients(base, 4, 1, 0))  # warm-up
        alone = statistics.median(asyncio.run(embed_clients(base, args.clients, args.requests, s + 1))
                                  for s in range(args.repeats))  # fmt: skip
        loaded = rss_mib(proc.pid)
        chat_alone = statistics.median(asyncio.run(chat_itl(base, 4, 128)))
        gaps, rate = asyncio.run(mixed(base, 99))
    finally:
        stop_server(proc)
    proc, base = start_server("--model", MODEL, "--embedding-model", "none")
    try:
        without = rss_mib(proc.pid)
    finally:
        stop_server(proc)
    reference = in_process(args.clients * args.requests * 8, args.repeats)
    print(f"alone: HTTP {alone:.0f} sentences/s ({args.clients} clients x 8 sentences), sentence-transformers "
          f"encode(batch_size=32) in process {reference:.0f}: {alone / reference:.2f}x")  # fmt: skip
    mixed_itl = statistics.median(gaps)
    print(
        f"mixed: chat ITL p50 {chat_alone * 1000:.1f} ms alone, {mixed_itl * 1000:.1f} ms beside 16 embedding "
        f"clients ({mixed_itl / chat_alone:.2f}x); embeddings {rate:.0f} sentences/s ({rate / alone:.2f}x alone)"
    )
    print(f"memory: RSS idle {idle:.0f} MiB with the embedding model, {without:.0f} without "
          f"(+{idle - without:.0f}); after the embedding load {loaded:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
