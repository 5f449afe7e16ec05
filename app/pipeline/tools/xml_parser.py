"""Calls in Qwen3-Coder's and Qwen3.5's XML syntax read back out of a reply, whole or delta by delta as it streams::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Each parameter's value is text (one line break after its opening tag and one before its closing tag are the
syntax's); the call's ``arguments`` are the JSON object of its parameters, each value read as its tool's schema
types it: a string as the text itself, any other type as the JSON the text spells (as vLLM's and llama.cpp's
parsers of the family read it; text that is no such JSON stays a string). A string value streams as it comes;
another value is released whole at its closing tag. Torch-free."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from app.pipeline.tools.parser import MAX_HEAD, CallReading, ParsedCall, add_arguments, partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"\s*+<(function|parameter)=([^>\n]*+)>")


def parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Each tool's parameters' JSON types by name (``"string"`` read as text; absent: text too), from the tools'
    definitions as the API spells them."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {name: _type(schema) for name, schema in properties.items()}
    return types


def _type(schema: Any) -> str:
    """A property's type: its ``type`` (the first that is not null), else ``enum``'s values' kind, else text."""
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None and schema.get("enum"):
        kind = "string" if all(isinstance(v, str) for v in schema["enum"]) else "any"
    return kind if isinstance(kind, str) else "any"


