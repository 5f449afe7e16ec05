"""An engine replica: one engine and its scheduler in a Ray Serve replica, answering ``generate`` as a stream.

``generate`` yields an ``Accepted`` (naming this replica) once its scheduler has queued the sequence, or a
``Rejected`` when its queue is full, then the sequence's ``Delta``s; an engine failure arrives as ``Failed``. A
cancelled call (the client left) aborts the sequence here. Every second the replica reports its metrics to the
``ReplicaReports`` actor, where the ingress reads every replica's series for ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray
from prometheus_client import CollectorRegistry, generate_latest
from ray import serve

from app.pipeline.chat_model import local_backend
from app.server.state import ServerConfig
from app.services.backend import Submission
from engine import chooser
from engine.core.config import EngineConfig
from engine.core.grammar import Grammars
from engine.core.scheduler import QueueFullError
from engine.core.streams import Delta, EngineError
from engine.core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0
#: A replica whose last report is older than this counts as gone.
REPORT_TTL_S = 5.0


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the ingress needs to know of the model (``app.pipeline.chat_model.Model``); the tokenizer travels whole."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int


@dataclass(slots=True, frozen=True)
class Accepted:
    replica: str


@dataclass(slots=True, frozen=True)
class Rejected:
    message: str


@dataclass(slots=True, frozen=True)
class Failed:
    message: str


@ray.remote(num_cpus=0)
class ReplicaReports:
    """The latest metrics of every replica, by replica name."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, bytes]] = {}

    def report(self, replica: str, metrics: bytes) -> None:
        self._reports[replica] = (time.monotonic(), metrics)

    def snapshot(self) -> dict[str, bytes]:
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < REPORT_TTL_S}
        return {replica: metrics for replica, (_, metrics) in self._reports.items()}


def reports_actor(name: str) -> ray.actor.ActorHandle:
    """The reports actor of the application ``name``, made by whoever asks first. Detached, so that it outlives
    the replica that happened to create it; the launcher removes it at shutdown."""
    return ReplicaReports.options(  # type: ignore[attr-defined]
        name=f"smolserve-reports-{name}", namespace="smolserve", get_if_exists=True, lifetime="detached"
    ).remote()


def configure_logging(level: str) -> None:
    """Our loggers in a replica's process (the access log among them): to stderr, which Ray forwards to the
    launcher's output prefixed with the replica."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")


class EngineReplica:
    async def __init__(
        self, engine_config: EngineConfig, server_config: ServerConfig, app_name: str, log_level: str
    ) -> None:
        configure_logging(log_level)
        served = await asyncio.to_thread(chooser.build, engine_config)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.info = ModelInfo(served.name, served.tokenizer, served.max_model_len)
        self.backend = local_backend(served, Grammars(served.tokenizer), server_config.max_queue,
                                     server_config.kv_cache_idle_release_s)  # fmt: skip
        self.registry = CollectorRegistry()
        self.backend.register_metrics(self.registry)
        await self.backend.start()
        self._reports = reports_actor(app_name)
        self._reporter = asyncio.create_task(self._report_forever())
        log.info("replica %s serves %s", self.name, served.name)

    async def model_info(self) -> ModelInfo:
        return self.info

    async def generate(self, submission: Submission) -> AsyncIterator[Accepted | Rejected | Failed | Delta]:
        try:
            stream = self.backend.submit_now(submission)
        except QueueFullError as exc:
            yield Rejected(str(exc))
            return
        yield Accepted(self.name)
        try:
            async for delta in stream.deltas():
                yield delta
        except EngineError as exc:
            yield Failed(str(exc))
        finally:  # finished: nothing to do; cancelled (the client left): the sequence leaves the batch
            self.backend.abort(stream)

    async def _report_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the reports actor restarting must not stop the replica
                await self._reports.report.remote(self.name, generate_latest(self.registry))
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def __del__(self) -> None:
        self._reporter.cancel()
        await self.backend.stop()
