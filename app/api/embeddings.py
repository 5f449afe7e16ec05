"""``POST /v1/embeddings``: the whole pipeline, from the body (``app/wire/openai/embeddings.py``) through each input's
token ids (on a worker thread) to the vectors of the embedding model (``app/services/embedder.py``). Nothing reaches
the model before every input of the request has passed its checks. Torch-free."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server.state import ServerState, server_state
from app.services.embedder import EmbeddingService
from app.wire.openai.embeddings import EmbeddingsRequest, parse_embeddings_request
from app.wire.openai.request import parse_model


def prepare(state: ServerState, raw: bytes) -> tuple[EmbeddingService, EmbeddingsRequest, list[list[int]]]:
    """On a worker: the model, the request and each input's token ids, every check passed."""
    body = state.parse_body(raw)
    service = state.embedding_model(parse_model(body))  # a 404 or a 400 before anything else
    req = parse_embeddings_request(body, state.config.max_embedding_inputs)
    return service, req, service.token_ids(req)


async def embeddings(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()
    service, req, batch = await state.prepare(lambda: prepare(state, raw), len(raw))
    return JSONResponse(await service.answer(req, batch))
