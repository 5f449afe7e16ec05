"""Ollama's routes: ``/api/chat`` and ``/api/generate`` through the chat pipeline (``app/pipeline/chat_model.py``:
template, tools, grammar, reasoning, the scheduler), ``/api/embed`` and ``/api/embeddings`` through the embedding model,
the listings, ``/api/version`` and ``GET /`` as Ollama answers them."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from app.api import infill
from app.api.ollama_models import aliased, served_names
from app.pipeline.chat_model import ChatModel
from app.server.limits import check_text
from app.server.state import ServerState, server_state
from app.services.model_pool import PoolEntry
from app.wire.ollama import request as wire
from app.wire.ollama.listings import listed, running, shown
from app.wire.ollama.response import VERSION, OllamaGeneration, timestamp
from app.wire.openai.chat import ChatFormat, ChatRequest, parse_chat_request
from app.wire.openai.embeddings import parse_embeddings_request
from app.wire.openai.errors import APIError, bad_request


def _model(state: ServerState, name: str, body: dict[str, Any] | None = None) -> ChatModel:
    """The chat model ``name`` (its ``:latest`` tag dropped); Ollama's 404 for any other. The body's
    ``keep_alive``, if any, becomes how long the model stays loaded once idle."""
    try:
        model = state.chat_model(name)
    except APIError as exc:
        if exc.status == 404:
            raise _not_found(name) from None
        raise
    kept = wire.keep_alive((body or {}).get("keep_alive"))
    if kept is not None:
        state.pool.entry(name).keep_alive_s = kept
    return model


def _not_found(name: str, why: str = "") -> APIError:
    """Ollama's 404 for a model it does not have."""
    return APIError(404, f"model '{name}' not found{why}", param="model")


def _check_think(model: ChatModel, name: str, body: dict[str, Any]) -> None:
    """``think`` on a model that does not reason: Ollama's 400."""
    if body.get("think") and not model.reasons and model.harmony is None:
        raise bad_request(f'"{name}" does not support thinking', "think")


def _prepare_chat(state: ServerState, body: dict[str, Any]) -> tuple[ChatModel, ChatRequest, list[int]]:
    body = aliased(state, body, generate=False)
    name = wire.model_name(body)
    model = _model(state, name, body)
    req = parse_chat_request(wire.chat_body(body, model.max_model_len))
    _check_think(model, name, body)
    check_text([message.text for message in req.messages], model.max_chars, model.max_model_len, "messages")
    return model, req, model.chat_prompt(req.messages, req.tools, req.template_kwargs)


