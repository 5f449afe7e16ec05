"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, and ``GET /tokenizer_info``: a prompt's or a rendered
conversation's token ids, token ids' text, and what a client needs to tokenize alike. Torch-free."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server.state import ServerState, server_state
from app.wire.openai.chat import parse_chat_request
from app.wire.openai.completions import parse_completion_request
from app.wire.openai.errors import bad_request
from app.wire.openai.request import optional, parse_model, token_ids


def tokens_of(state: ServerState, body: dict[str, Any]) -> list[int]:
    """A body's prompt (``prompt``, ``add_special_tokens``) or conversation (``messages``, ``tools``,
    ``chat_template_kwargs``) as the model's token ids."""
    model = state.chat_model(parse_model(body))
    if "messages" in body:
        keys = ("messages", "tools", "chat_template_kwargs")
        chat = parse_chat_request({key: body[key] for key in keys if key in body})
        return model.chat_prompt(chat.messages, chat.tools, chat.template_kwargs)
    prompts = parse_completion_request({"prompt": body.get("prompt")}).prompts
    if len(prompts) != 1:
        raise bad_request("tokenize takes one prompt", "prompt")
    add_special = optional(body, "add_special_tokens", bool, True)  # vLLM's default
    prompt = prompts[0]
    return model.tokenizer.encode(prompt, add_special) if isinstance(prompt, str) else model.prompt_ids(prompt)


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()

    def answer() -> bytes:  # rendered on the worker too: a long prompt's token list is megabytes of JSON
        body = state.parse_body(raw)
        tokens = tokens_of(state, body)
        room = state.chat_model(parse_model(body)).max_model_len
        return json.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": room}).encode()

    return Response(await state.prepare(answer, len(raw)), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()

    def text() -> str:
        body = state.parse_body(raw)
        model = state.chat_model(parse_model(body))
        return model.tokenizer.decode(model.prompt_ids(token_ids(body.get("tokens"), "tokens"), "tokens"))

    return JSONResponse({"prompt": await state.prepare(text, len(raw))})


async def tokenizer_info(request: Request) -> Response:
    model = server_state(request).chat_model(request.query_params.get("model"))
    return JSONResponse({**model.tokenizer.info(), "model_max_length": model.max_model_len})
