"""Dynamic batching of embedding inputs, on the engine's thread, between the chat model's steps. Torch-free.

Inputs of concurrent requests wait in one queue; a loop takes them shortest first (so a batch's padding stays
small) up to a token budget (inputs x the longest one's length) and encodes them in one call on the executor the
scheduler steps the chat engine on: one thread, one thread team, and the calls take turns with the steps. While the
chat model is generating, the budget is what the encoder does in about one chat step's time (measured as it runs),
and after each batch the loop leaves the thread to chat for ``YIELD`` times the batch's time before it queues the
next: embeddings get at most 1 / (1 + ``YIELD``) of the thread (0.4 of their alone throughput), and most chat
tokens come one step after the last (measured on AMD Zen 4: chat inter-token p50 3.89x its alone figure when a batch
was queued as soon as the last one ended, every step then waiting behind one); when chat is idle, batches take the
whole budget back to back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from engine.core.encoder import Encoder

log = logging.getLogger(__name__)

#: Tokens (inputs x padded length) of one batch when chat is idle.
IDLE_BUDGET = 8192
#: The least a batch may take while chat runs, so embeddings always progress.
MIN_BUDGET = 128
#: While chat runs, after a batch of ``t`` seconds the thread is left to chat for ``YIELD * t``.
YIELD = 1.5


@dataclass(slots=True)
class _Input:
    ids: list[int]
    future: asyncio.Future[list[float]]


class EmbeddingBatcher:
    def __init__(
        self,
        encoder: Encoder,
        executor: Executor | None,
        chat_step_seconds: Callable[[], float | None] = lambda: None,
        on_batch: Callable[[int, int], None] = lambda inputs, tokens: None,
        clock: Callable[[], float] = time.perf_counter,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``chat_step_seconds()``: how long the chat model's steps take now, None while it has nothing to run;
        ``on_batch(inputs, tokens)`` is told of each batch (metrics); ``clock`` and ``pause`` time a batch and
        leave the thread to chat after it."""
        self.encoder = encoder
        self._executor = executor
        self._chat_step_seconds = chat_step_seconds
        self._on_batch = on_batch
        self._pending: list[_Input] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._tokens_per_second = 20_000.0  # until measured
        self._clock, self._pause = clock, pause

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for item in self._pending:
            item.future.cancel()

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        """Every input's vector, in order, encoded among whatever else is waiting."""
        loop = asyncio.get_running_loop()
        items = [_Input(ids, loop.create_future()) for ids in inputs]
        self._pending += items
        self._wake.set()
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        finally:  # a client that left takes its inputs out of the queue
            self._pending = [item for item in self._pending if not item.future.done() and item not in items]

    def budget(self) -> int:
        step = self._chat_step_seconds()
        if step is None:
            return IDLE_BUDGET
        return max(MIN_BUDGET, min(IDLE_BUDGET, int(step * self._tokens_per_second)))

    def take(self, budget: int) -> list[_Input]:
        """The shortest waiting inputs whose padded batch fits ``budget`` (at least one)."""
        self._pending.sort(key=lambda item: len(item.ids))
        taken: list[_Input] = []
        for item in self._pending:
            if taken and len(item.ids) * (len(taken) + 1) > budget:
                break
            taken.append(item)
        self._pending = self._pending[len(taken) :]
        return taken

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                elapsed = await self._run(loop, self.take(self.budget()))
                if self._chat_step_seconds() is not None:  # chat is generating: its turn on the thread
                    await self._pause(YIELD * elapsed)

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Input]) -> float:
        """Encode ``batch`` on the executor and answer its inputs; the seconds it took."""
        started = self._clock()
        try:
            vectors = await loop.run_in_executor(self._executor, self.encoder.encode, [i.ids for i in batch])
        except Exception as exc:  # a failed batch fails its requests, not the server
            log.exception("embedding batch of %d inputs failed", len(batch))
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return max(self._clock() - started, 0.0)
        elapsed = max(self._clock() - started, 1e-6)
        padded = len(batch) * max(len(item.ids) for item in batch)
        self._tokens_per_second = 0.7 * self._tokens_per_second + 0.3 * padded / elapsed
        self._on_batch(len(batch), sum(len(item.ids) for item in batch))
        for item, vector in zip(batch, vectors, strict=True):
            if not item.future.done():
                item.future.set_result(vector)
        return elapsed
