"""What every endpoint's body goes through: a JSON object whose every string is valid Unicode, typed models
(pydantic v2) whose errors become one 400 naming the field's path, and the small checks of loose fields.

Validation is strict (JSON types as sent: ``"1"`` is not an integer, ``true`` is not a number), JSON null means
absent, and a ``ValidationError`` becomes one 400 in the OpenAI envelope whose ``param`` is the offending
field's path in the body, ``messages[2].tool_calls[0].function.name`` style."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.wire.openai.errors import APIError, bad_request


class WireModel(BaseModel):
    # Unknown keys inside these objects are ignored (clients add their own, e.g. ``name`` on messages); strict
    # types; frozen, so a parsed request cannot be changed on its way through the server.
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


Bounded = Annotated[float, Field(allow_inf_nan=False)]


NonEmpty = Annotated[str, Field(min_length=1)]


TokenId = Annotated[int, Field(ge=0)]


def parse_json_object(raw: bytes, check: Callable[[dict[str, Any]], None] = lambda body: None) -> dict[str, Any]:
    """The request body as a JSON object whose every string is valid Unicode; else a 400. ``check`` runs first, on
    the parsed object: the cheap checks (list lengths) before the walk over every string."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and integers of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check(body)
    _check_unicode(body)
    return body


# JSON may escape half of a UTF-16 surrogate pair ("\udbff") on its own: valid JSON, but no character, so no
# tokenizer can encode it. Every text field arrives through the body, so one check here covers them all.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(body: dict[str, Any]) -> None:
    """A 400 naming the first field (``messages[0].content``) that holds an unpaired surrogate."""
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:  # not recursive: a deeply nested body must not exhaust the stack
        path, value = pending.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                raise bad_request(
                    f"{path} is not valid Unicode: it holds an unpaired surrogate "
                    f"(\\u{ord(found.group()):04x} at character {found.start()})",
                    path,
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    field = path or "the body"
                    raise bad_request(f"a key of {field} is not valid Unicode: it holds an unpaired surrogate", path)
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))


def is_token(value: Any) -> bool:
    """A token id: a non-negative integer (the vocabulary's bound is the server's to check)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` checked by ``model``; a 400 naming the offending field if not."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise _as_bad_request(exc, body) from None


def _as_bad_request(exc: ValidationError, body: dict[str, Any]) -> APIError:
    # Of a union's errors (content is a string, or a list of parts: two errors), the one that got deepest.
    paths = [(_path(error, body), error) for error in exc.errors(include_url=False)]
    depth = max(path.count(".") + path.count("[") for path, _ in paths)
    path, error = next((p, e) for p, e in paths if p.count(".") + p.count("[") == depth)
    message = error["msg"].removeprefix("Value error, ")
    return bad_request(f"{path}: {message}" if path else message, path or None)


def _path(error: Any, value: Any) -> str:
    """The body path of an error's location. Pydantic's ``loc`` also names the union member it tried
    (``str``, ``list[TextPart]``): walking the value itself keeps only the steps that are really there."""
    path, loc = "", error["loc"]
    for step in loc:
        if isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
    missing = loc[-1] if error["type"] == "missing" else (loc[0] if loc and not path else None)
    if isinstance(missing, str):  # a field that is not there (required, or checked although absent)
        path = f"{path}.{missing}" if path else missing
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a tagged union's tag (a tool's ``type``)
        tag = str(error.get("ctx", {}).get("discriminator", "")).strip("'")
        path = f"{path}.{tag}" if path and tag else path
    return path


def token_ids(value: Any, param: str) -> list[int]:
    """``value`` checked to be a list of token ids (non-negative integers; the vocabulary is the caller's)."""
    if not isinstance(value, list) or not all(is_token(t) for t in value):
        raise bad_request(f"{param} must be a list of non-negative integer token ids", param)
    return value


def parse_model(body: dict[str, Any]) -> str | None:
    return optional(body, "model", str, None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "a list"}


def optional(body: dict[str, Any], name: str, kind: type, default: Any, *, param: str | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (JSON null means absent); a wrong type is a 400."""
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise bad_request(f"{name} must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:50]}", param or name)
    return value
