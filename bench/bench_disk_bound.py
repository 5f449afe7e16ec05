"""The prefix cache's disk tier (``engine/runtime/kv_disk.py``) held to its bound over a long run.

``--prompts`` distinct prompts (1,000) of about ``--prompt-words`` words each, ``--concurrency`` at a time, one
token answered, to one server (default flags, the bundled model unless ``--gguf``) whose ``--kv-disk-gib`` is small
(``--bound-mib``, 32): every prompt's full blocks are written and most are evicted again. A thread sums the
folder's files (``.kv`` and ``.tmp``) every 50 ms; printed: the most it ever held against the bound, what the tier
says it wrote, dropped, evicted and holds, the run's prompts per second, and, after a restart over the same
``--data-dir``, whether the last prompts are found on disk (the newest blocks are the ones kept). A sum of the
folder is not taken at one instant: a file evicted and another written while it is summed may both be counted.

    .venv/bin/python bench/bench_disk_bound.py --prompts 1000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import start_server, stop_server  # noqa: E402

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
         "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
         "xray", "yankee", "zulu"]  # fmt: skip


def prompt(index: int, words: int) -> str:
    rng = random.Random(index)
    return f"Request {index}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _watch(folder: str, every: float, stop: Any, most: Any, samples: Any) -> None:
    """In a process of its own (no lock shared with the clients, so that a sum takes a fraction of a millisecond and
    sees few files come and go while it is summed): the block files' bytes, every ``every`` seconds."""
    while not stop.is_set():
        held = 0
        for top, _, names in os.walk(folder):
            for name in names:
                if name.endswith((".kv", ".tmp")):
                    with contextlib.suppress(OSError):  # evicted while summed
                        held += os.stat(os.path.join(top, name)).st_size
        most.value, samples.value = max(most.value, held), samples.value + 1
        time.sleep(every)


class FolderWatch:
    """The most bytes the folder's block files held at any sample."""

    def __init__(self, folder: Path, every: float = 0.05) -> None:
        self._stop = multiprocessing.Event()
        self._most, self._samples = multiprocessing.Value("q", 0), multiprocessing.Value("q", 0)
        self._process = multiprocessing.Process(
            target=_watch, args=(str(folder), every, self._stop, self._most, self._samples), daemon=True
        )
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self._process.join()
        self.most, self.samples = self._most.value, self._samples.value


async def send_all(base: str, model: str, count: int, words: int, concurrency: int) -> int:
    """Every prompt answered with one token, ``concurrency`` at a time; the number of answers that were not 200."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(count):
        queue.put_nowait(index)
    failed = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failed
        while not queue.empty():
            index = queue.get_nowait()
            body = {"model": model, "prompt": prompt(index, words), "max_tokens": 1, "temperature": 0}
            response = await http.post(f"{base}/v1/completions", json=body)
            failed += response.status_code != 200

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return failed


def disk_facts(base: str) -> dict:
    """The tier's description in ``/health`` (``kv_disk``, wherever it is nested)."""

    def find(node: object) -> dict | None:
        if isinstance(node, dict):
            if isinstance(node.get("kv_disk"), dict):
                return node["kv_disk"]
            return next((found for value in node.values() if (found := find(value)) is not None), None)
        if isinstance(node, list):
            return next((found for value in node if (found := find(value)) is not None), None)
        return None

    return find(httpx.get(f"{base}/health", timeout=30).json()) or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the model (default: the bundled one)")
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--prompt-words", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--bound-mib", type=float, default=32)
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="bench-disk-bound-"))
    model_flags = ("--model", args.gguf) if args.gguf else ()
    flags = (*model_flags, "--embedding-model", "none", "--kv-disk-gib", str(args.bound_mib / 1024),
             "--data-dir", str(data), "--log-level", "warning")  # fmt: skip
    bound = int(args.bound_mib * 2**20)
    proc, base = start_server(*flags)
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    watch = FolderWatch(data)
    try:
        started = time.perf_counter()
        failed = asyncio.run(send_all(base, model, args.prompts, args.prompt_words, args.concurrency))
        seconds = time.perf_counter() - started
        during = disk_facts(base)
    finally:
        stop_server(proc)  # SIGTERM: what is queued is written, then the bound holds again
    watch.stop()
    proc, base = start_server(*flags)
    try:
        body = {"model": model, "prompt": prompt(args.prompts - 1, args.prompt_words), "max_tokens": 1}
        usage = httpx.post(f"{base}/v1/completions", json=body, timeout=600).json()["usage"]
        restarted = disk_facts(base)
    finally:
        stop_server(proc)
    print(f"prompts: {args.prompts} ({failed} not answered 200) in {seconds:.1f} s, "
          f"{args.prompts / seconds:.1f} a second, {args.concurrency} at a time")  # fmt: skip
    print(f"bound: {bound} bytes; the most the folder held (of {watch.samples} samples): {watch.most} bytes "
          f"({watch.most / bound:.3f} of the bound)")  # fmt: skip
    for key in ("written_blocks", "dropped_writes", "blocks", "bytes", "read_seconds_per_block"):
        print(f"tier at the run's end: {key} = {during.get(key)}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    print(f"after a restart: the last prompt's {usage['prompt_tokens']} tokens, {cached} from the cache "
          f"(disk hits {restarted.get('hit_tokens')}); the folder holds {restarted.get('bytes')} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
