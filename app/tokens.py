"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, and ``GET /tokenizer_info``: a prompt's or a rendered
conversation's token ids, token ids' text, and what a client needs to tokenize alike. Torch-free."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.openai.chat import parse_chat_request
from app.openai.completions import parse_completion_request
from app.openai.errors import bad_request
from app.openai.request import optional, parse_model, token_ids
from app.state import ServerState, server_state


def tokens_of(state: ServerState, body: dict[str, Any]) -> list[int]:
    """A body's prompt (``prompt``, ``add_special_tokens``) or conversation (``messages``, ``tools``,
    ``chat_template_kwargs``) as the model's token ids."""
    state.check_model(parse_model(body))
    if "messages" in body:
        keys = ("messages", "tools", "chat_template_kwargs")
        chat = parse_chat_request({key: body[key] for key in keys if key in body})
        return state.chat_prompt(chat.messages, chat.tools, chat.template_kwargs)
    prompts = parse_completion_request({"prompt": body.get("prompt")}).prompts
    if len(prompts) != 1:
        raise bad_request("tokenize takes one prompt", "prompt")
    add_special = optional(body, "add_special_tokens", bool, True)  # vLLM's default
    prompt = prompts[0]
    return state.tokenizer.encode(prompt, add_special) if isinstance(prompt, str) else state.prompt_ids(prompt)


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()

    def answer() -> bytes:  # rendered on the worker too: a long prompt's token list is megabytes of JSON
        tokens = tokens_of(state, state.parse_body(raw))
        return json.dumps({"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}).encode()

    return Response(await state.prepare(answer, len(raw)), media_type="application/json")


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    raw = await request.body()

    def text() -> str:
        body = state.parse_body(raw)
        state.check_model(parse_model(body))
        return state.tokenizer.decode(state.prompt_ids(token_ids(body.get("tokens"), "tokens"), "tokens"))

    return JSONResponse({"prompt": await state.prepare(text, len(raw))})


async def tokenizer_info(request: Request) -> Response:
    state = server_state(request)
    return JSONResponse({**state.tokenizer.info(), "model_max_length": state.max_model_len})
