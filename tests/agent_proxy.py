"""A recording proxy on loopback between a coding agent and a server: every request's path and body and every
answer's status and text, in order. The agent tests assert on what the server saw and answered (calls made, their
results sent back), and ``record_agent`` writes an agent's first request as a fixture."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from compat.conftest import free_port

#: Headers that belong to one hop, not to the request.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@dataclass(slots=True)
class Exchange:
    method: str
    path: str
    body: Any  # the JSON body, or None
    status: int = 0
    text: str = ""  # the answer's body (a stream's events, joined)


@dataclass
class RecordingProxy:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    base: str = ""
    _server: uvicorn.Server | None = None

    def __enter__(self) -> RecordingProxy:
        port = free_port()
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE", "HEAD"])])
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        threading.Thread(target=self._server.run, daemon=True).start()
        while not self._server.started:
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.should_exit = True

    async def _forward(self, request: Request) -> StreamingResponse:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        exchange = Exchange(request.method, request.url.path, body)
        self.exchanges.append(exchange)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        client = httpx.AsyncClient(timeout=None)
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream = await client.send(client.build_request(request.method, url, headers=headers, content=raw),
                                     stream=True)  # fmt: skip
        exchange.status = upstream.status_code

        async def relay() -> Any:
            try:
                async for chunk in upstream.aiter_raw():
                    exchange.text += chunk.decode(errors="replace")
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()

        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=kept)

    def generations(self) -> list[Exchange]:
        """The exchanges that ran the model (chat, responses, messages)."""
        kinds = ("/chat/completions", "/responses", "/messages")
        return [e for e in self.exchanges if e.method == "POST" and e.path.endswith(kinds)]
