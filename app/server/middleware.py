"""ASGI middleware: request ids with a one-line access log, and API-key authentication."""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.wire.anthropic import errors as anthropic_errors
from app.wire.openai.errors import error_body

access_log = logging.getLogger("smolserve.access")

#: The only paths open without the API key when one is set: liveness and readiness probes, and Prometheus scrapers.
#: Every other path, a route added later included, needs the key (``tests/test_auth.py`` walks the route table).
OPEN_PATHS = frozenset({"/health", "/metrics"})


#: A client's ``X-Request-Id`` kept as it is: printable, no blanks or quotes, so it cannot forge fields or lines of
#: the access log; any other is replaced by one of ours.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


class RequestIdMiddleware:
    """Echoes ``X-Request-Id`` (or makes one up, also for one that is not a plain token) and logs one line per
    request when its response ends.

    Routes put token counts in ``scope["state"]["usage"]`` (prompt, completion, cached prompt, drafted tokens
    accepted by speculative decoding) for the log line.
    """

    def __init__(self, app: ASGIApp, on_response: Callable[[str, int], None] = lambda path, status: None) -> None:
        """``on_response(path, status)`` is told of every response (metrics)."""
        self.app = app
        self._on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._on_response(scope["path"], status)
            prompt, completion, cached, accepted = scope["state"].get("usage", (0, 0, 0, 0))
            replica = scope["state"].get("replica")
            access_log.info(
                '%s "%s %s" %d prompt_tokens=%d cached_prompt_tokens=%d completion_tokens=%d accepted_tokens=%d '
                "latency=%.3fs%s",
                request_id,
                scope["method"],
                json.dumps(scope["path"])[1:-1],  # quotes, control and non-ASCII characters escaped: one line
                status,
                prompt,
                cached,
                completion,
                accepted,
                time.perf_counter() - started,
                f" replica={replica}" if replica else "",
            )


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key``) on every path but ``OPEN_PATHS``; a 401 in the
    path's API's envelope otherwise, before the body is read."""

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[], None]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            given = headers.get("authorization", "").encode()
            if "x-api-key" in headers:  # Anthropic's SDKs send the key so
                given = f"Bearer {headers['x-api-key']}".encode()
            if not hmac.compare_digest(given, self._expected):
                await self._reject(scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _reject(self, scope: Scope) -> JSONResponse:
        self._on_reject()
        message = "Incorrect or missing API key. Send `Authorization: Bearer <key>`."
        if scope["path"].startswith(anthropic_errors.PREFIX):
            message = "invalid x-api-key"
        return refusal(scope["path"], 401, message, "invalid_api_key")


def refusal(path: str, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error a middleware answers before any route runs, in the envelope of the API ``path`` belongs to
    (Anthropic's on the Messages API, OpenAI's with ``code`` elsewhere)."""
    if path.startswith(anthropic_errors.PREFIX):
        return JSONResponse(anthropic_errors.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)
