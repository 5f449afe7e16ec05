"""Calls in Gemma 4's syntax read back out of a reply::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,metric:true}<tool_call|>

One block a call, one after another. A call's arguments are an object in Gemma's own notation: keys bare (what is
up to the ``:``), strings between ``<|"|>`` marks (their text as it is, no escapes), numbers, ``true``, ``false``
and ``null`` as JSON writes them, arrays in ``[...]``, objects in ``{...}``; as llama.cpp's parser of the family
reads them. A block is read when it closes: each call's arguments come as one JSON object, whole. A block that
does not parse as a call is content; one cut by ``max_tokens`` is no call. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from app.pipeline.tools.parser import BlockReading, ParsedCall

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NAMED = {"true": True, "false": False, "null": None}
#: How deep a value may nest (a reply is not trusted to end its brackets).
_DEPTH = 64


@dataclass(slots=True)
class GemmaCallParser(BlockReading):
    """``ToolCallParser``'s interface for Gemma 4's syntax: ``feed`` returns the content it can release and the
    ``tool_calls`` deltas (each call whole). Fed the same text in any split, it releases the same content and
    calls."""

    OPEN: ClassVar[str] = OPEN
    CLOSE: ClassVar[str] = CLOSE
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: Literal["text", "block"] = "text"
    _said: bool = False

    def _block_calls(self, block: str) -> list[tuple[str, dict[str, Any]]]:
        return [parse_call(block)]


def parse_call(block: str) -> tuple[str, dict[str, Any]]:
    """A block's call, ``call:NAME{key:value,...}``: its name and arguments; a ValueError where it is not that."""
    if not block.startswith("call:") or "{" not in block:
        raise ValueError("not a call")
    head = block.index("{")
    name = block[len("call:") : head].strip()
    if not name:
        raise ValueError("a call without a name")
    arguments, end = _value(block, head, 0)
    if block[end:].strip():
        raise ValueError("text after the call's arguments")
    assert isinstance(arguments, dict)
    return name, arguments


def _value(text: str, at: int, depth: int) -> tuple[Any, int]:
    """The value that begins at ``at`` (white space before it skipped) and where it ends."""
    if depth > _DEPTH:
        raise ValueError("arguments nested too deep")
    at = _skip(text, at)
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("a string without its end")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", at):
        return _members(text, at + 1, depth)
    if text.startswith("[", at):
        return _items(text, at + 1, depth)
    for word, value in _NAMED.items():
        if text.startswith(word, at):
            return value, at + len(word)
    number = _NUMBER.match(text, at)
    if number is None:
        raise ValueError(f"no value at {at}")
    literal = number.group()
    return (float(literal) if any(c in literal for c in ".eE") else int(literal)), number.end()


def _members(text: str, at: int, depth: int) -> tuple[dict[str, Any], int]:
    """An object's members after its ``{``, up to its ``}``: ``key:value`` (a key bare, or between quote marks)."""
    members: dict[str, Any] = {}
    at = _skip(text, at)
    if text.startswith("}", at):
        return members, at + 1
    while True:
        if text.startswith(QUOTE, at):
            key, at = _value(text, at, depth + 1)
            if not text.startswith(":", at):
                raise ValueError("a key without its value")
        else:
            colon = text.find(":", at)
            if colon < 0 or "}" in text[at:colon]:
                raise ValueError("a key without its value")
            key, at = text[at:colon].strip(), colon
        members[str(key)], at = _value(text, at + 1, depth + 1)
        at = _skip(text, at)
        if text.startswith("}", at):
            return members, at + 1
        if not text.startswith(",", at):
            raise ValueError("members not separated by commas")
        at = _skip(text, at + 1)


def _items(text: str, at: int, depth: int) -> tuple[list[Any], int]:
    """An array's items after its ``[``, up to its ``]``."""
    items: list[Any] = []
    at = _skip(text, at)
    if text.startswith("]", at):
        return items, at + 1
    while True:
        item, at = _value(text, at, depth + 1)
        items.append(item)
        at = _skip(text, at)
        if text.startswith("]", at):
            return items, at + 1
        if not text.startswith(",", at):
            raise ValueError("items not separated by commas")
        at += 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
