"""The app's exception handlers: every error a client gets is in its API's envelope (OpenAI's,
``app/wire/openai/errors.py``; Anthropic's on the Messages API's routes, ``app/wire/anthropic/errors.py``; Ollama's
``{"error": "..."}`` on ``/api/*``); an API error is counted by its reason, a route that does not exist names itself, an
unexpected error is logged and a 500."""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from app.server.state import server_state
from app.wire.anthropic import errors as anthropic_errors
from app.wire.anthropic.model_list import VERSION_HEADER
from app.wire.openai.errors import APIError, error_body

log = logging.getLogger(__name__)


async def handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    server_state(request).metrics.requests_rejected.labels(exc.reason).inc()
    # A full queue is Anthropic's 529 overloaded_error (its clients retry it), OpenAI's 429.
    status = 529 if exc.code == "queue_full" and _anthropic(request) else exc.status
    body = _body(request, status, exc.message, exc.body())
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    message = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
    body = _body(request, exc.status_code, message, error_body(exc.status_code, message))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def handle_client_disconnect(request: Request, exc: Exception) -> Response:
    """The client left before we read its whole body: nobody to answer, nothing to log as an error."""
    return Response(status_code=499)


async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(_body(request, 500, "internal server error", error_body(500, "internal server error")), 500)


def _body(request: Request, status: int, message: str, openai: dict[str, Any]) -> dict[str, Any]:
    """The error in the envelope of the API the route belongs to."""
    if _anthropic(request):
        return anthropic_errors.error_body(status, message)
    if request.url.path.startswith("/api/"):  # Ollama's envelope
        return {"error": message}
    return openai


def _anthropic(request: Request) -> bool:
    """The Messages API's routes, and the models' list asked for by the Anthropic API's clients."""
    path = request.url.path
    models = path.startswith("/v1/models") and VERSION_HEADER in request.headers
    return path.startswith(anthropic_errors.PREFIX) or models


HANDLERS: dict[Any, Any] = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    ClientDisconnect: handle_client_disconnect,
    Exception: handle_unexpected,
}
