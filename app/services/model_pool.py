"""The chat models one server serves (``--model`` given more than once, ``--models-dir``): each by its names, loaded
at start (the first) or when first asked for, unloaded when idle. Torch-free: a model is built by the callable the
command line gives (``engine.chooser.build``), on a thread of its own that ends once the model is built.

The rules, in one place:
- **Load on first use**: a request for a model not loaded waits for its load (concurrent first requests cause
  one); a load that fails is an error naming the model and the reason, for that request (the next one tries again),
  while the other models go on.
- **Unload when idle**: with more than one chat model, a model idle for ``--keep-alive`` seconds is unloaded (-1:
  never; 0: as soon as it is idle). Idle: nothing running or waiting in its scheduler and no request routed to it
  for ``ROUTED_S`` seconds (a request between routing and its queue: parsing, rendering).
- **At most ``--max-loaded-models``**: a load that would exceed it first unloads the least recently used idle model;
  with none idle it waits up to ``LOAD_WAIT_S`` for one, then answers 503 with ``Retry-After``. Loads run one at a
  time.
- **Sharing the cores**: every model's steps run on the one engine thread, each scheduler with at most one step
  queued there, so busy models take turns step by step (none starves; each step is one model's batch). A load runs
  at the lowest CPU priority, on the cores the steps leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from app.pipeline.chat_model import ChatModel
from app.wire.openai.errors import APIError
from engine.chooser import ServedModel
from engine.core.heap import trim_heap

log = logging.getLogger(__name__)
T = TypeVar("T")
#: A request routed to a model this recently may still be on its way to the model's queue: the model is not idle.
ROUTED_S = 5.0
#: How long a load waits for a loaded model to fall idle when ``--max-loaded-models`` are loaded and busy.
LOAD_WAIT_S = 60.0
#: How often idle models are looked for.
SWEEP_S = 1.0
#: A loading thread's niceness (Linux: per thread; its threads inherit it).
LOAD_NICENESS = 19
#: ``--keep-alive``'s default, as Ollama's: five minutes.
KEEP_ALIVE_S = 300.0
Status = Literal["loaded", "loading", "unloaded"]


@dataclass(slots=True, frozen=True)
class LazyModel:
    """A chat model loaded when first asked for: its names (the first is reported), where it comes from, its
    context length where known before loading, and how to build it (called on a loading thread)."""

    names: tuple[str, ...]
    source: str
    build: Callable[[], ServedModel]
    max_model_len: int | None = None


@dataclass(slots=True)
class PoolEntry:
    names: tuple[str, ...]
    spec: LazyModel | None  # None: a model given loaded, that cannot be loaded again (a cluster's)
    model: ChatModel | None = None
    loading: asyncio.Task[ChatModel] | None = None
    last_used: float = field(default_factory=time.monotonic)
    max_model_len: int | None = None
    load_seconds: float | None = None
    #: How long the model stays loaded once idle, as the last request asked (Ollama's ``keep_alive``; negative:
    #: for good); None: ``--keep-alive``.
    keep_alive_s: float | None = None

    @property
    def status(self) -> Status:
        return "loaded" if self.model is not None else "loading" if self.loading is not None else "unloaded"

    @property
    def idle(self) -> bool:
        model = self.model
        return model is not None and model.backend.is_idle and time.monotonic() - self.last_used >= ROUTED_S


class NotLoaded(Exception):
    """A request routed to a model not loaded: its load is awaited, then the request prepared again."""

    def __init__(self, entry: PoolEntry) -> None:
        self.entry = entry


class ModelPool:
    def __init__(
        self, first: ChatModel, lazy: list[LazyModel], make: Callable[[ServedModel, tuple[str, ...]], ChatModel],
        keep_alive_s: float, max_loaded: int | None, registry: CollectorRegistry, reload: LazyModel | None = None,
    ) -> None:  # fmt: skip
        """``first``: the model loaded at start; ``reload``: how to load it again once unloaded (None: it stays)."""
        self.entries = [PoolEntry(first.names, reload, first, max_model_len=first.max_model_len)]
        self.entries += [PoolEntry(spec.names, spec, max_model_len=spec.max_model_len) for spec in lazy]
        self._make = make
        self.keep_alive_s = keep_alive_s
        self.max_loaded = max_loaded
        self._sweeper: asyncio.Task[None] | None = None
        #: One load at a time: two loads would each count the other against ``--max-loaded-models``.
        self._one_load = asyncio.Lock()
        self._metrics(registry)

    def _metrics(self, registry: CollectorRegistry) -> None:
        loaded = Gauge("smolserve:model_loaded", "1 while the chat model is loaded", ["model"], registry=registry)
        seconds = Gauge("smolserve:model_load_seconds", "How long the model's last load took", ["model"],
                        registry=registry)  # fmt: skip
        self._requests = Counter("smolserve:model_requests", "Requests routed to the model", ["model"],
                                 registry=registry)  # fmt: skip
        for entry in self.entries:
            loaded.labels(entry.names[0]).set_function(lambda e=entry: float(e.model is not None))
            seconds.labels(entry.names[0]).set_function(lambda e=entry: e.load_seconds or 0.0)

    @property
    def first(self) -> ChatModel | None:
        """The first loaded chat model (the first ``--model`` unless it was unloaded); None while none is."""
        return next((e.model for e in self.entries if e.model is not None), None)

    def entry(self, name: str) -> PoolEntry:
        return next(entry for entry in self.entries if name in entry.names)

    def route(self, name: str) -> ChatModel:
        """The loaded model ``name`` names (a served name); ``NotLoaded`` where it is not loaded now."""
        entry = self.entry(name)
        entry.last_used = time.monotonic()
        if entry.model is None:
            raise NotLoaded(entry)
        self._requests.labels(entry.names[0]).inc()
        return entry.model

    async def load(self, entry: PoolEntry) -> ChatModel:
        """``entry``'s model, loading it first if need be (one load however many wait for it)."""
        if entry.model is not None:
            return entry.model
        if entry.spec is None:
            raise APIError(503, f"The model `{entry.names[0]}` cannot be loaded again here.", code="model_unloaded")
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
            entry.loading.add_done_callback(lambda _: setattr(entry, "loading", None))
        return await asyncio.shield(entry.loading)

    async def _load(self, entry: PoolEntry) -> ChatModel:
        async with self._one_load:
            return await self._load_now(entry)

    async def _load_now(self, entry: PoolEntry) -> ChatModel:
        assert entry.spec is not None
        await self._make_room(entry)
        started = time.perf_counter()
        log.info("loading %s from %s", entry.names[0], entry.spec.source)
        try:
            served = await _on_own_thread(entry.spec.build)
        except Exception as exc:  # any failure of a build is this model's, never the server's
            log.warning("loading %s failed: %s", entry.names[0], exc)
            raise APIError(500, f"The model `{entry.names[0]}` failed to load: {exc}", param="model",
                           code="model_load_failed") from None  # fmt: skip
        model = self._make(served, entry.names)
        await model.backend.start()
        entry.model, entry.max_model_len = model, model.max_model_len
        entry.load_seconds, entry.last_used = time.perf_counter() - started, time.monotonic()
        log.info("loaded %s in %.1f s", entry.names[0], entry.load_seconds)
        return model

    async def _make_room(self, entry: PoolEntry) -> None:
        """Under ``--max-loaded-models``: unload the least recently used idle model, waiting for one to fall idle."""
        if self.max_loaded is None:
            return
        deadline = time.monotonic() + LOAD_WAIT_S
        while sum(e.model is not None for e in self.entries) >= self.max_loaded:
            idle = [e for e in self.entries if e.idle and e.spec is not None]
            if idle:
                await self.unload(min(idle, key=lambda e: e.last_used))
                continue
            if time.monotonic() > deadline:
                raise APIError(503, f"{self.max_loaded} models are loaded and busy (--max-loaded-models); "
                               f"`{entry.names[0]}` cannot be loaded now.", code="models_busy",
                               headers={"Retry-After": "5"})  # fmt: skip
            await asyncio.sleep(0.2)

    async def unload(self, entry: PoolEntry) -> bool:
        """Unload ``entry``'s model (its scheduler stopped, its weights and KV pool handed back); False where it
        is not loaded, or cannot be loaded again."""
        model = entry.model
        if model is None or entry.spec is None:
            return False
        entry.model = None
        await model.backend.stop()
        del model
        await asyncio.to_thread(_hand_back)
        log.info("unloaded %s", entry.names[0])
        return True

    async def start(self) -> None:
        await self.entries[0].model.backend.start()  # type: ignore[union-attr]  # loaded at start
        if len(self.entries) > 1:  # a request's keep_alive may unload a model even where --keep-alive never does
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for entry in self.entries:
            if entry.loading is not None:
                with contextlib.suppress(Exception):
                    await entry.loading
            if entry.model is not None:
                await entry.model.backend.stop()

    async def _sweep(self) -> None:
        """Unload the models idle for ``--keep-alive`` seconds; a model still busy counts as used now."""
        while True:
            await asyncio.sleep(SWEEP_S if self.keep_alive_s < 0 else min(SWEEP_S, max(self.keep_alive_s, 0.1)))
            now = time.monotonic()
            for entry in self.entries:
                if entry.model is not None and not entry.model.backend.is_idle:
                    entry.last_used = now
                elif entry.idle and 0 <= self.kept_for(entry) <= now - entry.last_used:
                    await self.unload(entry)

    def kept_for(self, entry: PoolEntry) -> float:
        """Seconds ``entry``'s model stays loaded once idle (negative: for good)."""
        return self.keep_alive_s if entry.keep_alive_s is None else entry.keep_alive_s

    def card(self, name: str) -> dict[str, Any]:
        """What ``/v1/models`` adds for the chat model ``name`` (llama.cpp's router shape): its status, and its
        context length where known."""
        found = next((e for e in self.entries if name in e.names), None)
        if found is None:  # the embedding model's name
            return {}
        return {"status": {"value": found.status}, "max_model_len": found.max_model_len}

    @property
    def loaded(self) -> list[ChatModel]:
        return [e.model for e in self.entries if e.model is not None]


def _hand_back() -> None:
    """Return a dropped model's memory: its cycles collected, the heap's free pages given back."""
    gc.collect()
    trim_heap()


async def _on_own_thread(build: Callable[[], T]) -> T:
    """``build()`` on a new thread that ends when it returns (a pool's thread would keep its torch team), at the
    lowest CPU priority (the threads it starts, its torch team among them, inherit it): a load takes the cores the
    loaded models' steps leave."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            with contextlib.suppress(OSError):  # the lowest priority: the engine thread's steps come first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICENESS)
            result = build()
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="model-load", daemon=True).start()
    return await done
