"""The server's state: what every endpoint's pipeline shares (``app/api/chat_completions.py``, ``completions.py``,
``responses.py``, ``anthropic_messages.py``, ``tokens.py``, ``embeddings.py``): the configuration, the served models,
parsing on worker threads, the metrics, the stored responses, and the answer's last step: queueing, then JSON or an
event stream. Torch-free."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import Gauge
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.pipeline.chat_model import ChatModel, Model, local_backend
from app.pipeline.generation import Generation
from app.server.limits import RequestLimits, check_lists
from app.server.metrics import BatchCollector, Metrics
from app.services.backend import Backend
from app.services.batch_runner import BATCH_HEADER, BATCH_PRIORITY, NO_BATCHES, BatchRunner
from app.services.embedder import MAX_INPUTS, EmbeddingService
from app.services.model_pool import KEEP_ALIVE_S, LazyModel, ModelPool, NotLoaded
from app.services.served_models import ModelRegistry, ServedEntry
from app.stores.batch_store import BatchStore
from app.stores.file_store import DATABASE, MAX_DATA_BYTES, MAX_FILE_BYTES, FileStore, StoreError, default_data_dir
from app.stores.model_aliases import AliasStore
from app.stores.response_store import STORE_BYTES, STORE_SIZE, ResponseStore
from app.stores.upload import UploadGate
from app.wire.openai.errors import APIError
from app.wire.openai.request import parse_json_object
from engine.chooser import ServedModel
from engine.core.config import IDLE_RELEASE_S, MAX_QUEUE
from engine.core.encoder import Encoder
from engine.core.grammar import Grammars
from engine.core.heap import trim_heap
from engine.core.scheduler import QueueFullError

T = TypeVar("T")
log = logging.getLogger(__name__)
#: Uploads received at once, by default.
MAX_UPLOADS = 8
#: Threads that parse, tokenize and render requests off the event loop: as many as the machine's two cores, so a
#: burst of large requests queues here instead of taking the CPU from the engine's steps.
PREPARE_WORKERS = 2
#: How long after the last interactive request ends batches still yield to interactive ones.
HOLD_S = 1.0
#: A body this large has its memory handed back to the OS once its request is prepared.
TRIM_AFTER_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class ServerConfig:
    #: The name clients must send as ``model``; ``None`` uses the model's own name.
    served_model_name: str | None = None
    #: More names the chat model answers to (vLLM's ``--served-model-name a b``).
    model_aliases: tuple[str, ...] = ()
    #: The names of the embedding model; empty: its own name.
    embedding_model_names: tuple[str, ...] = ()
    #: Inputs one embeddings request may carry.
    max_embedding_inputs: int = MAX_INPUTS
    #: Requests allowed to wait for a batch slot before new ones get 429.
    max_queue: int = MAX_QUEUE
    #: Seconds the engine may sit idle before it hands back the KV memory it keeps for the next requests.
    kv_cache_idle_release_s: float = IDLE_RELEASE_S
    #: When set, ``Authorization: Bearer <key>`` is required on every route but /health and /metrics.
    api_key: str | None = None
    #: Origins allowed by CORS; empty means no CORS headers, and a request with a foreign ``Origin`` is refused.
    cors_origins: tuple[str, ...] = ()
    #: The ``Host`` names accepted besides the loopback ones (``app/server/browser_guard.py``); None accepts any (a
    #: server bound to an address other machines reach).
    allowed_hosts: tuple[str, ...] | None = ()
    #: Seconds between SSE comment lines (``: ping``) on a quiet stream; ``None`` sends none, as OpenAI does
    #: (simple ``data:``-only parsers choke on them), but a proxy that cuts idle connections may need them.
    sse_keepalive_s: float | None = None
    #: What one request may ask before admission (``--max-request-bytes`` and list lengths: ``app/server/limits.py``).
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently used leave first).
    responses_store_size: int = STORE_SIZE
    #: What the stored responses may hold together, in bytes (least recently used leave first).
    responses_store_bytes: int = STORE_BYTES
    #: With several chat models: seconds a model may sit idle before it is unloaded (-1: never;
    #: ``app/services/model_pool.py``).
    keep_alive_s: float = KEEP_ALIVE_S
    #: With several chat models: the most loaded at once (None: no bound).
    max_loaded_models: int | None = None
    #: Where uploaded files and their database are kept (``app/stores/file_store.py``); None: the user's data directory.
    data_dir: Path | None = None
    #: The most one uploaded file may hold (413 beyond).
    max_file_bytes: int = MAX_FILE_BYTES
    #: The most all files under ``data_dir`` may hold together (uploads and batch outputs; 507 beyond).
    max_data_bytes: int = MAX_DATA_BYTES
    #: Uploads received at once (429 beyond): each holds a connection and a file being written.
    max_concurrent_uploads: int = MAX_UPLOADS


class ServerState:
    """What the endpoints share, built once per app: the configuration, the served models (the chat model,
    ``app/pipeline/chat_model.py``, and the embedding model beside it), the worker threads that parse and render
    requests, the metrics, the stored responses, and the answer's last step (``respond``). Reached from a request as
    ``request.app.state.server`` (``server_state``)."""

    def __init__(self, model: Model, config: ServerConfig, backend: Backend | None,
                 lazy: Sequence[LazyModel] = (), reload: LazyModel | None = None) -> None:  # fmt: skip
        self.config = config
        self.limits = config.limits
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="prepare")
        self.metrics = Metrics()
        grammars = Grammars(model.tokenizer)
        if backend is None:
            assert isinstance(model, ServedModel), "without a backend the app runs the model's engine itself"
            backend = local_backend(model, grammars, config.max_queue, config.kv_cache_idle_release_s)
        backend.register_metrics(self.metrics.registry)
        names = (config.served_model_name or model.name, *config.model_aliases)
        first = ChatModel(model, names, backend, grammars, self.metrics)
        self.pool = ModelPool(first, list(lazy), self._chat_model_of, config.keep_alive_s, config.max_loaded_models,
                              self.metrics.registry, reload)  # fmt: skip
        self.created = int(time.time())
        self.sse_ping = config.sse_keepalive_s or 0  # sse-starlette: 0 sends no pings
        #: Set when shutdown begins: new requests get 503 while in-flight ones finish.
        self.draining = False
        self.registry, self.embeddings = self._models(model, config)
        self.responses = ResponseStore(config.responses_store_size, config.responses_store_bytes)
        stored = Gauge("smolserve:responses_stored", "Responses kept for previous_response_id and retrieval",
                       registry=self.metrics.registry)  # fmt: skip
        stored.set_function(lambda: len(self.responses))
        self.metrics.registry.register(BatchCollector(self.batch_report))
        self._files: FileStore | None = None
        self._stores_lock = threading.RLock()  # the files and batches stores: one each, opened on first use
        self.uploads = UploadGate(config.max_concurrent_uploads)
        self._interactive_at = 0.0
        self._batches: BatchRunner | None = None
        self._aliases: AliasStore | None = None
        #: The ASGI app serving this state (the batch runner sends its lines through it).
        self.app: Any = None

    @property
    def data_dir(self) -> Path:
        return self.config.data_dir or default_data_dir()

    @property
    def files(self) -> FileStore:
        """The uploaded files, opened on first use (a server nobody uploads to writes nothing to disk), once however
        many first requests come at once; a 503 naming the file where the data directory cannot be used."""
        with self._stores_lock:
            if self._files is None:
                self._files = _opened(lambda: FileStore(self.data_dir, self.config.max_data_bytes))
            return self._files

    @property
    def aliases(self) -> AliasStore:
        """The models made by Ollama's ``/api/create`` and ``/api/copy``, read on first use."""
        with self._stores_lock:
            if self._aliases is None:
                self._aliases = _opened(lambda: AliasStore(self.data_dir))
            return self._aliases

    def interactive(self) -> bool:
        """Whether requests other than batch lines generate now, or did within the last ``HOLD_S`` (one stream of a
        conversation is followed by the next): batches yield to them (``app/services/batch_runner.py``)."""
        now = time.monotonic()
        if any(model.backend.has_priority_below(BATCH_PRIORITY) for model in self.pool.loaded):
            self._interactive_at = now
        return now - self._interactive_at < HOLD_S

    @property
    def batches(self) -> BatchRunner:
        """The Batch API's runner, made on first use (or at start, where a database holds batches)."""
        with self._stores_lock:
            if self._batches is None:
                assert self.app is not None, "create_app sets the app"
                store = _opened(lambda: BatchStore(self.data_dir))
                self._batches = BatchRunner(store, lambda: self.files, self.app, self.config.api_key,
                                            lambda: self.draining, self.interactive)  # fmt: skip
            return self._batches

    def batch_report(self) -> dict[str, Any]:
        """The batch queue (``BatchRunner.report``); a server that has run no batch opens no database for it."""
        return self._batches.report() if self._batches is not None else NO_BATCHES

    @property
    def backend(self) -> Backend | None:
        """The first loaded chat model's backend (a cluster's: its replicas); None while no chat model is loaded."""
        first = self.pool.first
        return first.backend if first is not None else None

    def _chat_model_of(self, served: ServedModel, names: tuple[str, ...]) -> ChatModel:
        """A chat model loaded later: a scheduler of its own, on the engine thread it shares."""
        grammars = Grammars(served.tokenizer)
        backend = local_backend(served, grammars, self.config.max_queue, self.config.kv_cache_idle_release_s)
        return ChatModel(served, names, backend, grammars, self.metrics)

    def _models(self, model: Model, config: ServerConfig) -> tuple[ModelRegistry, EmbeddingService | None]:
        """The served models: the chat models, then the embedding model beside them (run on the engine's thread)."""
        chat = [ServedEntry(entry.names, "generate", entry.max_model_len) for entry in self.pool.entries]
        encoder: Encoder | None = getattr(model, "encoder", None)
        if encoder is None:
            return ModelRegistry(chat, self.created, self.pool.card), None
        entry = ServedEntry(config.embedding_model_names or (encoder.name,), "embed", encoder.max_seq_length)
        scheduler = getattr(self.backend, "scheduler", None)

        def chat_step_seconds() -> float | None:
            return scheduler.last_step_s if scheduler is not None and scheduler.num_running else None

        executor = getattr(model, "engine_thread", None)
        service = EmbeddingService(encoder, entry, executor, self.metrics.registry, chat_step_seconds)
        return ModelRegistry([*chat, entry], self.created, self.pool.card), service

    async def start(self) -> None:
        await self.pool.start()
        if self.embeddings is not None:
            await self.embeddings.batcher.start()
        if (self.data_dir / DATABASE).exists():  # batches a restart interrupted run on
            try:
                await self.batches.start()
            except APIError as exc:  # the server serves on; files and batches answer this until it is mended
                log.error("%s", exc.message)

    async def stop(self) -> None:
        if self._batches is not None:
            await self._batches.stop()
        if self.embeddings is not None:
            await self.embeddings.batcher.stop()
        await self.pool.stop()
        self.workers.shutdown(wait=False)
        if self._files is not None:
            self._files.close()

    def chat_model(self, name: str | None) -> ChatModel:
        """The chat model a generating request names (none named: the first); a 404 or a 400 naming ``model``
        otherwise. ``NotLoaded`` where it is not loaded: ``prepare`` loads it and prepares the request again."""
        return self.pool.route(self.registry.route(name, "generate").name)

    def embedding_model(self, name: str | None) -> EmbeddingService:
        """The embedding model an embeddings request names (or the one, none named)."""
        self.registry.route(name, "embed")
        assert self.embeddings is not None, "the registry routes to an embedding model only when one is served"
        return self.embeddings

    async def prepare(self, work: Callable[[], T], size: int) -> T:
        """Run ``work`` (parsing a body of ``size`` bytes, routing it to its model, tokenizing, rendering a template)
        on the worker pool, so that streams keep flowing while it runs; a model not loaded is loaded and ``work`` run
        again. After a large body, hand the heap's freed memory back."""
        while True:
            try:
                return await self._on_worker(work, size)
            except NotLoaded as exc:
                await self.pool.load(exc.entry)

    async def _on_worker(self, work: Callable[[], T], size: int) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.workers, work)
        finally:
            if size > TRIM_AFTER_BYTES:
                await loop.run_in_executor(self.workers, trim_heap)

    def parse_body(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object whose lists are within the limits (``app/server/limits.py``); else a 400."""
        return parse_json_object(raw, lambda body: check_lists(body, self.limits, self.config.max_queue))

    async def respond(
        self, request: Request, generation: Generation, complete: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        events: Callable[[], AsyncIterator[str]] | None = None, ndjson: bool = False,
    ) -> Response:  # fmt: skip
        """Queue the generation's sequences and answer: a stream of events, or JSON when all are done (the
        endpoint's shapes: ``complete`` and ``events``, the OpenAI ones by default)."""
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another instance.", code="shutting_down")
        if BATCH_HEADER in request.headers:  # a batch's line: after every interactive request
            generation.options = dataclasses.replace(generation.options, priority=BATCH_PRIORITY)
        try:
            await generation.submit()
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
        self.metrics.prompt_tokens.inc(generation.num_prompt_tokens)
        request.state.usage = (generation.num_prompt_tokens, 0, 0, 0)
        request.state.replica = generation.replicas
        if generation.options.stream:
            stream = _logged(request, generation, (events or generation.events)())
            if ndjson:  # Ollama's stream: one JSON object a line
                return StreamingResponse((line + "\n" async for line in stream), media_type="application/x-ndjson")
            return EventSourceResponse(stream, sep="\n", ping=self.sse_ping)
        done = asyncio.ensure_future((complete or generation.complete)())
        hangup = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({done, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            if not done.done():
                done.cancel()
            generation.abort()
        request.state.usage = _usage_for_log(generation)
        if not done.done() or done.cancelled():
            return Response(status_code=499)  # the client left; nobody is listening
        return JSONResponse(done.result())


async def _logged(request: Request, generation: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        request.state.usage = _usage_for_log(generation)


def _usage_for_log(generation: Generation) -> tuple[int, int, int, int]:
    return (
        generation.num_prompt_tokens, generation.num_completion_tokens, generation.num_cached_tokens,
        generation.num_accepted_tokens,
    )  # fmt: skip


def _opened(open_store: Callable[[], T]) -> T:
    """A store of the data directory, or a 503 naming what cannot be used (a corrupt database, an unwritable
    folder): the operator's to mend; the request may be sent again then."""
    try:
        return open_store()
    except StoreError as exc:
        raise APIError(503, str(exc), code="storage_unavailable") from None


def server_state(source: Request | Starlette) -> ServerState:
    """The state of the app serving a request, or of an app."""
    app = source.app if isinstance(source, Request) else source
    return app.state.server


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
