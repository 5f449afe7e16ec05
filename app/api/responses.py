"""The Responses API, ``POST /v1/responses`` and its stored responses' routes: the whole pipeline, from the body
(``app/wire/openai/responses.py``) and the stored conversation it continues, through the model's template to the
generation, answered as a response object or its events (``app/wire/openai/response_events.py``), then kept in the store
(``app/stores/response_store.py``). A response is a ``Generation`` of one sequence. Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.pipeline.chat_model import ChatModel
from app.pipeline.generation import Generation, named_event
from app.pipeline.reply import Reading
from app.server.limits import check_text
from app.server.state import ServerState, server_state
from app.stores.response_store import ResponseStore, StoredResponse
from app.wire.openai.chat import ChatFormat
from app.wire.openai.errors import bad_request, error_body
from app.wire.openai.messages import Message
from app.wire.openai.response_events import ResponseEvents
from app.wire.openai.responses import (
    SKIPPED_HEADER,
    ResponsesRequest,
    conversation,
    input_item_list,
    item_texts,
    new_id,
    output_messages,
    parse_responses_request,
    response_object,
    stored_input_items,
    usage,
    with_instructions,
)
from engine.core.streams import EngineError

log = logging.getLogger(__name__)
#: The hosted tool types already named in the log (once each per process).
_LOGGED_SKIPS: set[str] = set()


@dataclass(slots=True)
class ResponseGeneration(Generation):
    """A Responses API request: one sequence, answered as a response object or its stream of events."""

    request: ResponsesRequest | None = None
    store: ResponseStore | None = None
    #: The conversation before the new input's output: stored conversation, then the new input.
    history: list[Message] = field(default_factory=list)
    stored_items: list[dict[str, Any]] = field(default_factory=list)
    reading: Reading = field(default_factory=Reading)  # how the reply is read: reasoning, content, calls
    response_id: str = ""
    created_at: int = 0

    def __post_init__(self) -> None:
        Generation.__post_init__(self)
        self.created_at = int(time.time())

    async def complete(self) -> dict[str, Any]:
        choice = (await self.collect())[0]
        builder = self._builder()
        builder.feed(choice.text, choice.logprobs)
        builder.finish(choice.finish_reason)
        return self._final(builder, choice.finish_reason)

    async def events(self) -> AsyncIterator[Any]:
        """The Responses API's events, as server-sent events named by their type."""
        builder = self._builder()
        start = self._object("in_progress", [])
        for kind in ("response.created", "response.in_progress"):
            yield named_event(builder.event(kind, response=start))
        deltas = self.deltas()
        try:
            async for _, item in deltas:
                if isinstance(item, EngineError):
                    for event in self._failed(builder, str(item)):
                        yield named_event(event)
                    return
                for event in builder.feed(item.text, item.logprobs):
                    yield named_event(event)
                if item.finish_reason is not None:
                    for event in builder.finish(item.finish_reason):
                        yield named_event(event)
                    response = self._final(builder, item.finish_reason)
                    yield named_event(builder.event(f"response.{response['status']}", response=response))
        finally:
            await deltas.aclose()  # the client may have left mid-stream: the sequence leaves the batch

    def _builder(self) -> ResponseEvents:
        assert self.request is not None
        req = self.request
        return ResponseEvents(self.tokenizer, self.reading, req.logprobs, namespaced=req.namespaced,
                              custom=req.custom, encrypted_reasoning=req.encrypted_reasoning)  # fmt: skip

    def _object(self, status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        assert self.request is not None
        return response_object(
            self.request, self.response_id, self.model_name, self.created_at, status=status, output=output, **extra
        )

    def _final(self, builder: ResponseEvents, finish_reason: str | None) -> dict[str, Any]:
        status = "incomplete" if finish_reason == "length" else "completed"
        spent = usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)
        response = self._object(status, builder.output, usage=spent)
        if self.store is not None:
            conversation = self.history + output_messages(builder.output)
            self.store.put(StoredResponse(response, self.stored_items, conversation))
        return response

    def _failed(self, builder: ResponseEvents, message: str) -> list[dict[str, Any]]:
        error = error_body(500, message, code="engine_error")["error"]
        failed = self._object("failed", builder.output, error={"code": "server_error", "message": message})
        return [
            builder.event("error", code=error["code"], message=message, param=None),
            builder.event("response.failed", response=failed),
        ]


# -- the pipeline and its routes -----------------------------------------------------------------------------


def prepare(state: ServerState, raw: bytes) -> tuple[ChatModel, ResponsesRequest, list[int], list[Message]]:
    """On a worker: the model, the request, its prompt (the stored conversation it continues, then its input, with
    its instructions first), and the conversation without the instructions."""
    req = parse_responses_request(state.parse_body(raw))
    model = state.chat_model(req.model)
    check_text(item_texts(req.items), model.max_chars, model.max_model_len, "input")
    previous = req.body.previous_response_id
    history = [] if previous is None else state.responses.get(previous, "previous_response_id").conversation
    messages = history + conversation(req.items)
    prompt = model.chat_prompt(with_instructions(req.instructions, messages), req.tools, req.template_kwargs)
    # truncation: auto drops the oldest items to leave max_output_tokens; past that (or without it) the reply is
    # clamped to what the prompt leaves, and only a prompt that leaves nothing is refused.
    need = req.options.max_tokens or 1
    while req.truncate and len(prompt) + need > model.max_model_len and len(messages) > 1:
        messages = _drop_oldest(messages)
        prompt = model.chat_prompt(with_instructions(req.instructions, messages), req.tools, req.template_kwargs)
    if len(prompt) >= model.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {model.max_model_len} tokens. However, the input is "
            f"{len(prompt)} tokens, which leaves no room for the output. Shorten the input, or set truncation: auto.",
            "input",
        )
    return model, req, prompt, messages


def _drop_oldest(messages: list[Message]) -> list[Message]:
    """The conversation without its oldest message, nor the tool results that answered a call it held."""
    rest = messages[1:]
    while len(rest) > 1 and rest[0].role == "tool":
        rest = rest[1:]
    return rest


async def responses(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    model, req, prompt, messages = await state.prepare(lambda: prepare(state, raw), len(raw))
    generation = await model.generation(
        ChatFormat(model.tokenizer), model.up_to_context(req.options, prompt), [prompt], None, arrived, req.tools,
        kind=ResponseGeneration, request=req, store=state.responses if req.store else None, history=messages,
        stored_items=stored_input_items(req.items), reading=model.reading(req.tools, prompt),
        response_id=new_id("resp"), prompt_param="input",
    )  # fmt: skip
    response = await state.respond(request, generation)
    if req.skipped:  # hosted tools: not run here, said so (and logged once per type)
        response.headers[SKIPPED_HEADER] = ", ".join(req.skipped)
        for kind in set(req.skipped) - _LOGGED_SKIPS:
            _LOGGED_SKIPS.add(kind)
            log.warning("hosted %s tools are offered by clients but not run here: left out of the tools the "
                        "model sees (named in the %s header)", kind, SKIPPED_HEADER)  # fmt: skip
    return response


async def get_response(request: Request) -> Response:
    return JSONResponse(server_state(request).responses.get(request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    server_state(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def response_input_items(request: Request) -> Response:
    stored = server_state(request).responses.get(request.path_params["response_id"])
    return JSONResponse(input_item_list(stored.input_items, request.query_params))
