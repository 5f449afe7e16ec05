"""Uploads bounded in bytes on a live server (``python -m app --model fake``): streamed to disk while counted (the
server's peak resident memory stays flat under concurrent large uploads), at most ``--max-concurrent-uploads`` at
once, all files within ``--max-data-bytes``; a refused or broken upload leaves nothing under ``--data-dir``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from compat.conftest import start_server, stop_server

MB = 2**20
BOUNDARY = "smolserveboundary"


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def _multipart(size: int, pause: float = 0.0) -> AsyncIterator[bytes]:
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
           'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
           "Content-Type: application/octet-stream\r\n\r\n").encode()  # fmt: skip
    chunk = b"x" * MB
    for _ in range(size // MB):
        yield chunk
        if pause:
            await asyncio.sleep(pause)
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


async def _upload(client: httpx.AsyncClient, size: int, pause: float = 0.0) -> httpx.Response:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    return await client.post("/v1/files", content=_multipart(size, pause), headers=headers, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    data = tmp_path_factory.mktemp("data")
    flags = ("--model", "fake", "--data-dir", str(data), "--max-file-bytes", str(64 * MB),
             "--max-data-bytes", str(600 * MB), "--max-concurrent-uploads", "8")  # fmt: skip
    proc, base = start_server(*flags, startup_timeout=60)
    try:
        yield base, proc.pid, data
    finally:
        stop_server(proc)


def _files_left(data: Path) -> list[str]:
    return sorted(path.name for path in (data / "files").iterdir())


def test_concurrent_uploads_stream_to_disk(server: tuple[str, int, Path]) -> None:
    """Eight 48 MB uploads at once: held whole, each was three copies in memory (over 1 GB); streamed, the peak
    grows by a small part of one."""
    base, pid, data = server

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base) as client:
            await _upload(client, MB)  # the store opened and the parser imported before the baseline
            before = _peak_rss(pid)
            answers = await asyncio.gather(*(_upload(client, 48 * MB) for _ in range(8)))
            grown = _peak_rss(pid) - before
            assert grown < 100 * MB, f"peak RSS grew by {grown / MB:.0f} MB"
            return answers

    answers = asyncio.run(run())
    assert [answer.status_code for answer in answers] == [200] * 8, answers[0].text
    assert {answer.json()["bytes"] for answer in answers} == {48 * MB}
    with httpx.Client(base_url=base) as client:
        for answer in answers:
            assert client.delete(f"/v1/files/{answer.json()['id']}").status_code == 200
    assert not [name for name in _files_left(data) if name.endswith(".partial")]


def test_uploads_past_the_bounds_are_refused_and_leave_nothing(server: tuple[str, int, Path]) -> None:
    base, _, data = server
    kept = set(_files_left(data))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base) as client:
            too_big = await _upload(client, 65 * MB)
            assert too_big.status_code == 413 and too_big.json()["error"]["code"] in ("request_too_large",
                                                                                      "file_too_large")  # fmt: skip
            filled = [await _upload(client, 60 * MB) for _ in range(9)]  # 540 MB of the 600
            assert [answer.status_code for answer in filled] == [200] * 9
            full = await _upload(client, 62 * MB)
            assert full.status_code == 507 and full.json()["error"]["code"] == "storage_full"
            assert "--max-data-bytes" in full.json()["error"]["message"]
            for answer in filled:
                await client.delete(f"/v1/files/{answer.json()['id']}")
            assert (await _upload(client, 62 * MB)).status_code == 200  # deleting made room

    asyncio.run(run())
    assert not [name for name in set(_files_left(data)) - kept if name.endswith(".partial")]


def test_more_uploads_at_once_than_the_bound_get_a_429(server: tuple[str, int, Path]) -> None:
    base, _, _ = server

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base) as client:
            slow = [asyncio.ensure_future(_upload(client, 8 * MB, pause=0.25)) for _ in range(8)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the eight are being received
                await asyncio.sleep(0.2)
                extra = await _upload(client, MB)
                if extra.status_code == 429:
                    break
            assert extra.status_code == 429 and extra.json()["error"]["code"] == "too_many_uploads"
            assert extra.headers["retry-after"] == "1"
            assert [answer.status_code for answer in await asyncio.gather(*slow)] == [200] * 8
            assert (await _upload(client, MB)).status_code == 200

    asyncio.run(run())


def test_a_client_that_leaves_mid_upload_leaves_no_file(server: tuple[str, int, Path]) -> None:
    base, _, data = server
    before = set(_files_left(data))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base) as client:
            task = asyncio.ensure_future(_upload(client, 32 * MB, pause=0.05))
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while set(_files_left(data)) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(_files_left(data)) == before
    assert os.path.isdir(data / "files")
