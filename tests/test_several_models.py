"""Several chat models in one server (``app/services/model_pool.py``): routing by ``model``, load on first use (one load
for concurrent first requests, a failure named and the other models going on), unload when idle (``--keep-alive``), at
most ``--max-loaded-models`` (least recently used idle first), llama.cpp's ``/models/load`` and ``/models/unload``,
statuses in ``/v1/models`` and ``/health``, per-model metrics. Over fake engines here; two real GGUFs in a subprocess
server: ``test_two_gguf_models_in_one_server``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.server.app import create_app
from app.server.state import ServerConfig
from app.services.model_pool import LazyModel
from engine.chooser import ServedModel
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import ByteTokenizer


class Builds:
    """Builders of fake chat models that count their calls, take ``seconds`` each, and fail when told to."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.calls: dict[str, int] = {}
        self.seconds = seconds
        self.fail: set[str] = set()
        self.threads: list[str] = []

    def lazy(self, name: str, step_delay: float = 0.0) -> LazyModel:
        return LazyModel((name,), f"/models/{name}.gguf", lambda: self._build(name, step_delay), 64)

    def _build(self, name: str, step_delay: float) -> ServedModel:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.threads.append(threading.current_thread().name)
        time.sleep(self.seconds)
        if name in self.fail:
            raise OSError(f"{name}.gguf: no such file")
        return ServedModel(name, FakeEngine(max_model_len=64, step_delay=step_delay), ByteTokenizer())


def first_model(step_delay: float = 0.0) -> ServedModel:
    return ServedModel("alpha", FakeEngine(max_model_len=64, step_delay=step_delay), ByteTokenizer())


async def served(builds: Builds, names: list[str], step_delay: float = 0.0, **config: Any):
    """An app of ``alpha`` (loaded) and ``names`` (loaded when asked for), and an async client of it."""
    reload = LazyModel(("alpha",), "alpha", lambda: first_model(step_delay), 64)
    app = create_app(first_model(step_delay), ServerConfig(**config), lazy=[builds.lazy(n, step_delay) for n in names],
                     reload=reload)  # fmt: skip
    return app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=30)


async def _lifespan(app, body: Callable[[], Any]) -> None:
    state = app.state.server
    await state.start()
    try:
        await body()
    finally:
        await state.stop()


def complete(client: httpx.AsyncClient, model: str | None, **body: Any) -> Any:
    payload = {"prompt": "hi", "max_tokens": 3, **body}
    if model is not None:
        payload["model"] = model
    return client.post("/v1/completions", json=payload)


def statuses(listing: dict[str, Any]) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in listing["data"] if "status" in card}


def test_each_model_answers_by_name_and_loads_once_for_concurrent_first_requests() -> None:
    builds = Builds(seconds=0.3)

    async def body() -> None:
        app, client = await served(builds, ["beta"])
        async with client:

            async def check() -> None:
                listing = (await client.get("/v1/models")).json()
                assert statuses(listing) == {"alpha": "loaded", "beta": "unloaded"}
                assert [card["max_model_len"] for card in listing["data"]] == [64, 64]
                first = await asyncio.gather(*(complete(client, "beta") for _ in range(5)))
                assert all(r.status_code == 200 and r.json()["model"] == "beta" for r in first)
                assert builds.calls == {"beta": 1} and builds.threads == ["model-load"]  # one load, its own thread
                alpha = await complete(client, "alpha")
                assert alpha.json()["model"] == "alpha" and (await complete(client, None)).json()["model"] == "alpha"
                assert statuses((await client.get("/v1/models")).json()) == {"alpha": "loaded", "beta": "loaded"}
                missing = await complete(client, "gamma")
                assert missing.status_code == 404 and "beta" in missing.json()["error"]["message"]
                metrics = (await client.get("/metrics")).text
                assert 'smolserve:model_loaded{model="beta"} 1.0' in metrics
                assert 'smolserve:model_requests_total{model="beta"} 5.0' in metrics
                health = (await client.get("/health")).json()
                assert [m["status"] for m in health["models"]] == ["loaded", "loaded"]

            await _lifespan(app, check)

    asyncio.run(body())


