"""Two chat models in one server (``--model A --model B``, ``app/services/model_pool.py``): by default the bundled
SmolLM2 (loaded at start) and the Qwen2.5-Coder GGUF of ``../shared/tools/user-models.sh`` (loaded when first asked
for).

    .venv/bin/python bench/bench_models.py [--second FILE] [--streams 8] [--tokens 64]

Prints: A's idle time to first token (median of 5); B's first request (its load included) and A's time to first
token while B loads (median of those that started during the load, and their ratio to idle); tokens/s of
``--streams`` closed-loop streams on A alone, on B alone, and on both at once (half each); resident memory before
B loads, with B loaded, and after ``POST /models/unload``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import start_server, stop_server  # noqa: E402
from engine.core.config import DEFAULT_MODEL  # noqa: E402

USER_MODELS = ROOT.parent / "shared" / "tools" / "user-models.sh"


async def ttft(client: httpx.AsyncClient, model: str, tokens: int = 4) -> tuple[float, int]:
    """Seconds to the first streamed token of a short prompt, and the tokens generated (the usage chunk's: a chunk
    may carry several tokens where drafts were accepted)."""
    body = {"model": model, "prompt": f"Count: {time.perf_counter_ns()}", "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started, first, count = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    count = chunk["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter() - started
    return first or float("nan"), count


async def throughput(client: httpx.AsyncClient, models: list[str], streams: int, tokens: int, seconds: float) -> float:
    """Tokens/s of ``streams`` closed-loop streams spread over ``models`` for ``seconds``."""
    deadline = time.perf_counter() + seconds
    done = [0]

    async def loop(model: str) -> None:
        while time.perf_counter() < deadline:
            _, got = await ttft(client, model, tokens)
            done[0] += got  # not `done[0] += await ...`: that reads done[0] before the await

    started = time.perf_counter()
    await asyncio.gather(*(loop(models[i % len(models)]) for i in range(streams)))
    return done[0] / (time.perf_counter() - started)


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


async def measure(base: str, pid: int, first: str, second: str, streams: int, tokens: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await ttft(client, first)
        idle = statistics.median([(await ttft(client, first))[0] for _ in range(5)])
        before = rss_mib(pid)
        load_started = time.perf_counter()
        loading = asyncio.ensure_future(ttft(client, second))
        during = []
        while not loading.done():
            during.append((await ttft(client, first))[0])
            await asyncio.sleep(0.2)
        load_s = time.perf_counter() - load_started
        loaded = rss_mib(pid)
        print(f"{first}: idle TTFT {idle * 1000:.0f} ms")
        print(f"{second}: first request (load included) {load_s:.1f} s")
        if during:
            ratio = statistics.median(during) / idle
            print(f"{first}: TTFT while {second} loads {statistics.median(during) * 1000:.0f} ms (median of "
                  f"{len(during)}), {ratio:.2f}x idle")  # fmt: skip
        alone_a = await throughput(client, [first], streams, tokens, 20)
        alone_b = await throughput(client, [second], streams, tokens, 20)
        both = await throughput(client, [first, second], streams, tokens, 20)
        print(f"tokens/s, {streams} streams: {first} alone {alone_a:.0f}, {second} alone {alone_b:.0f}, "
              f"both at once {both:.0f}")  # fmt: skip
        (await client.post("/models/unload", json={"model": second})).raise_for_status()
        await asyncio.sleep(1)
        print(f"resident MiB: before {second} loads {before:.0f}, loaded {loaded:.0f}, unloaded {rss_mib(pid):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--second", type=Path, default=None, help="the model loaded on first use (a GGUF)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    second = args.second or Path(subprocess.run(["bash", str(USER_MODELS)], capture_output=True, text=True,
                                                check=True).stdout.strip().splitlines()[-1])  # fmt: skip
    proc, base = start_server("--model", DEFAULT_MODEL, "--model", str(second), "--keep-alive", "-1",
                              "--embedding-model", "none", "--kv-cache-gib", "1")  # fmt: skip
    try:
        asyncio.run(measure(base, proc.pid, DEFAULT_MODEL, second.stem, args.streams, args.tokens))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
