"""The Starlette application: OpenAI-compatible routes over the scheduler. Torch-free."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
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
from engine.chooser import ServedModel
from engine.scheduler import EngineError, QueueFullError, RequestStream, Scheduler
from engine.types import GenerationRequest


@dataclass(slots=True, frozen=True)
class ServerConfig:
    #: The name clients must send as ``model``; ``None`` uses the model's own name.
    served_model_name: str | None = None
    #: Requests allowed to wait for a batch slot before new ones get 429.
    max_queue: int = 256


class _State:
    """Everything the routes share, built once per app."""

    def __init__(self, served: ServedModel, config: ServerConfig) -> None:
        self.model_name = config.served_model_name or served.name
        self.tokenizer = served.tokenizer
        self.max_model_len = served.max_model_len
        self.scheduler = Scheduler(served.engine, served.tokenizer, max_queue=config.max_queue)
        self.created = int(time.time())

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
        try:
            return self.scheduler.submit(request)
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None


def create_app(served: ServedModel, config: ServerConfig | None = None) -> Starlette:
    state = _State(served, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.scheduler.start()
        try:
            yield
        finally:
            await state.scheduler.stop()

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

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
        req = protocol.parse_completion_request(protocol.parse_json_object(await request.body()))
        state.check_model(req.model)
        prompt_ids = state.prompt_ids(req.prompt)
        state.check_context(len(prompt_ids), req.max_tokens)
        stream = state.submit(GenerationRequest(tuple(prompt_ids), req.max_tokens, req.ignore_eos))
        if req.stream:
            events = _stream_completion(state, stream, req, len(prompt_ids))
            return EventSourceResponse(events, sep="\n")
        return JSONResponse(await _complete(state, stream, len(prompt_ids)))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {
        APIError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.scheduler = state.scheduler
    return app


async def _complete(state: _State, stream: RequestStream, num_prompt: int) -> dict[str, Any]:
    parts: list[str] = []
    finish_reason = None
    try:
        async for delta in stream.deltas():
            parts.append(delta.text)
            finish_reason = delta.finish_reason
    except EngineError as exc:
        raise APIError(500, str(exc), code="engine_error") from None
    finally:
        state.scheduler.abort(stream)
    usage = protocol.usage(num_prompt, stream.num_generated)
    return protocol.completion_response(
        protocol.completion_id(), state.model_name, "".join(parts), finish_reason, usage
    )


async def _stream_completion(
    state: _State, stream: RequestStream, req: protocol.CompletionRequest, num_prompt: int
) -> AsyncIterator[str]:
    request_id = protocol.completion_id()
    try:
        async for delta in stream.deltas():
            if delta.text or delta.finish_reason is not None:
                choice = protocol.chunk_choice(delta.text, delta.finish_reason)
                yield protocol.completion_chunk(request_id, state.model_name, [choice], include_usage=req.include_usage)
        if req.include_usage:
            usage = protocol.usage(num_prompt, stream.num_generated)
            yield protocol.completion_chunk(request_id, state.model_name, [], include_usage=True, usage_=usage)
    except EngineError as exc:
        yield json.dumps(error_body(500, str(exc), code="engine_error"))
    finally:
        # The client may have left mid-stream: the sequence leaves the batch at the next step.
        state.scheduler.abort(stream)
    yield "[DONE]"