def test_a_model_that_fails_to_load_is_named_and_the_others_go_on() -> None:
    builds = Builds(seconds=0.2)
    builds.fail.add("broken")

    async def body() -> None:
        app, client = await served(builds, ["broken"], step_delay=0.02)
        async with client:

            async def check() -> None:
                stream = asyncio.ensure_future(client.post("/v1/completions", json={
                    "model": "alpha", "prompt": "hi", "max_tokens": 20, "stream": True}))  # fmt: skip
                failed = await complete(client, "broken")
                assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_load_failed"
                assert (
                    "broken" in failed.json()["error"]["message"]
                    and "no such file" in failed.json()["error"]["message"]
                )
                streamed = await stream
                assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
                again = await complete(client, "broken")  # the next request tries again
                assert again.status_code == 500 and builds.calls["broken"] == 2
                assert statuses((await client.get("/v1/models")).json())["broken"] == "unloaded"

            await _lifespan(app, check)

    asyncio.run(body())


def test_an_idle_model_is_unloaded_after_keep_alive_and_loads_again() -> None:
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"], keep_alive_s=0.0)
        pool = app.state.server.pool
        async with client:

            async def check() -> None:
                assert (await complete(client, "beta")).status_code == 200
                deadline = time.monotonic() + 30  # idle: nothing running and no request routed for ROUTED_S (5 s)
                while pool.first is not None and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert statuses((await client.get("/v1/models")).json()) == {"alpha": "unloaded", "beta": "unloaded"}
                assert pool.first is None and (await client.get("/health")).status_code == 200
                assert (await complete(client, "beta")).json()["model"] == "beta" and builds.calls["beta"] == 2
                assert (await complete(client, "alpha")).json()["model"] == "alpha"  # the first loads again too

            await _lifespan(app, check)

    asyncio.run(body())


def test_max_loaded_models_unloads_the_least_recently_used_idle_one() -> None:
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta", "gamma"], keep_alive_s=-1, max_loaded_models=2)
        pool = app.state.server.pool
        async with client:

            async def check() -> None:
                assert (await complete(client, "beta")).status_code == 200
                for entry in pool.entries:  # past the grace for requests on their way to a queue
                    entry.last_used -= 10
                pool.entry("alpha").last_used -= 5  # alpha used longest ago
                assert (await complete(client, "gamma")).status_code == 200
                assert statuses((await client.get("/v1/models")).json()) == {
                    "alpha": "unloaded", "beta": "loaded", "gamma": "loaded"}  # fmt: skip

            await _lifespan(app, check)

    asyncio.run(body())


def test_one_loaded_model_at_a_time_takes_turns_by_request() -> None:
    """``--max-loaded-models 1``: each request for the other model unloads the idle one first."""
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"], keep_alive_s=-1, max_loaded_models=1)
        pool = app.state.server.pool
        async with client:

            async def check() -> None:
                for name, other in (("beta", "alpha"), ("alpha", "beta"), ("beta", "alpha")):
                    for entry in pool.entries:  # past the grace for requests on their way to a queue
                        entry.last_used -= 10
                    assert (await complete(client, name)).json()["model"] == name
                    assert statuses((await client.get("/v1/models")).json()) == {name: "loaded", other: "unloaded"}
                assert builds.calls == {"beta": 2}

            await _lifespan(app, check)

    asyncio.run(body())


def test_a_busy_model_is_never_unloaded_and_a_load_that_cannot_fit_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from app.services import model_pool

    monkeypatch.setattr(model_pool, "LOAD_WAIT_S", 0.5)
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"], step_delay=0.05, keep_alive_s=0.0, max_loaded_models=1)
        async with client:

            async def check() -> None:
                stream = asyncio.ensure_future(complete(client, "alpha", max_tokens=40))
                alpha = app.state.server.pool.entry("alpha").model
                while alpha.backend.is_idle:  # until the stream is queued or running
                    await asyncio.sleep(0.01)
                refused = await client.post("/models/unload", json={"model": "alpha"})
                assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_busy"
                busy = await complete(client, "beta")  # alpha runs: no room for beta
                assert busy.status_code == 503 and busy.headers["retry-after"] and "beta" in busy.text
                assert (await stream).status_code == 200

            await _lifespan(app, check)

    asyncio.run(body())


def test_models_load_and_unload_as_llama_cpp_s_router() -> None:
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"], keep_alive_s=-1, api_key="k")
        async with client:

            async def check() -> None:
                assert (await client.post("/models/load", json={"model": "beta"})).status_code == 401
                key = {"Authorization": "Bearer k"}
                loaded = await client.post("/models/load", json={"model": "beta"}, headers=key)
                assert loaded.json() == {"success": True} and builds.calls == {"beta": 1}
                unloaded = await client.post("/models/unload", json={"model": "beta"}, headers=key)
                assert unloaded.json() == {"success": True}
                listing = (await client.get("/v1/models", headers=key)).json()
                assert statuses(listing) == {"alpha": "loaded", "beta": "unloaded"}
                missing = await client.post("/models/load", json={"model": "nope"}, headers=key)
                assert missing.status_code == 404
                nameless = await client.post("/models/load", json={}, headers=key)
                assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "model"

            await _lifespan(app, check)

    asyncio.run(body())