@dataclass(slots=True)
class XmlCallParser(CallReading):
    """``ToolCallParser``'s interface for the XML syntax: ``feed`` returns the content it can release and the
    ``tool_calls`` deltas (a call's first carries its id and name, later ones fragments of its arguments' JSON,
    which concatenate to the whole). Fed the same text in any split, it releases the same content and calls."""

    types: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: Literal["text", "function", "parameters", "value", "tail"] = "text"
    _said: bool = False  # content other than white space has been released
    _parameter: str = ""  # the parameter whose value is being read
    _fresh: bool = True  # nothing of the value read yet (its opening line break is the syntax's)
    _streamed: bool = False  # some of a string value has been released
    _value: list[str] = field(default_factory=list)  # a value that is not text, until it closes

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the reply: text held back in case it began a call is content after all; a call cut short
        by ``max_tokens`` keeps what it has, its arguments closed where a value was cut (a call whose name was cut
        is no call)."""
        rest, deltas = "", []
        if self._state == "text":
            rest = self._pending if not self.calls or self._pending.strip() else ""
        elif self._state == "value":
            self._close_value(self._pending, deltas)
            self._emit("}", deltas)
        elif self._state == "parameters":
            self._emit("}" if self.calls[-1].arguments else "{}", deltas)
        self._pending = ""
        self.content.append(rest)
        return rest, deltas

    def _advance(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        match self._state:
            case "text":
                return self._text(released)
            case "function":
                return self._function(released, deltas)
            case "parameters":
                return self._parameters(deltas)
            case "value":
                return self._read_value(deltas)
            case "tail":
                return self._tail()

    def _text(self, released: list[str]) -> bool:
        """Content up to a call: ``<tool_call>``, or a ``<function=`` the model wrote without it."""
        starts = [(at, marker) for marker in (OPEN, FUNCTION) if (at := self._pending.find(marker)) >= 0]
        if not starts:
            held = max(partial_suffix(self._pending, OPEN), partial_suffix(self._pending, FUNCTION))
            ready = self._pending[: len(self._pending) - held]
            if ready.strip() or (self._said and not self.calls):  # (white space waits for what follows it)
                self._release(ready, released)
                self._pending = self._pending[len(ready) :]
            return False
        at, marker = min(starts)
        self._release(self._pending[:at], released)
        self._pending = self._pending[at + len(OPEN) :] if marker == OPEN else self._pending[at:]
        self._state = "function"
        return True

    def _function(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        """After the call's opening: its function's name, or (no such tag) content after all."""
        match = _NAME.match(self._pending)
        if match is None or match.group(1) != "function":
            if match is None and _may_open(self._pending.lstrip(), (FUNCTION,)):
                return False  # wait for the name's end
            self._said = True
            self._release(OPEN + self._pending, released)
            self._pending, self._state = "", "text"
            return True
        call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", match.group(2).strip())
        deltas.append({"index": len(self.calls), **call.as_dict()})
        self.calls.append(call)
        self._pending, self._state = self._pending[match.end() :], "parameters"
        return True

    def _parameters(self, deltas: list[dict[str, Any]]) -> bool:
        """Between parameters: the next one's name, or the function's end (or the call's, where the model left
        the function's out); anything else inside a call is dropped up to the next tag."""
        stripped = self._pending.lstrip()
        for end in (FUNCTION_END, CLOSE):
            if stripped.startswith(end):
                self._emit("}" if self.calls[-1].arguments else "{}", deltas)
                self._pending = stripped[len(end) :]
                self._state = "tail" if end == FUNCTION_END else "text"
                return True
        match = _NAME.match(self._pending)
        if match is not None and match.group(1) == "parameter":
            name = match.group(2).strip()
            opening = "{" if not self.calls[-1].arguments else ", "
            self._emit(opening + json.dumps(name, ensure_ascii=False) + ": ", deltas)
            self._pending, self._state, self._parameter = self._pending[match.end() :], "value", name
            self._fresh, self._streamed, self._value = True, False, []
            return True
        if _may_open(stripped, (PARAMETER, FUNCTION_END, CLOSE)):
            return False
        after = stripped.find("<", 1)
        self._pending = stripped[after:] if after > 0 else ""
        return bool(self._pending)

    def _read_value(self, deltas: list[dict[str, Any]]) -> bool:
        """A value up to its closing tag (or the function's end, where the model left the tag out)."""
        ends = [at for marker in (PARAMETER_END, FUNCTION_END) if (at := self._pending.find(marker)) >= 0]
        if not ends:
            if self._fresh and self._pending == "\n":
                return False  # the line break after the opening tag: the syntax's if text follows
            held = max(partial_suffix(self._pending, PARAMETER_END), partial_suffix(self._pending, FUNCTION_END))
            ready = self._pending[: len(self._pending) - held]
            ready = ready.removesuffix("\n")  # the line break before the closing tag is the syntax's
            self._take(ready, deltas)
            self._pending = self._pending[len(ready) :]
            return False
        end = min(ends)
        self._close_value(self._pending[:end], deltas)
        rest = self._pending[end:]
        self._pending = rest.removeprefix(PARAMETER_END)
        self._state = "parameters"
        return True

    def _take(self, text: str, deltas: list[dict[str, Any]]) -> None:
        """More of the value: a string's streams, another's waits for its end."""
        if self._fresh and text:
            text, self._fresh = text.removeprefix("\n"), False
        if not text:
            return
        if self._kind() == "string":
            self._emit(('"' if not self._streamed else "") + json.dumps(text, ensure_ascii=False)[1:-1], deltas)
            self._streamed = True
        else:
            self._value.append(text)

    def _close_value(self, text: str, deltas: list[dict[str, Any]]) -> None:
        """The value's last text (its closing line break dropped), and its JSON closed."""
        self._take(text.removesuffix("\n"), deltas)
        if self._kind() == "string":
            self._emit('"' if self._streamed else '""', deltas)
            return
        self._emit(_json_value("".join(self._value), self._kind()), deltas)

    def _kind(self) -> str:
        return self.types.get(self.calls[-1].name, {}).get(self._parameter, "string")

    def _emit(self, fragment: str, deltas: list[dict[str, Any]]) -> None:
        self.calls[-1].arguments += fragment
        add_arguments(deltas, len(self.calls) - 1, fragment)

    def _tail(self) -> bool:
        """After a function: to the end of its ``</tool_call>``, then text."""
        stripped = self._pending.lstrip()
        if not stripped or (CLOSE.startswith(stripped) and len(stripped) < len(CLOSE)):
            return False
        self._pending = stripped.removeprefix(CLOSE)
        self._state = "text"
        return True


def _may_open(text: str, tags: tuple[str, ...]) -> bool:
    """Whether ``text`` may yet become one of ``tags`` (a prefix of one, or one whose name has not ended)."""
    if len(text) > MAX_HEAD:
        return False
    return any(tag.startswith(text) or (text.startswith(tag) and ">" not in text) for tag in tags)


def _json_value(text: str, kind: str) -> str:
    """A value that is not text, as JSON: what the text spells where it is JSON (``True``/``False`` as booleans,
    as Python writes them), else the text as a string."""
    text = text.strip()
    if kind == "boolean" and text in ("True", "False"):
        text = text.lower()
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