async def chat(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    body = await state.prepare(lambda: state.parse_body(raw), len(raw))
    if not body.get("messages"):  # Ollama's way to load a model: an empty conversation
        return await _loaded(state, body, {"message": {"role": "assistant", "content": ""}})
    model, req, prompt = await state.prepare(lambda: _prepare_chat(state, body), len(raw))
    return await _answer(request, state, (model, str(body["model"])), req, prompt, arrived, generate=False)


def _prepare_generate(state: ServerState, body: dict[str, Any]) -> tuple[ChatModel, ChatRequest, list[int]]:
    """``/api/generate``: the prompt through the model's template (with ``system``), as it is (``raw``), or before
    the gap of a fill-in-the-middle prompt (``suffix``); the ids of an earlier turn (``context``) before it."""
    body = aliased(state, body, generate=True)
    system, prompt = body.get("system"), body.get("prompt") or ""
    messages = [{"role": "system", "content": system}] if system else []
    chat = {**body, "messages": [*messages, {"role": "user", "content": prompt}]}
    name = wire.model_name(body)
    model = _model(state, name, body)
    req = parse_chat_request({key: v for key, v in wire.chat_body(chat, model.max_model_len).items() if key != "tools"})
    _check_think(model, name, body)
    check_text([prompt, system or ""], model.max_chars, model.max_model_len, "prompt")
    if body.get("suffix"):  # fill in the middle (a coder model's FIM tokens), as /v1/completions' suffix
        ids, ends = infill.fill_prompt(model, prompt, str(body["suffix"]), "suffix")
        stops = req.options.stop_token_ids | ends
        req = dataclasses.replace(req, options=dataclasses.replace(req.options, stop_token_ids=stops))
    elif body.get("raw"):
        ids = model.prompt_ids(prompt)
    else:
        ids = model.chat_prompt(req.messages, None, req.template_kwargs)
    context = body.get("context") or []
    if not isinstance(context, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
        raise bad_request("context must be a list of token ids", "context")
    return model, req, [*model.prompt_ids(context, "context"), *ids]


async def generate(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    body = await state.prepare(lambda: state.parse_body(raw), len(raw))
    if not any(body.get(field) for field in ("prompt", "suffix", "context")):  # Ollama's preload, or unload
        return await _loaded(state, body, {"response": ""})
    model, req, prompt = await state.prepare(lambda: _prepare_generate(state, body), len(raw))
    return await _answer(request, state, (model, str(body["model"])), req, prompt, arrived, generate=True)


async def _answer(request: Request, state: ServerState, named: tuple[ChatModel, str], req: ChatRequest,
                  prompt: list[int], arrived: float, generate: bool) -> Response:  # fmt: skip
    """The answer, under the name the request gave, as Ollama echoes it (``:latest`` or not; a made model's too)."""
    model, name = named
    options = model.up_to_context(req.options, prompt)
    generation = await model.generation(
        ChatFormat(model.tokenizer), options, [prompt], None, arrived, req.tools, kind=OllamaGeneration,
        prompt_param="prompt" if generate else "messages", reading=model.reading(req.tools, prompt), generate=generate,
    )  # fmt: skip
    generation.model_name = name
    return await state.respond(request, generation, ndjson=True)


async def _loaded(state: ServerState, body: dict[str, Any], empty: dict[str, Any]) -> Response:
    """A request with nothing to answer: the model loaded (Ollama's preload, ``done_reason`` "load"), or with
    ``keep_alive`` 0 unloaded ("unload")."""
    name = wire.model_name(body)
    body = aliased(state, body, generate=True)  # a made model loads and unloads its served one
    target = wire.model_name(body)
    if wire.keep_alive(body.get("keep_alive")) == 0:
        entry = state.pool.entry(_model_entry(state, target))
        await state.pool.unload(entry)
        return JSONResponse({"model": name, "created_at": timestamp(), **empty, "done": True, "done_reason": "unload"})
    await state.prepare(lambda: _model(state, target, body), 0)
    return JSONResponse({"model": name, "created_at": timestamp(), **empty, "done": True, "done_reason": "load"})


def _model_entry(state: ServerState, name: str) -> str:
    """``name`` if a chat model is served under it, else Ollama's 404."""
    if name not in served_names(state):
        raise _not_found(name)
    return name


async def embed(request: Request) -> Response:
    """``/api/embed``: one vector per input, L2-normalized; ``truncate`` (on by default) cuts inputs to the model's
    length, off refuses a longer one."""
    started = time.perf_counter()
    state = server_state(request)
    raw = await request.body()

    def prepare() -> tuple[Any, Any, list[list[int]], str]:
        body = state.parse_body(raw)
        name = wire.model_name(body)
        service = state.embedding_model(name)
        openai = {"model": name, "input": body.get("input"), "dimensions": body.get("dimensions"),
                  "truncate_prompt_tokens": -1 if body.get("truncate", True) else None}  # fmt: skip
        req = parse_embeddings_request(openai, state.config.max_embedding_inputs)
        return service, req, service.token_ids(req), name

    service, req, batch, name = await state.prepare(prepare, len(raw))
    answer = await service.answer(req, batch)
    vectors = [item["embedding"] for item in answer["data"]]
    took = int((time.perf_counter() - started) * 1e9)
    return JSONResponse({"model": name, "embeddings": vectors, "total_duration": took, "load_duration": 0,
                         "prompt_eval_count": answer["usage"]["prompt_tokens"]})  # fmt: skip


async def embeddings(request: Request) -> Response:
    """The older ``/api/embeddings``: ``prompt``, one vector."""
    state = server_state(request)
    raw = await request.body()

    def prepare() -> tuple[Any, Any, list[list[int]]]:
        body = state.parse_body(raw)
        service = state.embedding_model(wire.model_name(body))
        req = parse_embeddings_request({"model": body.get("model"), "input": body.get("prompt")}, 1)
        return service, req, service.token_ids(req)

    service, req, batch = await state.prepare(prepare, len(raw))
    return JSONResponse({"embedding": (await service.answer(req, batch))["data"][0]["embedding"]})


def _modified(state: ServerState) -> str:
    return timestamp(state.created)


async def _facts(entry: PoolEntry) -> dict[str, Any]:
    """What a loaded model's engine says of the model (architecture, parameters, block types); empty otherwise."""
    if entry.model is None:
        return {}
    return ((await entry.model.backend.health()).get("engine") or {}).get("model") or {}


async def tags(request: Request) -> Response:
    """Every served model, then every model made by ``/api/create`` or ``/api/copy`` (as its served one, under its
    own name)."""
    state = server_state(request)
    modified = _modified(state)
    models = [listed(e, modified, await _facts(e)) for e in state.pool.entries]
    served = served_names(state)
    for alias in state.aliases.all():
        if alias.target in served:
            entry = state.pool.entry(alias.target)
            models.append(listed(entry, timestamp(alias.created), await _facts(entry), alias))
    return JSONResponse({"models": models})


async def ps(request: Request) -> Response:
    state = server_state(request)
    entries = [entry for entry in state.pool.entries if entry.model is not None]
    models = [running(e, _modified(state), _expires(state, e), await _facts(e)) for e in entries]
    return JSONResponse({"models": models})


#: Ollama's "never" for a model kept loaded for good.
NEVER = "2318-06-07T00:00:00Z"


def _expires(state: ServerState, entry: PoolEntry) -> str:
    """When a model unloads once idle: its keep_alive after its last use; never where it is kept for good (a negative
    keep_alive, or the one model of a server, which the pool never unloads)."""
    kept = state.pool.kept_for(entry) if len(state.pool.entries) > 1 and entry.spec is not None else -1.0
    return NEVER if kept < 0 else timestamp(time.time() + entry.last_used + kept - time.monotonic())


async def show(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()
    body = state.parse_body(raw)
    name = wire.model_name({"model": body.get("model") or body.get("name")})
    alias = state.aliases.get(name)
    target = alias.target if alias is not None else name
    entry = state.pool.entry(_model_entry(state, target))
    model = await state.prepare(lambda: _model(state, target), 0)
    capabilities = ["completion", "tools"]
    if model.reasons or model.harmony is not None:
        capabilities.append("thinking")
    if model.tokenizer.fim is not None:
        capabilities.append("insert")
    template = model.tokenizer.info().get("chat_template")
    return JSONResponse(shown(entry, template, capabilities, _modified(state), await _facts(entry), alias))


#: What Ollama's pull stream says before ``success`` (a model served here is already on this machine).
_PULLED = ("pulling manifest", "verifying sha256 digest", "writing manifest", "success")


async def pull(request: Request) -> Response:
    """``/api/pull`` of a model this server serves: loaded, with Ollama's progress ending in ``success``; any
    other a 404 (models come from local files, nothing is downloaded)."""
    state = server_state(request)
    body = state.parse_body(await request.body())
    name = wire.model_name({"model": body.get("model") or body.get("name")})
    alias = state.aliases.get(name)
    name = alias.target if alias is not None else name  # a made model: its served one
    if name in served_names(state):
        await state.prepare(lambda: _model(state, name), 0)
    elif state.embeddings is None or name not in state.embeddings.entry.names:
        raise _not_found(name, ": this server pulls nothing; its models are local files (--model, --models-dir)")
    if body.get("stream") is False:
        return JSONResponse({"status": "success"})
    lines = "".join(json.dumps({"status": status}) + "\n" for status in _PULLED)
    return Response(lines, media_type="application/x-ndjson")


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")
