"""Run the app under uvicorn with a graceful shutdown.

On SIGTERM or SIGINT the server stops admitting (new requests get 503), lets in-flight requests finish for
up to ``shutdown_timeout`` seconds, ends the rest with an error (streams get an error event and
``[DONE]``), then stops uvicorn and exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

from app.server.state import ServerState, server_state

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state = server_state(app)
        self._shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Replaces uvicorn's handlers, which stop at once and re-raise the signal (exit status 143).
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            log.info("%s: draining (up to %.0f s), then exiting", sig.name, self._shutdown_timeout)
            self._drain_task = asyncio.create_task(self._drain())
        elif sig == signal.SIGINT:
            log.warning("second SIGINT: exiting now")
            self.force_exit = True
            self.should_exit = True

    async def _drain(self) -> None:
        await drain(self._state, self._shutdown_timeout)
        self.should_exit = True


async def drain(state: ServerState, timeout: float) -> None:
    """Stop admitting (503), let in-flight requests finish for up to ``timeout`` s, then end the rest with an
    error."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    busy = lambda: [model.backend for model in state.pool.loaded if not model.backend.is_idle]  # noqa: E731
    while busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if busy():
        log.warning("shutdown timeout: ending the requests still running")
        for backend in busy():
            backend.fail_all("the server shut down before this request finished")
        await asyncio.sleep(0.2)  # let the routes send their errors


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside a process that owns its signals (a Ray Serve replica): it installs no handlers; whoever
    embeds it stops it with ``should_exit``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve(app: Starlette, host: str, port: int, *, shutdown_timeout: float, log_level: str) -> None:
    # uvicorn's own graceful phase only has to close connections the drain has already finished; the app
    # logs each request itself (app/server/middleware.py), with its token counts.
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False
    )
    DrainingServer(config, app, shutdown_timeout).run()
