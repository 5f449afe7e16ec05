"""Tool calling: how tools reach the model, the grammar that holds its calls to their schemas, and how the
calls are read back out of the generated text (whole, or delta by delta as they stream). Torch-free.

The call syntax is Hermes's, which Qwen 2.5/3, Hermes and SmolLM3 were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that speaks it (it mentions ``<tool_call>``) gets the tools through its own ``tools``
argument. Any other template (SmolLM2's has no tools section) gets them in a system prompt, ``TOOL_PROMPT``,
ahead of the conversation; earlier calls and tool results are written into the conversation in the same syntax.

The grammar: ``required`` is one call (one or more with ``parallel_tool_calls``) to one of the tools; a named
``tool_choice`` is one call to that tool; ``auto`` lets the model write text, and once it writes ``<tool_call>``
(a lazy trigger, as llama.cpp's lazy grammars) the rest of the call is held to the grammar. Every call's
``arguments`` conform to the tool's ``parameters``, so a returned call always parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from app.schema import Message, Tool
from engine.core.grammar import JSON_STYLE

OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """A chat request's ``tools``, ``tool_choice`` (none, auto, required, or a function's name) and
    ``parallel_tool_calls``."""

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    parallel: bool = True
    named: str | None = None  # the function a named choice calls

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    def offered(self) -> list[Tool]:
        """The tools the model may call: all of them, or the one named."""
        if self.choice != "named":
            return list(self.tools)
        return [tool for tool in self.tools if tool.function.name == self.named]

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the API spells them, for a prompt (``none`` shows the model none)."""
        if not self.calls_allowed:
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.offered()]


# -- into the prompt ---------------------------------------------------------------------------------------


def render(messages: list[Message], calling: ToolCalling | None, native: bool) -> list[dict[str, Any]]:
    """The conversation as a chat template takes it. ``native``: the template renders tools and tool traffic
    itself (arguments as objects, as Hermes-style templates expect); else it is written out as text here."""
    if native:
        return [_native(message) for message in messages]
    turns = _as_text(messages)
    tools = calling.definitions() if calling is not None else []
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if turns[0]["role"] in ("system", "developer"):
            turns[0]["content"] += "\n\n" + prompt
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def _as_text(messages: list[Message]) -> list[dict[str, str]]:
    """Calls in the assistant's turn as the grammar spells them; tool results as one user turn of
    ``<tool_response>`` blocks per run of results, as Qwen's template writes them."""
    turns: list[dict[str, str]] = []
    after_result = False
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if after_result:
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response})
        elif message.tool_calls:
            calls = "\n".join(call_text(call.function.name, call.function.arguments) for call in message.tool_calls)
            turns.append({"role": "assistant", "content": "\n".join(filter(None, [message.text, calls]))})
        else:
            turns.append({"role": message.role, "content": message.text})
        after_result = message.role == "tool"
    return turns


def call_text(name: str, arguments: str) -> str:
    """One call as the grammar spells it (``JSON_STYLE``)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:  # not JSON: passed on as the string it is
        args = json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def _native(message: Message) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _loads(c)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _loads(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


# -- the grammar -------------------------------------------------------------------------------------------


def call_schema(tool: Tool) -> dict[str, Any]:
    """A JSON schema for one call of ``tool``: ``{"name": <its name>, "arguments": <its parameters>}``, in
    that order. The parameters' ``$defs`` move to the root, where their ``#/$defs/...`` references point."""
    parameters = dict(tool.function.parameters)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    parameters.setdefault("type", "object")  # the API's arguments are an object
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,  # as the tool prompt and call_text write calls
        **hoisted,
    }


