"""Serving under pressure, over real HTTP: backpressure, abandoned requests, engine faults mid-batch.

The server is uvicorn in a background thread over the fake engine, whose steps take a few milliseconds
like a real forward, so requests really overlap.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from app.server.app import create_app
from app.server.state import ServerConfig
from engine.chooser import ServedModel
from engine.core.fake_engine import FakeEngine
from engine.core.scheduler import Scheduler
from engine.core.tokenizer import ByteTokenizer


@dataclass
class LiveServer:
    url: str
    engine: FakeEngine
    scheduler: Scheduler


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def live_server(engine: FakeEngine, **config: int) -> Iterator[LiveServer]:
    app = create_app(ServedModel("fake", engine, ByteTokenizer()), ServerConfig(**config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app.state.server.backend.scheduler)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def slow_server() -> Iterator[LiveServer]:
    yield from live_server(FakeEngine(capacity=2, max_model_len=100_000, step_delay=0.01), max_queue=2)


@pytest.fixture
def big_server() -> Iterator[LiveServer]:
    yield from live_server(FakeEngine(capacity=8, max_model_len=100_000, step_delay=0.005))


def completion(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"prompt": "hi", "max_tokens": max_tokens, "stream": stream}


def test_full_queue_gets_429_while_admitted_requests_complete(slow_server: LiveServer) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=30) as client:
            running = [asyncio.create_task(client.post("/v1/completions", json=completion(60))) for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: slow_server.engine.num_active() == 2)
            waiting = [asyncio.create_task(client.post("/v1/completions", json=completion(5))) for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: slow_server.scheduler.num_waiting == 2)

            refused = await client.post("/v1/completions", json=completion(5))
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            # Anthropic's Messages API: 529 overloaded_error, which its clients retry.
            message = {"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            overloaded = await client.post("/v1/messages", json=message)
            assert overloaded.status_code == 529 and overloaded.json()["error"]["type"] == "overloaded_error"

            for response, tokens in zip(await asyncio.gather(*running, *waiting), [60, 60, 5, 5], strict=True):
                assert response.status_code == 200
                assert response.json()["usage"]["completion_tokens"] == tokens
            later = await client.post("/v1/completions", json=completion(3))
            assert later.json()["choices"][0]["text"] == "abc"
            metrics = (await client.get("/metrics")).text
            assert 'smolserve:requests_rejected_total{reason="queue_full"} 2.0' in metrics

    asyncio.run(main())


def test_abandoned_requests_leave_the_batch_and_free_the_engine(big_server: LiveServer) -> None:
    budget = 50_000  # each would run for minutes if nobody stopped it

    async def abandon_stream(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=completion(budget, stream=True)) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # hang up after the first token

    async def abandon_plain(client: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):  # hang up 0.3 s after sending, however long connecting took
            await client.post("/v1/completions", json=completion(budget), timeout=httpx.Timeout(30, read=0.3))

    async def main() -> None:
        async with httpx.AsyncClient(base_url=big_server.url, timeout=30) as client:
            await asyncio.gather(
                *(abandon_stream(client) for _ in range(20)), *(abandon_plain(client) for _ in range(20))
            )
            await asyncio.to_thread(
                wait_until, lambda: big_server.engine.num_active() == 0 and big_server.scheduler.is_idle
            )
            metrics = (await client.get("/metrics")).text
            assert "smolserve:num_requests_running 0.0" in metrics
            assert "smolserve:num_requests_waiting 0.0" in metrics
            tokens_then = big_server.engine.num_tokens
            fresh = await client.post("/v1/completions", json=completion(4))
            assert fresh.json()["choices"][0]["text"] == "abcd"
            assert big_server.engine.num_tokens == tokens_then + 4  # nothing else is generating
        assert tokens_then < 40 * budget // 100

    asyncio.run(main())


def test_engine_fault_mid_batch_fails_both_formats_then_serves(big_server: LiveServer) -> None:
    big_server.engine.fail_on_step = big_server.engine.num_steps + 20

    async def main() -> None:
        async with httpx.AsyncClient(base_url=big_server.url, timeout=30) as client:

            async def streamed() -> list[str]:
                async with client.stream("POST", "/v1/completions", json=completion(100, stream=True)) as response:
                    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]

            plain, events = await asyncio.gather(client.post("/v1/completions", json=completion(100)), streamed())
            assert plain.status_code == 500
            assert "injected engine fault" in plain.json()["error"]["message"]
            assert events[-1] == "[DONE]"
            assert "injected engine fault" in json.loads(events[-2])["error"]["message"]
            assert json.loads(events[0])["choices"][0]["text"] == "a"  # it had been streaming
            again = await client.post("/v1/completions", json=completion(2))
            assert again.json()["choices"][0]["text"] == "ab"

    asyncio.run(main())
