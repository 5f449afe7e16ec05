"""Errors in Anthropic's envelope: ``{"type": "error", "error": {"type", "message"}}``, the type by HTTP status as
Anthropic's API names them. The server's errors are ``APIError``s (``app/wire/openai/errors.py``); a route of the
Messages API answers them in this shape."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

#: The routes that answer in this envelope.
PREFIX = "/v1/messages"


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