def grammar(calling: ToolCalling) -> str | None:
    """The Lark grammar (llguidance's dialect) the reply must follow, or None when calls are not allowed."""
    if not calling.calls_allowed:
        return None
    bodies = [f"fn_{i}: %json {json.dumps(call_schema(tool))}" for i, tool in enumerate(calling.offered())]
    call = f'"{OPEN}\\n" body "\\n{CLOSE}"'
    more = ' ("\\n" call)*' if calling.parallel and calling.choice in ("auto", "required") else ""
    if calling.choice == "auto":
        # Text, or text up to the trigger and then calls: the lazy trigger ends at the first "<tool_call>".
        rules = [
            f"start: TEXT | first_call{more}",
            f'first_call: trigger "\\n" body "\\n{CLOSE}"',
            f'trigger[lazy]: TEXT "{OPEN}"',
            "TEXT: /(.|\\n)*/",
        ]
    else:
        rules = [f"start: call{more}"]
    rules += [f"call: {call}", "body: " + " | ".join(f"fn_{i}" for i in range(len(bodies))), *bodies]
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


# -- out of the text ---------------------------------------------------------------------------------------

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallParser:
    """Reads calls out of a reply as it grows. ``feed`` takes the next text and returns the content (text
    outside calls) it can release and the ``tool_calls`` stream deltas: a call's first delta carries its id,
    type and name, later ones fragments of its arguments, which concatenate to the whole. Fed the same text
    in any split, it releases the same content and calls."""

    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: str = "text"  # text -> head -> arguments -> tail -> text
    _depth: int = 0  # JSON nesting inside the arguments
    _in_string: bool = False
    _escaped: bool = False
    _said: bool = False  # content other than white space has been released

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += text
        released: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._pending and getattr(self, f"_{self._state}")(released, deltas):
            pass
        self.content += released
        return "".join(released), deltas

    def finish(self) -> str:
        """At the end of the reply: text held back in case it began a call is content after all (a call
        cut short by ``max_tokens`` keeps the arguments it has)."""
        rest = ""
        if self._state == "text":
            rest = self._pending if not self.calls or self._pending.strip() else ""
        elif self._state == "head":
            rest = OPEN + self._pending
        self._pending = ""
        self.content.append(rest)
        return rest

    @property
    def text(self) -> str | None:
        """The reply's content: None when it made calls and said nothing else."""
        content = "".join(self.content)
        return None if self.calls and not content else content

    def _text(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        start = self._pending.find(OPEN)
        if start < 0:
            cut = len(self._pending) - _partial_suffix(self._pending, OPEN)
            if self._said or self._pending[:cut].strip():  # leading white space waits: a call may follow
                self._release(self._pending[:cut], released)
                self._pending = self._pending[cut:]
            return False
        self._release(self._pending[:start], released)
        self._pending = self._pending[start + len(OPEN) :]
        self._state = "head"
        return True

    def _release(self, text: str, released: list[str]) -> None:
        """Content, but not white space before the first call or between calls."""
        if text.strip() or (text and self._said and not self.calls):
            released.append(text)
            self._said = True

    def _head(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        match = _HEAD.match(self._pending)
        if match is None:
            return False  # wait for more text
        call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(match.group(1)))
        deltas.append({"index": len(self.calls), **call.as_dict()})
        self.calls.append(call)
        self._pending = self._pending[match.end() :]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _arguments(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        """Scans the arguments' JSON character by character: they end where their outermost value closes."""
        if not self.calls[-1].arguments:
            self._pending = self._pending.lstrip()  # the space after "arguments": may come in a later piece
            if not self._pending:
                return False
        end = None
        for i, char in enumerate(self._pending):
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        fragment = self._pending[:end] if end is not None else self._pending
        if fragment:
            self.calls[-1].arguments += fragment
            _add_arguments(deltas, len(self.calls) - 1, fragment)
        self._pending = self._pending[len(fragment) :]
        if end is None:
            return False
        self._state = "tail"
        return True

    def _tail(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        end = self._pending.find(CLOSE)
        if end < 0:
            return False
        self._pending = self._pending[end + len(CLOSE) :]
        self._state = "text"
        return True


def _add_arguments(deltas: list[dict[str, Any]], index: int, fragment: str) -> None:
    """One delta per call per chunk: a fragment joins the call's delta already in this chunk, if any."""
    if deltas and deltas[-1]["index"] == index:
        deltas[-1]["function"]["arguments"] += fragment
    else:
        deltas.append({"index": index, "function": {"arguments": fragment}})


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
