"""``POST /v1/chat/completions``: the whole pipeline, from the body (``app/openai/chat.py``) through the model's
template (tools and tool traffic in its family's syntax) to the generation, whose replies are read as the family
writes them (``app/reply.py``: reasoning, content, tool calls). Torch-free."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from app.limits import check_text
from app.openai.chat import ChatFormat, ChatRequest, parse_chat_request
from app.state import ServerState, server_state


def prepare(state: ServerState, raw: bytes) -> tuple[ChatRequest, list[int]]:
    """On a worker: the request and its conversation rendered and tokenized."""
    req = parse_chat_request(state.parse_body(raw))
    state.check_model(req.model)
    calls = [call.function.arguments for message in req.messages for call in message.tool_calls or ()]
    texts = [message.text for message in req.messages] + calls
    check_text(texts, state.max_chars, state.max_model_len, "messages")
    return req, state.chat_prompt(req.messages, req.tools, req.template_kwargs)


async def chat_completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    req, prompt = await state.prepare(lambda: prepare(state, raw), len(raw))
    options = state.up_to_context(req.options, prompt)
    fmt = ChatFormat(state.tokenizer, reading=state.reading(req.tools, prompt))
    generation = await state.generation(fmt, options, [prompt], None, arrived, req.tools)
    return await state.respond(request, generation)
