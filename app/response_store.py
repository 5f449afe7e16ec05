"""The Responses API's store: what it answered, kept for ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items``. A stored response keeps its input items and its conversation (input and output as chat messages,
without ``instructions``), which a later request's ``previous_response_id`` continues: its prompt starts as the
stored one did, so the prefix cache gives those tokens back. Bounded; the least recently used response leaves first.
Torch-free."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from app.openai.errors import APIError
from app.openai.messages import Message

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
