"""``RayBackend``: the app's ``Backend`` over the engine deployment's handle, in the ingress replica.

``submit`` opens a streaming call (the router picks the replica) and waits for the replica's ``Accepted``, so that
a full cluster is a 429 before any response starts; a call that fails before it is accepted (its replica just
died) is retried on another. A replica dying mid-stream ends the stream with an ``EngineError`` (the app sends the
500 envelope, or an SSE error event and ``[DONE]``); ``abort`` cancels the call, which aborts the sequence on its
replica. Every replica's metrics, labelled ``replica="..."``, come from the ``ReplicaReports`` actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.services.backend import Stream, Submission
from cluster.replica import REPORT_INTERVAL_S, Accepted, Failed, Rejected
from engine.core.scheduler import QueueFullError
from engine.core.streams import Delta, EngineError

log = logging.getLogger(__name__)

#: Tries for a sequence whose call fails before a replica accepts it (that replica died as it was chosen).
SUBMIT_ATTEMPTS = 3


class RemoteStream:
    """One sequence's streaming call to its replica; in the backend's in-flight set until it ends or is cancelled."""

    def __init__(self, call: DeploymentResponseGenerator, replica: str, in_flight: set[RemoteStream],
                 priority: int = 0) -> None:  # fmt: skip
        self.replica: str | None = replica
        self.priority = priority
        self.finished = False
        self._call = call
        self._in_flight = in_flight
        self._ended_by: str | None = None  # why this side cancelled it, for whoever is still reading
        in_flight.add(self)

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async for item in self._call:
                if isinstance(item, Failed):
                    raise EngineError(item.message)
                yield item
                if item.finish_reason is not None:
                    self._end()
                    return
        except asyncio.CancelledError:
            if self._ended_by is None:
                raise  # the reader itself was cancelled
            raise EngineError(self._ended_by) from None
        except Exception as exc:  # the replica died (RayActorError), or the call was cancelled here
            if isinstance(exc, EngineError):
                raise
            message = self._ended_by or f"the replica serving this request failed ({type(exc).__name__})"
            raise EngineError(message) from exc
        raise EngineError("the replica ended the stream early")

    def cancel(self, reason: str = "the request was withdrawn") -> None:
        """Cancel the call (its replica aborts the sequence); a reader still waiting gets ``reason``."""
        if self.finished:
            return
        self._end()
        self._ended_by = reason
        self._call.cancel()

    def _end(self) -> None:
        self.finished = True
        self._in_flight.discard(self)


class RayBackend:
    def __init__(self, engine: DeploymentHandle, reports: Any, max_queue: int) -> None:
        self._engine = engine.options(stream=True)
        self._reports = reports
        self._max_queue = max_queue
        self._streams: set[RemoteStream] = set()
        self._snapshot: dict[str, bytes] = {}
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_reports())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def submit(self, submission: Submission) -> Stream:
        for attempt in range(SUBMIT_ATTEMPTS):
            call = self._engine.generate.remote(submission)
            try:
                first = await call.__anext__()
            except BackPressureError:
                raise QueueFullError(f"every replica's queue is full ({self._max_queue} requests each)") from None
            except RayError as exc:
                log.warning("a replica failed before accepting a request (%s); attempt %d", exc, attempt + 1)
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            except BaseException:
                call.cancel()
                raise
            if isinstance(first, Rejected):
                raise QueueFullError(first.message)
            assert isinstance(first, Accepted), f"a replica answered {first!r}"
            return RemoteStream(call, first.replica, self._streams, submission.request.priority)
        raise EngineError("no replica could take the request (they are failing); retry later")

    def abort(self, stream: Stream) -> None:
        assert isinstance(stream, RemoteStream), "a stream this backend made"
        stream.cancel()

    @property
    def is_idle(self) -> bool:
        return not self._streams

    def fail_all(self, message: str) -> None:
        for stream in list(self._streams):
            stream.cancel(message)

    def has_priority_below(self, priority: int) -> bool:
        """Read from this ingress's own streams: every sequence of the cluster goes through it."""
        return any(stream.priority < priority for stream in self._streams)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_ReplicaCollector(lambda: self._snapshot))

    async def health(self) -> dict[str, Any]:
        return {"replicas": {"live": len(self._snapshot), "names": sorted(self._snapshot)}}

    async def _poll_reports(self) -> None:
        while True:
            with contextlib.suppress(RayError):
                self._snapshot = await self._reports.snapshot.remote()
            await asyncio.sleep(REPORT_INTERVAL_S)


class _ReplicaCollector(Collector):
    """Every replica's last report, each sample labelled with its replica; a family per name across replicas."""

    def __init__(self, snapshot: Any) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self._snapshot().items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    labels = {**sample.labels, "replica": replica}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from families.values()
