"""Web pages kept out: a site the user visits must not be able to drive a server on the user's own machine.

A page can reach ``127.0.0.1`` in two ways that CORS does not stop, since neither needs a preflight:

- **A simple cross-site request**: a form post or a ``fetch`` whose body is ``text/plain``, a form, multipart or
  untyped. Browsers send ``Origin`` on every cross-origin POST, so a request whose ``Origin`` is not this server's
  own nor one of ``--cors-origins`` is refused (403), and a body is read only with a JSON content type (415
  otherwise; ``multipart/form-data`` only on the routes that take uploads). SDKs, curl and agents send no
  ``Origin`` and a JSON content type, so they are not affected.
- **DNS rebinding**: a name of the attacker's resolving to 127.0.0.1, which makes the page same-origin with the
  server. Its requests carry that name in ``Host``: while the server is bound to a loopback address, a ``Host``
  that is not a loopback name (``localhost``, ``*.localhost``, ``127.x.x.x``, ``[::1]``) nor one of
  ``--allowed-hosts`` is refused (421).

Torch-free."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.server.middleware import refusal

#: The addresses whose binding turns the ``Host`` check on (``--host``): only the machine itself can connect.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: Routes whose bodies are uploads (multipart), not JSON; streamed to the route with a limit of their own
#: (``app/server/app.py``, ``--max-file-bytes``).
MULTIPART_PATHS = frozenset({"/v1/files"})
_BODY_METHODS = ("POST", "PUT", "PATCH")


def is_loopback(host: str) -> bool:
    """Whether a name or address only this machine can reach: ``localhost``, ``*.localhost`` (RFC 6761),
    127.0.0.0/8, ``::1``."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a ``Host`` header, without its port (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class BrowserGuardMiddleware:
    """Refuses what only a web page would send: a foreign ``Origin`` (403), a body that is not JSON (415), and,
    with ``allowed_hosts`` set, a ``Host`` outside it (421). ``allowed_hosts`` None: any ``Host`` (the server is
    bound to an address other machines reach; their names are the operator's to know)."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None, origins: Iterable[str] = ()) -> None:
        self.app = app
        self._hosts = None if allowed_hosts is None else {name.lower() for name in allowed_hosts}
        self._origins = set(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope, Headers(scope=scope))
            if refused is not None:
                status, message, code = refused
                await refusal(scope["path"], status, message, code, {"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str, str] | None:
        host = host_name(headers.get("host", ""))
        if self._hosts is not None and not (is_loopback(host) or host.lower() in self._hosts):
            return 421, f"Host {host!r} is not a name of this server (--allowed-hosts adds names)", "host_not_allowed"
        origin = headers.get("origin")
        if origin is not None and not self._is_allowed_origin(origin, headers.get("host", "")):
            return 403, f"requests from the web origin {origin!r} are refused (--cors-origins allows origins)", \
                "origin_not_allowed"  # fmt: skip
        if scope["method"] in _BODY_METHODS:
            return _content_type_refusal(scope["path"], headers)
        return None

    def _is_allowed_origin(self, origin: str, host: str) -> bool:
        if "*" in self._origins or origin in self._origins:
            return True
        return origin.split("://", 1)[-1] == host  # the server's own pages (same origin)


def _content_type_refusal(path: str, headers: Headers) -> tuple[int, str, str] | None:
    """A 415 for a body that is not JSON (multipart on upload routes); a request with no body needs no type."""
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if path in MULTIPART_PATHS:
        if media == "multipart/form-data":
            return None
        return 415, "a file is uploaded as multipart/form-data", "unsupported_media_type"
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    if not media and headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers:
        return None
    said = f"Content-Type {media!r}" if media else "no Content-Type"
    return 415, f"the request body has {said}; send it as JSON with `Content-Type: application/json`", \
        "unsupported_media_type"  # fmt: skip
