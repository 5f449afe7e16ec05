"""The continuous batching scheduler: pure asyncio over the engine seam, torch-free.

One loop task owns the engine. Each iteration it waits for work, admits from the head of the waiting queue (FIFO
within a request's ``priority``, lower values first) while the engine has room, runs one step on the engine's own
worker thread (so HTTP stays responsive during a forward) after dropping aborted sequences, and hands each request
the tokens it produced. Requests resolve independently: a sequence leaves in the step that finishes it, and
newcomers join between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.core.config import IDLE_RELEASE_S, MAX_QUEUE
from engine.core.seam import InferenceEngine
from engine.core.stop import StopMatcher
from engine.core.streams import EngineError, RequestStream
from engine.core.tokenizer import Tokenizer
from engine.core.types import GenerationRequest, StepOutput

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class Scheduler:
    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Tokenizer,
        *,
        max_queue: int = MAX_QUEUE,
        engine_thread: ThreadPoolExecutor | None = None,
        idle_release_s: float | None = IDLE_RELEASE_S,
    ) -> None:
        """``engine_thread``: a one-worker executor to step the engine on (the one it was built on); by
        default the scheduler starts its own. ``idle_release_s``: how long the engine may sit idle before it
        is asked to hand back the memory it keeps for reuse (None: never)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.idle_release_s = idle_release_s
        self._waiting: deque[RequestStream] = deque()
        self._running: dict[int, RequestStream] = {}
        self._pending_aborts: list[int] = []
        self._wakeup = asyncio.Event()
        self._owns_executor = engine_thread is None
        self._executor = engine_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._task: asyncio.Task[None] | None = None
        #: Called on the event loop after every step with its duration in seconds and the sequences it ran.
        self.on_step: Callable[[float, int], None] | None = None
        #: How long the last step took, in seconds (0 before the first).
        self.last_step_s = 0.0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_priority_below(self, priority: int) -> bool:
        """Whether a request of a lower ``priority`` value than this waits or runs."""
        return any(s.request.priority < priority for s in (*self._waiting, *self._running.values()))

    @property
    def is_idle(self) -> bool:
        return not (self._waiting or self._running)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    def submit(
        self, request: GenerationRequest, stop: tuple[str, ...] = (), include_stop: bool = False
    ) -> RequestStream:
        """Queue a request; ``stop`` strings end it (cut from its text unless ``include_stop``)."""
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        stream = RequestStream(request, self.tokenizer, StopMatcher(stop, include_stop) if stop else None)
        # After every waiting request of its priority or a lower value: FIFO within a priority.
        if not self._waiting or self._waiting[-1].request.priority <= request.priority:
            self._waiting.append(stream)
        else:
            later = next(i for i, w in enumerate(self._waiting) if w.request.priority > request.priority)
            self._waiting.insert(later, stream)
        self._wakeup.set()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Withdraw a request (its client left): it leaves the batch at the next step boundary."""
        if stream.finished:
            return
        stream.finished = True
        if stream.seq_id is None:
            self._waiting.remove(stream)
            return
        self._running.pop(stream.seq_id, None)
        self._pending_aborts.append(stream.seq_id)
        self._wakeup.set()

    def fail_all(self, message: str) -> None:
        """End every waiting and running request with an error (shutdown ran out of time)."""
        error = EngineError(message)
        for stream in [*self._waiting, *self._running.values()]:
            self.abort(stream)
            stream._fail(error)

    # -- the loop -------------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_work()
            # Admission runs here, between steps: it is cheap (no forward), and a request is never both
            # in the waiting queue and in the engine, so the queue bound counts only those truly waiting.
            self._admit_waiting()
            aborts, self._pending_aborts = self._pending_aborts, []
            outputs, error, seconds, batch_size = await loop.run_in_executor(self._executor, self._step, aborts)
            self.last_step_s = seconds
            if self.on_step is not None:
                self.on_step(seconds, batch_size)
            if error is not None:
                self._fail_running(error)
            else:
                self._hand_out(outputs)

    async def _wait_for_work(self) -> None:
        """Return once there is something to do; after ``idle_release_s`` of nothing, release idle memory."""
        release_after = self.idle_release_s
        while not (self._waiting or self._running or self._pending_aborts):
            self._wakeup.clear()
            try:  # not asyncio.wait_for: before Python 3.12 it can swallow a cancel that races the wakeup
                async with asyncio.timeout(release_after):
                    await self._wakeup.wait()
            except TimeoutError:
                release_after = None  # once per idle period
                await asyncio.get_running_loop().run_in_executor(self._executor, self._release_idle_memory)

    def _release_idle_memory(self) -> None:
        try:
            self.engine.release_idle_memory()
        except Exception:  # memory kept is not worth the server
            log.exception("the engine failed to release idle memory")

    def _admit_waiting(self) -> None:
        """Admit from the head of the queue while the engine has room (in priority order, FIFO within one: no
        overtaking). A request finding none has the engine park running sequences of a higher ``priority`` value
        (``make_room``): interactive requests never wait behind batch work.

        An idle engine takes the head regardless: a request that cannot fit even then is rejected by
        ``admit`` instead of blocking the queue forever.
        """
        while self._waiting and (self.engine.make_room(self._waiting[0].request) or not self.engine.num_active()):
            stream = self._waiting.popleft()
            try:
                stream.seq_id = self.engine.admit([stream.request])[0]
            except Exception as exc:  # admit is atomic: only this request is affected
                stream._fail(EngineError(f"the request was rejected: {exc}"))
                continue
            self._running[stream.seq_id] = stream

    def _step(self, aborts: list[int]) -> tuple[list[StepOutput], Exception | None, float, int]:
        """On the engine thread: drop aborted sequences, then step once. Also returns the step's duration and
        the sequences it ran."""
        started = time.perf_counter()
        batch_size = 0
        try:
            for seq_id in aborts:
                self.engine.abort(seq_id)
            batch_size = self.engine.num_active()
            return self.engine.step(), None, time.perf_counter() - started, batch_size
        except Exception as exc:
            log.exception("engine step failed; resetting the engine. The step held: %s", self._describe_step())
            self.engine.reset()
            return [], exc, time.perf_counter() - started, batch_size

    def _describe_step(self) -> str:
        try:
            return self.engine.describe_step() or "(the engine does not say)"
        except Exception as exc:  # the description must not hide the failure it describes
            return f"(no description: {type(exc).__name__}: {exc})"

    def _hand_out(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            stream = self._running.get(output.seq_id)
            if stream is None:
                continue  # aborted during the step; its abort is pending
            stopped = stream._push(output)
            if stream.finished:
                del self._running[output.seq_id]
            if stopped and output.finish_reason is None:
                self._pending_aborts.append(output.seq_id)  # still in the engine: it leaves at the next step

    def _fail_running(self, error: Exception) -> None:
        message = f"the engine failed while running this request ({type(error).__name__}: {error})"
        for stream in self._running.values():
            stream._fail(EngineError(message))
        self._running.clear()
        self._pending_aborts.clear()  # the reset dropped every sequence
