"""What abuse costs a live server (``python -m app --model fake``): eight concurrent uploads of 199 MB (the largest
whose form fits the default 200 MiB; the server's peak resident memory before and after), and a Messages body of
250,000 ``stop_sequences`` (refused by the list bounds: how long the 400 takes against a small request's answer).
Prints the numbers.

    python bench/bench_bounds.py [--uploads 8] [--upload-mb 199]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from compat.conftest import start_server, stop_server

MB = 2**20
BOUNDARY = "benchboundary"


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def multipart(size_mb: int) -> AsyncIterator[bytes]:
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
           'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n').encode()  # fmt: skip
    chunk = b"x" * MB
    for _ in range(size_mb):
        yield chunk
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


async def uploads(base: str, pid: int, count: int, size_mb: int) -> None:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await client.post("/v1/files", content=multipart(1), headers=headers)
        before, began = peak_rss_mb(pid), time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/files", content=multipart(size_mb), headers=headers)
                                         for _ in range(count)))  # fmt: skip
        took, after = time.perf_counter() - began, peak_rss_mb(pid)
    print(
        f"{count} concurrent uploads of {size_mb} MB: statuses {sorted({a.status_code for a in answers})}, "
        f"{took:.1f} s, peak RSS {before:.0f} -> {after:.0f} MB (+{after - before:.0f} MB)"
    )


def stops(base: str) -> None:
    body = json.dumps({"model": "fake", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                       "stop_sequences": ["x"] * 250_000}).encode()  # fmt: skip
    small = {"model": "fake", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=base, timeout=60, headers={"content-type": "application/json"}) as client:
        client.post("/v1/messages", json=small)
        refused, plain = [], []
        for _ in range(5):
            began = time.perf_counter()
            answer = client.post("/v1/messages", content=body)
            refused.append(time.perf_counter() - began)
            began = time.perf_counter()
            client.post("/v1/messages", json=small)
            plain.append(time.perf_counter() - began)
    print(
        f"250,000 stop_sequences ({len(body) / MB:.1f} MB): {answer.status_code} in {min(refused) * 1000:.0f} ms "
        f"(a one-token request: {min(plain) * 1000:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--upload-mb", type=int, default=199)  # the form around it fits --max-file-bytes (200 MiB)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as data:
        proc, base = start_server("--model", "fake", "--data-dir", data, startup_timeout=60)
        try:
            asyncio.run(uploads(base, proc.pid, args.uploads, args.upload_mb))
            stops(base)
        finally:
            stop_server(proc)


if __name__ == "__main__":
    main()
