"""The seam between the HTTP layer and what runs generations: submit a request, read its deltas, abort it.

``LocalBackend`` drives this process's scheduler and engine. ``cluster.backend.RayBackend`` sends the same calls to
engine replicas on Ray Serve. The routes talk to a ``Backend`` and do not know which one they have. Torch-free.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from app.server.metrics import EngineMetrics
from engine.core.grammar import Grammars
from engine.core.scheduler import Scheduler
from engine.core.streams import Delta
from engine.core.types import GenerationRequest


@dataclass(slots=True, frozen=True)
class Submission:
    """One sequence to run. A grammar travels as its text and is compiled where the sequence runs (each process
    keeps its compiled grammars), so a submission is a plain value that can cross a process boundary."""

    request: GenerationRequest  # its ``constraint`` unset: ``grammar`` makes it
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    grammar: str | None = None
    #: The client's cache key (OpenAI's ``prompt_cache_key``): on a cluster, the replica that took it before.
    cache_key: str | None = None


class Stream(Protocol):
    """A submitted sequence: its deltas as they come."""

    #: What runs it, for the access log: a replica's name, or None in one process.
    replica: str | None

    def deltas(self) -> AsyncIterator[Delta]: ...


class Backend(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def submit(self, submission: Submission) -> Stream:
        """Queue a sequence. Raises ``QueueFullError`` when nothing can take it now (the client gets 429)."""
        ...

    def abort(self, stream: Stream) -> None:
        """Withdraw a sequence whose client left; its memory is freed at the next step."""
        ...

    @property
    def is_idle(self) -> bool:
        """Nothing running or waiting: a drain may stop the server."""
        ...

    def fail_all(self, message: str) -> None:
        """End everything in flight with an error (the drain ran out of time)."""
        ...

    def has_priority_below(self, priority: int) -> bool:
        """Whether a sequence of a lower ``priority`` value than this waits or runs (batches yield to it)."""
        ...

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Add the engine-side series (batch, steps, KV memory) to the app's registry."""
        ...

    async def health(self) -> dict[str, Any]:
        """What ``/health`` adds to its status."""
        ...


class LocalBackend:
    """The scheduler and engine of this process."""

    def __init__(self, scheduler: Scheduler, grammars: Grammars) -> None:
        self.scheduler = scheduler
        self._grammars = grammars

    async def start(self) -> None:
        await self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()
        await asyncio.to_thread(self.scheduler.engine.close)  # what it writes to disk, written

    async def submit(self, submission: Submission) -> Stream:
        return self.submit_now(submission)

    def submit_now(self, submission: Submission) -> Stream:
        request = submission.request
        if submission.grammar is not None:  # compiled already by the route: a copy of the cached matcher
            request = dataclasses.replace(request, constraint=self._grammars.matcher(submission.grammar))
        return self.scheduler.submit(request, submission.stop, submission.include_stop)

    def abort(self, stream: Stream) -> None:
        self.scheduler.abort(stream)  # type: ignore[arg-type]  # a RequestStream: this backend made it

    @property
    def is_idle(self) -> bool:
        return self.scheduler.is_idle

    def fail_all(self, message: str) -> None:
        self.scheduler.fail_all(message)

    def has_priority_below(self, priority: int) -> bool:
        return self.scheduler.has_priority_below(priority)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        scheduler = self.scheduler
        metrics = EngineMetrics(
            registry,
            lambda: scheduler.num_running,
            lambda: scheduler.num_waiting,
            scheduler.engine.memory_stats,
            scheduler.engine.runtime_info,
        )
        scheduler.on_step = metrics.observe_step

    async def health(self) -> dict[str, Any]:
        info = self.scheduler.engine.runtime_info()
        return {"engine": info} if info else {}