def test_one_chat_model_stays_loaded() -> None:
    app = create_app(first_model(), ServerConfig(keep_alive_s=0.0))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1")

    async def body() -> None:
        async with client:

            async def check() -> None:
                refused = await client.post("/models/unload", json={"model": "alpha"})
                assert refused.status_code == 400 and "only chat model" in refused.json()["error"]["message"]
                assert [e["status"] for e in (await client.get("/health")).json()["models"]] == ["loaded"]

            await _lifespan(app, check)

    asyncio.run(body())


def test_streams_of_two_models_run_together() -> None:
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"], step_delay=0.01)
        async with client:

            async def check() -> None:
                answers = await asyncio.gather(*(
                    client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 12,
                                                         "stream": True})
                    for name in ("alpha", "beta", "alpha", "beta")))  # fmt: skip
                for name, answer in zip(("alpha", "beta", "alpha", "beta"), answers, strict=True):
                    assert answer.status_code == 200 and f'"model":"{name}"' in answer.text.replace(" ", "")

            await _lifespan(app, check)

    asyncio.run(body())


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def _wait_for(client: httpx.Client, name: str, status: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while statuses(client.get("/v1/models").json())[name] != status:
        assert time.monotonic() < deadline, f"{name} never became {status}"
        time.sleep(0.25)


def test_two_gguf_models_in_one_server(tmp_path) -> None:
    """``python -m app --model tiny.gguf --model SmolLM2-135M-Instruct``: both listed; the bundled one loads on its
    first request and answers by its name; streams to both at once; unloaded after ``--keep-alive`` (resident memory
    falls by its weights), loaded again with the same greedy answer."""
    from gguf_files import tiny_model, write_gguf

    from compat.conftest import start_server, stop_server
    from engine.core.config import DEFAULT_MODEL
    from engine.runtime import loader

    tiny = tmp_path / "tiny-llama.gguf"
    write_gguf(tiny_model("llama", vocab=49152, seed=3), "llama", tiny, loader._default_gguf(), {})
    # 0.5 GiB: a float32 KV cache (a CPU without BF16) holds a whole 8,192-token sequence of the default model.
    # A keep-alive of 5 s: on a busy machine one model's load took 4.7 s, and the other, idle past a 1-s keep-alive
    # meanwhile, was unloaded before the resident memory of both was read.
    proc, base = start_server("--model", str(tiny), "--model", DEFAULT_MODEL, "--keep-alive", "5",
                              "--embedding-model", "none", "--kv-cache-gib", "0.5",
                              env={"SMOLSERVE_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    ask = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
    try:
        with httpx.Client(base_url=base, timeout=300) as client:
            assert statuses(client.get("/v1/models").json()) == {"tiny-llama": "loaded", DEFAULT_MODEL: "unloaded"}
            unloaded_mib = _rss_mib(proc.pid)
            first = client.post("/v1/chat/completions", json={**ask, "model": DEFAULT_MODEL}).json()
            assert first["model"] == DEFAULT_MODEL and first["choices"][0]["message"]["content"]
            body = {**ask, "stream": True, "max_tokens": 32}
            url = f"{base}/v1/chat/completions"
            with ThreadPoolExecutor(2) as pool:  # both at once
                both = list(pool.map(lambda name: httpx.post(url, json={**body, "model": name}, timeout=300),
                                     ("tiny-llama", DEFAULT_MODEL)))  # fmt: skip
            assert all(r.status_code == 200 and r.text.rstrip().endswith("[DONE]") for r in both)
            loaded_mib = _rss_mib(proc.pid)
            _wait_for(client, DEFAULT_MODEL, "unloaded", 30)
            after_mib = _rss_mib(proc.pid)
            print(f"resident MiB: before {unloaded_mib:.0f}, loaded {loaded_mib:.0f}, unloaded {after_mib:.0f}")
            assert after_mib < loaded_mib - 40
            again = client.post("/v1/chat/completions", json={**ask, "model": DEFAULT_MODEL}).json()
            assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
            metrics = client.get("/metrics").text
            assert f'smolserve:model_load_seconds{{model="{DEFAULT_MODEL}"}}' in metrics
    finally:
        stop_server(proc)
