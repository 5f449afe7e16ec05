"""The Responses API's store: what it answered, kept for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items``. A stored response keeps its input items and its conversation (input and output as chat messages,
without ``instructions``), which a later request's ``previous_response_id`` continues: its prompt starts as the
stored one did, so the prefix cache gives those tokens back. Bounded; the least recently used response leaves first.
Torch-free."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.wire.openai.errors import APIError
from app.wire.openai.messages import Message

#: Responses kept for ``previous_response_id`` and retrieval, by default.
STORE_SIZE = 1000
#: What they may hold together, by default: each can carry megabytes (its tools' schemas, a long conversation), so
#: a count alone does not bound the heap.
STORE_BYTES = 256 * 2**20


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    #: The request's input items as ``input_items`` lists them (ids given).
    input_items: list[dict[str, Any]]
    #: Input and output as chat messages, ``instructions`` left out (they are not inherited).
    conversation: list[Message]

    def size(self) -> int:
        """Bytes it holds, as JSON (the objects in memory hold a small multiple of it)."""
        conversation = sum(len(message.model_dump_json()) for message in self.conversation)
        return len(json.dumps(self.response)) + len(json.dumps(self.input_items)) + conversation


class ResponseStore:
    """Stored responses by id, at most ``size`` of them holding at most ``max_bytes``, least recently used dropped
    first; one larger than ``max_bytes`` alone is not kept."""

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        response_id, size = stored.response["id"], stored.size()
        if self.size <= 0 or size > self.max_bytes:
            return
        if response_id in self._items:
            self.num_bytes -= self._items.pop(response_id)[1]
        self._items[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._items) > self.size or self.num_bytes > self.max_bytes:
            self.num_bytes -= self._items.popitem(last=False)[1][1]

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming the id when there is none (never stored, deleted, or evicted)."""
        item = self._items.get(response_id)
        if item is None:
            raise APIError(404, f"No response with id '{response_id}' is stored here.", param=param,
                           code="response_not_found")  # fmt: skip
        self._items.move_to_end(response_id)
        return item[0]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self.num_bytes -= self._items.pop(response_id)[1]
