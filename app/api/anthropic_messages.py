"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the whole pipeline,
from the body (``app/wire/anthropic/request.py``) through the chat pipeline's template, tools, grammar and scheduler to
the message or its event stream (``app/wire/anthropic/response.py``). Errors on these routes come in Anthropic's
envelope (``app/wire/anthropic/errors.py``, chosen in ``app/server/handlers.py``).

``max_tokens`` is the most the reply may take: where the prompt leaves less room in the context, the reply stops
at the context's end (``stop_reason: "max_tokens"``) instead of the request failing, as llama.cpp's server does
(Claude Code asks for 32,000 on every turn); a prompt with no room left at all is a 400."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.pipeline.chat_model import ChatModel
from app.pipeline.generation import Generation, named_event
from app.pipeline.reply import Reading
from app.pipeline.reply_budget import reply_budget
from app.server.limits import check_text
from app.server.state import ServerState, server_state
from app.wire.anthropic.request import MessagesRequest, parse_messages_request
from app.wire.anthropic.response import MessageBuilder, message_object, new_id, usage
from app.wire.openai.chat import ChatFormat
from app.wire.openai.errors import bad_request
from engine.core.streams import EngineError


@dataclass(slots=True)
class MessagesGeneration(Generation):
    """One Messages API request: one sequence, answered as a message or its stream of events."""

    reading: Reading = field(default_factory=Reading)
    message_id: str = ""

    async def complete(self) -> dict[str, Any]:
        choice = (await self.collect())[0]
        builder = MessageBuilder(self.reading, self.options.stop)
        builder.feed(choice.text, last=True)
        stop_reason = builder.stop_reason(choice.finish_reason)
        spent = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
        return message_object(self.message_id, self.model_name, builder.blocks, stop_reason, builder.stop_sequence,
                              spent)  # fmt: skip

    async def events(self) -> AsyncIterator[Any]:
        """Anthropic's events, as server-sent events named by their type."""
        builder = MessageBuilder(self.reading, self.options.stop)
        start = message_object(self.message_id, self.model_name, [], None, None, usage(self.num_prompt_tokens, 0, 0))
        yield named_event({"type": "message_start", "message": start})
        yield named_event({"type": "ping"})
        deltas = self.deltas()
        try:
            async for _, item in deltas:
                if isinstance(item, EngineError):
                    yield named_event({"type": "error", "error": {"type": "api_error", "message": str(item)}})
                    return
                last = item.finish_reason is not None
                for event in builder.feed(item.text, last):
                    yield named_event(event)
                if last:
                    stop = {"stop_reason": builder.stop_reason(item.finish_reason),
                            "stop_sequence": builder.stop_sequence}  # fmt: skip
                    spent = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
                    yield named_event({"type": "message_delta", "delta": stop, "usage": spent})
                    yield named_event({"type": "message_stop"})
        finally:
            await deltas.aclose()  # the client may have left mid-stream: the sequence leaves the batch


def prepare(state: ServerState, body: dict[str, Any]) -> tuple[ChatModel, MessagesRequest, list[int]]:
    """On a worker: the model, the request and its conversation rendered and tokenized."""
    req = parse_messages_request(body)
    model = state.chat_model(req.model)
    calls = [call.function.arguments for message in req.messages for call in message.tool_calls or ()]
    check_text([message.text for message in req.messages] + calls, model.max_chars, model.max_model_len, "messages")
    extra = {**req.template_kwargs, **({"continue_final_message": True} if req.prefill else {})}
    return model, req, model.chat_prompt(req.messages, req.tools, extra)


async def messages(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    model, req, prompt = await state.prepare(lambda: prepare(state, state.parse_body(raw)), len(raw))
    if len(prompt) >= model.max_model_len:
        raise bad_request(f"prompt is too long: {len(prompt)} tokens > {model.max_model_len - 1} maximum", "messages")
    budget = reply_budget(req.options.max_tokens, len(prompt), model.max_model_len)
    options = dataclasses.replace(req.options, max_tokens=budget)
    reading = model.reading(req.tools, prompt)
    options = model.with_budget(options, req.tools, reading, req.thinking_budget)
    generation = await model.generation(
        ChatFormat(model.tokenizer), options, [prompt], None, arrived, req.tools, kind=MessagesGeneration,
        reading=reading, message_id=new_id("msg"),
    )  # fmt: skip
    return await state.respond(request, generation)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as ``/v1/messages`` would render it (system, tools and all)."""
    state = server_state(request)
    raw = await request.body()

    def count() -> int:
        body = state.parse_body(raw)
        body.setdefault("max_tokens", 1)  # not a field of count_tokens
        return len(prepare(state, body)[2])

    return JSONResponse({"input_tokens": await state.prepare(count, len(raw))})
