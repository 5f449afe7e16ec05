"""The served models: each with its kind (it generates, or it embeds) and its names, and the routing of a request's
``model`` to one of them. The chat model is listed first, then the embedding model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.model_list import model_card

Kind = Literal["generate", "embed"]
#: What each kind of model answers, for the error of a request sent to the other kind.
_ENDPOINTS = {"generate": "completions, chat completions and responses", "embed": "embeddings"}


@dataclass(slots=True, frozen=True)
class ServedEntry:
    #: The names clients may send as ``model``; the first is the one responses carry.
    names: tuple[str, ...]
    kind: Kind
    max_model_len: int | None

    @property
    def name(self) -> str:
        return self.names[0]


class ModelRegistry:
    def __init__(self, entries: list[ServedEntry], created: int,
                 details: Callable[[str], dict[str, Any]] = lambda name: {}) -> None:  # fmt: skip
        """``details``: what a model's card adds (a chat model's status and context length,
        ``app/services/model_pool.py``)."""
        self.entries = entries
        self.created = created
        self._details = details

    def cards(self) -> list[dict[str, Any]]:
        return [self.card(name) for entry in self.entries for name in entry.names]

    def card(self, name: str) -> dict[str, Any]:
        entry = self.find(name)
        return {**model_card(name, self.created, entry.max_model_len), **self._details(name)}

    def find(self, name: str) -> ServedEntry:
        for entry in self.entries:
            if name in entry.names:
                return entry
        served = ", ".join(f"`{n}`" for entry in self.entries for n in entry.names)
        raise APIError(404, f"The model `{name}` does not exist. This server serves {served}.", param="model",
                       code="model_not_found")  # fmt: skip

    def route(self, name: str | None, kind: Kind) -> ServedEntry:
        """The model a request for ``kind`` names (no name: the one of that kind); a 404 for an unknown name, a 400
        naming ``model`` for a model of the other kind."""
        if name is None:
            for entry in self.entries:
                if entry.kind == kind:
                    return entry
            raise bad_request(f"this server serves no model for {_ENDPOINTS[kind]}", "model")
        entry = self.find(name)
        if entry.kind != kind:
            raise bad_request(f"`{name}` serves {_ENDPOINTS[entry.kind]}, not {_ENDPOINTS[kind]}", "model")
        return entry
