"""The Starlette application: the routes (``app/server/routes.py``) over the server state (``app/server/state.py``),
with its middleware, error handlers and lifespan. Torch-free."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from app.pipeline.chat_model import Model
from app.server.browser_guard import MULTIPART_PATHS, BrowserGuardMiddleware
from app.server.handlers import HANDLERS
from app.server.limits import BodyLimitMiddleware
from app.server.middleware import APIKeyMiddleware, RequestIdMiddleware
from app.server.routes import ROUTES
from app.server.state import ServerConfig, ServerState
from app.services.backend import Backend
from app.services.model_pool import LazyModel

# Streams end when their generation ends, also at shutdown: app/server/serve.py drains them before the server stops.
AppStatus.disable_automatic_graceful_drain()


def create_app(model: Model, config: ServerConfig | None = None, backend: Backend | None = None,
               lazy: Sequence[LazyModel] = (), reload: LazyModel | None = None) -> Starlette:  # fmt: skip
    """The app over ``backend``; by default over a scheduler of its own driving ``model``'s engine. ``lazy``: more
    chat models, loaded when first asked for; ``reload``: how to load ``model`` again once it was unloaded."""
    config = config or ServerConfig()
    state = ServerState(model, config, backend, lazy, reload)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = Starlette(
        routes=ROUTES, exception_handlers=HANDLERS, middleware=_middleware(state, config), lifespan=lifespan
    )
    app.state.server = state
    state.app = app
    return app


def _middleware(state: ServerState, config: ServerConfig) -> list[Middleware]:
    """Request ids outermost; then CORS where configured (it answers preflights), the API key, the browser guard
    (web pages kept out); innermost the body-size limit, so that a client refused is refused before its body is
    read."""
    middleware = [Middleware(RequestIdMiddleware, on_response=state.metrics.observe_response)]
    if config.cors_origins:
        origins = list(config.cors_origins)
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"]))
    if config.api_key:
        rejected = state.metrics.requests_rejected.labels("invalid_api_key")
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key, on_reject=rejected.inc))
    middleware.append(Middleware(BrowserGuardMiddleware, allowed_hosts=config.allowed_hosts,
                                 origins=config.cors_origins))  # fmt: skip
    too_large = state.metrics.requests_rejected.labels("request_too_large")
    limit = config.limits.max_request_bytes
    uploads = dict.fromkeys(MULTIPART_PATHS, config.max_file_bytes)
    middleware.append(Middleware(BodyLimitMiddleware, max_bytes=limit, on_reject=too_large.inc, paths=uploads))
    return middleware
