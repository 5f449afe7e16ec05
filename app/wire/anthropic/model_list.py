"""The wire format of ``GET /v1/models`` as the Anthropic API answers it (a request that carries
``anthropic-version``, as the anthropic SDK's ``client.models.list()`` / ``retrieve()`` send): model objects and the
list's page (``limit``, ``after_id``, ``before_id``; ``has_more``, ``first_id``, ``last_id``)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from app.wire.openai.errors import bad_request

#: The header that marks a request as the Anthropic API's.
VERSION_HEADER = "anthropic-version"
DEFAULT_LIMIT, MAX_LIMIT = 20, 1000


def model_info(name: str, created: int) -> dict[str, Any]:
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp}


def model_page(names: list[str], created: int, query: Mapping[str, str]) -> dict[str, Any]:
    """One page of the served models' names, in the order served (Anthropic's: newest first; here all were
    made together)."""
    limit = _limit(query.get("limit"))
    if "before_id" in query:  # the page just before it; more: there are models before the page
        end = _index(names, query["before_id"], "before_id")
        start = max(end - limit, 0)
        page, more = names[start:end], start > 0
    else:  # from the start, or just after ``after_id``; more: there are models after the page
        start = _index(names, query["after_id"], "after_id") + 1 if "after_id" in query else 0
        page, more = names[start : start + limit], start + limit < len(names)
    data = [model_info(name, created) for name in page]
    return {"data": data, "has_more": more, "first_id": page[0] if page else None,
            "last_id": page[-1] if page else None}  # fmt: skip


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise bad_request(f"limit: an integer from 1 to {MAX_LIMIT}", "limit")
    return int(raw)


def _index(names: list[str], name: str, param: str) -> int:
    if name not in names:
        raise bad_request(f"{param}: no model `{name}` is served", param)
    return names.index(name)
