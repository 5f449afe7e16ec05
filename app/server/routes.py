"""The route table, and the routes that are the server's own (health, metrics, the served models) or thin (infill). Each
endpoint's pipeline and route live in its module: ``app/api/completions.py``, ``app/api/chat_completions.py``,
``app/api/responses.py``, ``app/api/anthropic_messages.py``, ``app/api/tokens.py``, ``app/api/embeddings.py``; their
wire formats in ``app/wire/openai/`` and ``app/wire/anthropic/``. Torch-free."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.api import anthropic_messages as messages
from app.api import batches, completions, embeddings, files, ollama, ollama_models, responses, tokens
from app.api import chat_completions as chat
from app.api import infill as fill
from app.server.openapi import openapi
from app.server.state import ServerState, server_state
from app.server.summary import server_facts
from app.services.model_pool import PoolEntry
from app.wire.anthropic.model_list import VERSION_HEADER, model_info, model_page
from app.wire.openai.completions import CompletionFormat
from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.model_list import model_list
from app.wire.openai.request import parse_model


async def health(request: Request) -> Response:
    state = server_state(request)
    health = await state.backend.health() if state.backend is not None else {}
    facts = server_facts(state, health.get("engine", {}))
    return JSONResponse({"status": "draining" if state.draining else "ok", **health, "models": facts["models"],
                         "speculative": facts["speculative"], "batches": state.batch_report()})  # fmt: skip


async def metrics(request: Request) -> Response:
    state = server_state(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def models(request: Request) -> Response:
    """The served models, in OpenAI's list, or in Anthropic's page where the request is the Anthropic API's."""
    registry = server_state(request).registry
    if VERSION_HEADER in request.headers:
        names = [name for entry in registry.entries for name in entry.names]
        return JSONResponse(model_page(names, registry.created, request.query_params))
    return JSONResponse(model_list(registry.cards()))


async def model(request: Request) -> Response:
    registry, name = server_state(request).registry, request.path_params["model_id"]
    if VERSION_HEADER in request.headers:
        registry.find(name)  # a 404 for a model not served
        return JSONResponse(model_info(name, registry.created))
    return JSONResponse(registry.card(name))


async def infill(request: Request) -> Response:
    """llama.cpp's fill-in-the-middle endpoint (``app/api/infill.py``)."""
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    model, req, prompt = await state.prepare(lambda: fill.prepare(state, raw), len(raw))
    generation = await model.generation(
        CompletionFormat(model.tokenizer, [prompt]), req.completion.options, [prompt], None, arrived
    )
    answer, events = (lambda: fill.answer(req, generation)), (lambda: fill.events(req, generation))
    return await state.respond(request, generation, answer, events)


async def load_model(request: Request) -> Response:
    """llama.cpp's router: ``POST /models/load`` ``{"model": id}`` loads a chat model now (waits for the load)."""
    state = server_state(request)
    entry = _pooled(state, await request.body())
    await state.pool.load(entry)
    return JSONResponse({"success": True})


async def unload_model(request: Request) -> Response:
    """``POST /models/unload`` ``{"model": id}``: unloads a chat model now; a 409 while it has requests."""
    state = server_state(request)
    entry = _pooled(state, await request.body())
    if entry.spec is None:
        raise bad_request(f"`{entry.names[0]}` is the only chat model: it stays loaded", "model")
    if entry.model is not None and not entry.model.backend.is_idle:
        raise APIError(409, f"`{entry.names[0]}` has requests running; unload it once they end", param="model",
                       code="model_busy")  # fmt: skip
    await state.pool.unload(entry)
    return JSONResponse({"success": True})


def _pooled(state: ServerState, raw: bytes) -> PoolEntry:
    """The chat model a ``/models/*`` body names (``model`` required)."""
    name = parse_model(state.parse_body(raw))
    if name is None:
        raise bad_request("model: required", "model")
    return state.pool.entry(state.registry.route(name, "generate").name)


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/tokenizer_info", tokens.tokenizer_info, methods=["GET"]),
    Route("/v1/completions", completions.completions, methods=["POST"]),
    Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
    Route("/v1/responses", responses.responses, methods=["POST"]),
    Route("/v1/messages", messages.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
    Route("/v1/embeddings", embeddings.embeddings, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", responses.response_input_items, methods=["GET"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/v1/files", files.create_file, methods=["POST"]),
    Route("/v1/files", files.list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", files.get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
    Route("/v1/batches", batches.create_batch, methods=["POST"]),
    Route("/v1/batches", batches.list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", batches.get_batch, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
    Route("/models/load", load_model, methods=["POST"]),
    Route("/models/unload", unload_model, methods=["POST"]),
    Route("/tokenize", tokens.tokenize, methods=["POST"]),
    Route("/detokenize", tokens.detokenize, methods=["POST"]),
    Route("/openapi.json", openapi, methods=["GET"]),
    # Ollama's API (``app/wire/ollama/``)
    Route("/", ollama.root, methods=["GET", "HEAD"]),
    Route("/api/chat", ollama.chat, methods=["POST"]),
    Route("/api/generate", ollama.generate, methods=["POST"]),
    Route("/api/embed", ollama.embed, methods=["POST"]),
    Route("/api/embeddings", ollama.embeddings, methods=["POST"]),
    Route("/api/tags", ollama.tags, methods=["GET"]),
    Route("/api/ps", ollama.ps, methods=["GET"]),
    Route("/api/show", ollama.show, methods=["POST"]),
    Route("/api/version", ollama.version, methods=["GET"]),
    Route("/api/pull", ollama.pull, methods=["POST"]),
    Route("/api/push", ollama_models.push, methods=["POST"]),
    Route("/api/create", ollama_models.create, methods=["POST"]),
    Route("/api/copy", ollama_models.copy, methods=["POST"]),
    Route("/api/delete", ollama_models.delete, methods=["DELETE"]),
]
