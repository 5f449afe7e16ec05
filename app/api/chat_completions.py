"""``POST /v1/chat/completions``: the whole pipeline, from the body (``app/wire/openai/chat.py``) through the model's
template (tools and tool traffic in its family's syntax) to the generation, whose replies are read as the family
writes them (``app/pipeline/reply.py``: reasoning, content, tool calls). Torch-free."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from app.api.ollama_models import as_chat_completions
from app.pipeline.chat_model import ChatModel
from app.server.limits import check_text
from app.server.state import ServerState, server_state
from app.wire.openai.chat import ChatFormat, ChatRequest, parse_chat_request


def prepare(state: ServerState, raw: bytes) -> tuple[ChatModel, ChatRequest, list[int], str | None]:
    """On a worker: the model, the request and its conversation rendered and tokenized; the name of the model made by
    Ollama's ``/api/create`` that the body named, if it named one (``app/api/ollama_models.py``)."""
    body, made = as_chat_completions(state, state.parse_body(raw))
    req = parse_chat_request(body)
    model = state.chat_model(req.model)
    calls = [call.function.arguments for message in req.messages for call in message.tool_calls or ()]
    texts = [message.text for message in req.messages] + calls
    check_text(texts, model.max_chars, model.max_model_len, "messages")
    return model, req, model.chat_prompt(req.messages, req.tools, req.template_kwargs), made


async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    model, req, prompt, made = await state.prepare(lambda: prepare(state, raw), len(raw))
    options = model.up_to_context(req.options, prompt)
    fmt = ChatFormat(model.tokenizer, reading=model.reading(req.tools, prompt), custom=req.custom)
    generation = await model.generation(fmt, options, [prompt], None, arrived, req.tools, prompt_param="messages")
    generation.model_name = made or generation.model_name
    return await state.respond(request, generation)
