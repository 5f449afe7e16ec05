"""The wire format of ``/v1/models``: the served model's card, and the list of them."""

from __future__ import annotations

from typing import Any


def model_card(name: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "smolserve", "max_model_len": max_model_len}


def model_list(cards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": cards}
