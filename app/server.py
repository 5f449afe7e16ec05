"""The Starlette application: OpenAI-compatible routes over the scheduler. Torch-free."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import protocol
from app.errors import (
    APIError,
    bad_request,
    error_body,
    handle_api_error,
    handle_http_exception,
    handle_unexpected,
)
from app.metrics import Metrics
from app.middleware import APIKeyMiddleware, RequestIdMiddleware
from engine.chooser import ServedModel
from engine.scheduler import Delta, EngineError, QueueFullError, RequestStream, Scheduler
from engine.types import GenerationRequest

# Streams end when their generation ends, also at shutdown: app/serve.py drains them before the server stops.
AppStatus.disable_automatic_graceful_drain()


@dataclass(slots=True, frozen=True)
class ServerConfig:
    #: The name clients must send as ``model``; ``None`` uses the model's own name.
    served_model_name: str | None = None
    #: Requests allowed to wait for a batch slot before new ones get 429.
    max_queue: int = 256
    #: When set, ``Authorization: Bearer <key>`` is required on /v1/* and /tokenize, /detokenize.
    api_key: str | None = None
    #: Origins allowed by CORS; empty means no CORS headers.
    cors_origins: tuple[str, ...] = ()


class _State:
    """Everything the routes share, built once per app."""

    def __init__(self, served: ServedModel, config: ServerConfig) -> None:
        self.model_name = config.served_model_name or served.name
        self.tokenizer = served.tokenizer
        self.max_model_len = served.max_model_len
        self.scheduler = Scheduler(served.engine, served.tokenizer, max_queue=config.max_queue)
        self.metrics = Metrics(lambda: self.scheduler.num_running, lambda: self.scheduler.num_waiting)
        self.created = int(time.time())
        #: Set when shutdown begins: new requests get 503 while in-flight ones finish.
        self.draining = False

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if any(t >= self.tokenizer.vocab_size for t in prompt):
            raise bad_request(
                f"prompt token ids must be below the vocabulary size {self.tokenizer.vocab_size}", "prompt"
            )
        return prompt

    def check_context(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.",
                "max_tokens",
            )

    def submit(self, request: GenerationRequest) -> RequestStream:
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another instance.", code="shutting_down")
        try:
            stream = self.scheduler.submit(request)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        return stream


def create_app(served: ServedModel, config: ServerConfig | None = None) -> Starlette:
    config = config or ServerConfig()
    state = _State(served, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.scheduler.start()
        try:
            yield
        finally:
            await state.scheduler.stop()

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "draining" if state.draining else "ok"})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    async def models(request: Request) -> Response:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "smolserve",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()
        req = protocol.parse_completion_request(protocol.parse_json_object(await request.body()))
        state.check_model(req.model)
        prompt_ids = state.prompt_ids(req.prompt)
        state.check_context(len(prompt_ids), req.max_tokens)
        stream = state.submit(GenerationRequest(tuple(prompt_ids), req.max_tokens, req.ignore_eos, req.sampling))
        call = _Call(state, request, stream, req, len(prompt_ids), arrived)
        if req.stream:
            # No shutdown handling by sse-starlette: the server drains streams itself (app/serve.py).
            return EventSourceResponse(call.events(), sep="\n")
        return await call.respond()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {
        APIError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
    middleware = [Middleware(RequestIdMiddleware)]
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"], allow_headers=["*"]
            )
        )
    if config.api_key:
        rejected = state.metrics.requests_rejected.labels("invalid_api_key")
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key, on_reject=rejected.inc))
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=middleware, lifespan=lifespan)
    app.state.server = state
    return app


class _Call:
    """One admitted completion request, answered as JSON or as a stream of events."""

    def __init__(
        self,
        state: _State,
        request: Request,
        stream: RequestStream,
        req: protocol.CompletionRequest,
        num_prompt: int,
        arrived: float,
    ) -> None:
        self.state = state
        self.request = request
        self.stream = stream
        self.req = req
        self.num_prompt = num_prompt
        self.arrived = arrived
        self.id = protocol.completion_id()

    def usage(self) -> dict[str, int]:
        self.request.state.usage = (self.num_prompt, self.stream.num_generated)
        return protocol.usage(self.num_prompt, self.stream.num_generated)

    def deltas(self) -> AsyncIterator[Delta]:
        return self.state.metrics.observe(self.stream.deltas(), self.arrived)

    async def respond(self) -> Response:
        """The whole completion as JSON; if the client hangs up first, its sequence leaves the batch."""
        collect = asyncio.ensure_future(self._collect())
        hangup = asyncio.ensure_future(_wait_for_disconnect(self.request))
        try:
            await asyncio.wait({collect, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            if not collect.done():
                collect.cancel()
            self.state.scheduler.abort(self.stream)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(collect.result())

    async def _collect(self) -> dict[str, Any]:
        parts: list[str] = []
        finish_reason = None
        try:
            async for delta in self.deltas():
                parts.append(delta.text)
                finish_reason = delta.finish_reason
        except EngineError as exc:
            raise APIError(500, str(exc), code="engine_error") from None
        return protocol.completion_response(self.id, self.state.model_name, "".join(parts), finish_reason, self.usage())

    async def events(self) -> AsyncIterator[str]:
        model, include_usage = self.state.model_name, self.req.include_usage
        try:
            async for delta in self.deltas():
                if delta.text or delta.finish_reason is not None:
                    choice = protocol.chunk_choice(delta.text, delta.finish_reason)
                    yield protocol.completion_chunk(self.id, model, [choice], include_usage=include_usage)
            usage = self.usage()
            if include_usage:
                yield protocol.completion_chunk(self.id, model, [], include_usage=True, usage_=usage)
        except EngineError as exc:
            yield json.dumps(error_body(500, str(exc), code="engine_error"))
        finally:
            # The client may have left mid-stream: the sequence leaves the batch at the next step.
            self.state.scheduler.abort(self.stream)
        yield "[DONE]"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
