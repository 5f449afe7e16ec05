"""Running a Responses API request, and keeping what it answered.

A response is a ``Generation`` of one sequence whose output is shaped as output items and, streamed, as the
Responses API's events (``app/openai/response_events.py``). A stored response keeps its input items (for
``input_items``) and its conversation (input and output as chat messages, without ``instructions``), which a later
request's ``previous_response_id`` continues: its prompt starts as the stored one did, so the prefix cache gives
those tokens back. The store is bounded; the least recently used response leaves first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.generation import Generation, named_event
from app.openai.errors import APIError, error_body
from app.openai.messages import Message
from app.openai.response_events import ResponseEvents
from app.openai.responses import ResponsesRequest, output_messages, response_object, usage
from app.reply import Reading
from engine.core.streams import EngineError

#: Responses kept for ``previous_response_id`` and retrieval, by default.
STORE_SIZE = 1000


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    #: The request's input items as ``input_items`` lists them (ids given).
    input_items: list[dict[str, Any]]
    #: Input and output as chat messages, ``instructions`` left out (they are not inherited).
    conversation: list[Message]


class ResponseStore:
    """Stored responses by id, at most ``size``, least recently used dropped first."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        if self.size <= 0:
            return
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming the id when there is none (never stored, deleted, or evicted)."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id '{response_id}' is stored here.", param=param,
                           code="response_not_found")  # fmt: skip
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


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
        return ResponseEvents(self.tokenizer, self.reading, self.request.logprobs)

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
