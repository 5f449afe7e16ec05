"""The routes: thin handlers that read a body, hand it to the server state (``app/state.py``) and answer. The wire
format of each endpoint is in ``app/openai/``. Torch-free."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import infill as fill
from app import messages
from app.openai.chat import ChatFormat
from app.openai.completions import CompletionFormat
from app.openai.models import model_list
from app.openai.responses import input_item_list
from app.state import server_state
from app.summary import server_facts


async def health(request: Request) -> Response:
    state = server_state(request)
    health = await state.backend.health()
    facts = server_facts(state, health.get("engine", {}))
    return JSONResponse({"status": "draining" if state.draining else "ok", **health, "models": facts["models"],
                         "speculative": facts["speculative"]})  # fmt: skip


async def metrics(request: Request) -> Response:
    state = server_state(request)
    return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def models(request: Request) -> Response:
    return JSONResponse(model_list(server_state(request).registry.cards()))


async def model(request: Request) -> Response:
    return JSONResponse(server_state(request).registry.card(request.path_params["model_id"]))


async def embeddings(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()
    req, batch = await state.prepare(lambda: state.prepare_embeddings(raw), len(raw))
    assert state.embeddings is not None
    return JSONResponse(await state.embeddings.answer(req, batch))


async def tokenizer_info(request: Request) -> Response:
    state = server_state(request)
    return JSONResponse({**state.tokenizer.info(), "model_max_length": state.max_model_len})


async def completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    req, prompts, echo_texts = await state.prepare(lambda: state.prepare_completion(raw), len(raw))
    fmt = CompletionFormat(state.tokenizer, prompts)
    return await state.respond(request, await state.generation(fmt, req.options, prompts, echo_texts, arrived))


async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    req, prompt = await state.prepare(lambda: state.prepare_chat(raw), len(raw))
    options = state.up_to_context(req.options, prompt)
    fmt = ChatFormat(state.tokenizer, reading=state.reading(req.tools, prompt))
    generation = await state.generation(fmt, options, [prompt], None, arrived, req.tools)
    return await state.respond(request, generation)


async def responses(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    req, prompt, messages = await state.prepare(lambda: state.prepare_response(raw), len(raw))
    return await state.respond(request, await state.response_generation(req, prompt, messages, arrived))


async def get_response(request: Request) -> Response:
    return JSONResponse(server_state(request).responses.get(request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    server_state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def response_input_items(request: Request) -> Response:
    stored = server_state(request).responses.get(request.path_params["response_id"])
    return JSONResponse(input_item_list(stored.input_items, request.query_params))


async def infill(request: Request) -> Response:
    """llama.cpp's fill-in-the-middle endpoint (``app/infill.py``)."""
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    req, prompt = await state.prepare(lambda: fill.prepare(state, raw), len(raw))
    generation = await state.generation(
        CompletionFormat(state.tokenizer, [prompt]), req.completion.options, [prompt], None, arrived
    )
    answer, events = (lambda: fill.answer(req, generation)), (lambda: fill.events(req, generation))
    return await state.respond(request, generation, answer, events)


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()
    # The answer is rendered on the worker too: a long prompt's token list is megabytes of JSON.
    answer = await state.prepare(lambda: state.tokenize(raw), len(raw))
    return Response(answer, media_type="application/json")


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()
    return JSONResponse({"prompt": await state.prepare(lambda: state.detokenize(raw), len(raw))})


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", model, methods=["GET"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/messages", messages.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/input_items", response_input_items, methods=["GET"]),
    Route("/infill", infill, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
