"""Calls read back out of a reply's text, whole or delta by delta as it streams, in the model's family's syntax
(``app/pipeline/tools/syntax.py``): the text keeps the spelling of the markers the model wrote as special tokens."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from app.pipeline.tools.syntax import HERMES, ToolSyntax

# A call's object up to its arguments' value (a mistral call may open the array; llama3 says "parameters").
# A bare call may come in a JSON code fence. Every quantifier is possessive: with plain ``\s*`` runs side by side a
# head of white space that never matched was tried at every split, each token (8,000 spaces: 460 s).
_OBJECT = r'\s*+(?:```json\s*+)?+\[?+\s*+\{\s*+"name"\s*+:\s*+'
_NAMED_HEAD = re.compile(_OBJECT + r'("(?:[^"\\]|\\.)*+")')
_HEAD = re.compile(_OBJECT + r'("(?:[^"\\]|\\.)*+")\s*+,\s*+"(?:arguments|parameters)"\s*+:\s*+')
#: The longest head (``{"name": "...", "arguments": ``) waited for; past it the call is malformed and is content
#: (each token re-reads the head, so what it may hold is bounded).
MAX_HEAD = 1024
#: What a reply that is a bare call begins with (white space aside): its object, or a JSON code fence around it.
_CALL_STARTS = ('{"name":"', '```json{"name":"')


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class CallReading:
    """What every family's reader of calls shares (``ToolCallParser``, ``xml_parser.XmlCallParser``,
    ``pythonic_parser.PythonicCallParser``): ``feed`` moves the reader's state machine (``_advance``) over the text
    so far; content is released, but not white space before the first call or between calls; ``text``."""

    __slots__ = ()
    calls: list[ParsedCall]
    content: list[str]
    _pending: str
    _said: bool

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._pending += text
        released: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._pending and self._advance(released, deltas):
            pass
        self.content += released
        return "".join(released), deltas

    def _advance(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        """One move of the state machine over the pending text; False when it must wait for more."""
        raise NotImplementedError

    @property
    def text(self) -> str | None:
        """The reply's content: None when it made calls and said nothing else."""
        content = "".join(self.content)
        return None if self.calls and not content else content

    def _release(self, text: str, released: list[str]) -> None:
        """Content, but not white space before the first call or between calls."""
        if text.strip() or (text and self._said and not self.calls):
            released.append(text)
            self._said = True


class BlockReading(CallReading):
    """A reader of calls in blocks between two markers, read when a block closes (LFM2's, Gemma 4's): text outside
    the blocks is content (white space between calls held back); a block that does not parse (``_block_calls``
    raises ValueError) is content as written; one cut short is no call."""

    __slots__ = ()
    OPEN: str
    CLOSE: str
    _state: Literal["text", "block"]

    def _block_calls(self, block: str) -> list[tuple[str, dict[str, Any]]]:
        """A block's calls: each name and its arguments; a ValueError where it holds none."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: text held back in case it began a block is content; a block cut short is no call."""
        rest = self._pending if self._state == "text" and (not self.calls or self._pending.strip()) else ""
        self._pending = ""
        self.content.append(rest)
        return rest, []

    def _advance(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        opening, closing = self.OPEN, self.CLOSE
        if self._state == "text":
            at = self._pending.find(opening)
            if at < 0:
                ready = self._pending[: len(self._pending) - partial_suffix(self._pending, opening)]
                if ready.strip() or (self._said and not self.calls):  # (white space waits for what follows it)
                    self._release(ready, released)
                    self._pending = self._pending[len(ready) :]
                return False
            self._release(self._pending[:at], released)
            self._pending, self._state = self._pending[at + len(opening) :], "block"
            return True
        end = self._pending.find(closing)
        if end < 0:
            return False
        block, self._pending, self._state = self._pending[:end], self._pending[end + len(closing) :], "text"
        try:
            calls = self._block_calls(block)
        except ValueError:  # not calls: what the model wrote is content
            self._said = True
            self._release(opening + block + closing, released)
            return True
        for name, arguments in calls:
            call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))
            deltas.append({"index": len(self.calls), **call.as_dict()})
            self.calls.append(call)
        return True


@dataclass(slots=True)
class ToolCallParser(CallReading):
    """Reads calls out of a reply as it grows. ``feed`` takes the next text and returns the content (text
    outside calls) it can release and the ``tool_calls`` stream deltas: a call's first delta carries its id,
    type and name, later ones fragments of its arguments, which concatenate to the whole. Fed the same text
    in any split, it releases the same content and calls."""

    syntax: ToolSyntax = HERMES
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: Literal["text", "head", "arguments", "tail"] = "text"  # text -> head -> arguments -> tail -> text
    _depth: int = 0  # JSON nesting inside the arguments
    _in_string: bool = False
    _escaped: bool = False
    _said: bool = False  # content other than white space has been released
    _bare: bool = False  # the calls began the reply without the marker (``ToolSyntax.at_start``)
    _blank: int = 0  # the pending text's start known to be white space holding no marker

    def _advance(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        match self._state:
            case "text":
                return self._text(released)
            case "head":
                return self._head(released, deltas)
            case "arguments":
                return self._arguments(deltas)
            case "tail":
                return self._tail()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the reply: the content and call deltas still held back. Text held back in case it began
        a call is content after all; a call cut short by ``max_tokens`` is a call with what it has: the arguments
        so far, or, cut inside its head after the name, no arguments; a call whose name was cut is no call (a name
        the client cannot match), and never its syntax as text."""
        rest, deltas = "", []
        if self._state == "text":
            rest = self._pending if not self.calls or self._pending.strip() else ""
        elif self._state == "head" and (name := _whole_name(self._pending)):
            call = ParsedCall(self._new_id(), name)
            deltas.append({"index": len(self.calls), **call.as_dict()})
            self.calls.append(call)
        self._pending = ""
        self.content.append(rest)
        return rest, deltas

    def _text(self, released: list[str]) -> bool:
        if self.syntax.at_start and not self._said and not self.calls:
            begun = self._begins_call()
            if begun is not None:
                return begun
        start = self._pending.find(self.syntax.open, self._blank)
        if start < 0:
            cut = len(self._pending) - partial_suffix(self._pending, self.syntax.open)
            if self._said or self._pending[self._blank : cut].strip():  # leading white space waits: a call may follow
                self._release(self._pending[:cut], released)
                self._pending, self._blank = self._pending[cut:], 0
            else:  # white space without a marker: not read again at the next token
                self._blank = cut
            return False
        self._release(self._pending[:start], released)
        self._pending, self._blank = self._pending[start + len(self.syntax.open) :], 0
        self._state = "head"
        return True

    def _begins_call(self) -> bool | None:
        """Before anything is said: a reply that begins ``{"name": "`` is a call (True: its head is next);
        False: it may yet (wait); None: it is text."""
        squeezed = "".join(self._pending[:MAX_HEAD].split())
        if squeezed.startswith(_CALL_STARTS):
            self._state, self._bare, self._blank = "head", True, 0
            return True
        if len(self._pending) > MAX_HEAD:
            return None
        return False if any(start.startswith(squeezed) for start in _CALL_STARTS) else None

    def _new_id(self) -> str:
        """A call's id; as the template requires where it does (mistral: 9 letters and digits)."""
        if self.syntax.id_length:
            return uuid.uuid4().hex[: self.syntax.id_length]
        return f"call_{uuid.uuid4().hex[:24]}"

    def _head(self, released: list[str], deltas: list[dict[str, Any]]) -> bool:
        match = _HEAD.match(self._pending)
        if match is None and len(self._pending) > MAX_HEAD:  # no call: what was held is content
            self._said = True
            self._release(("" if self._bare else self.syntax.open) + self._pending, released)
            self._pending, self._state = "", "text"
            return True
        if match is None:
            return False  # wait for more text
        call = ParsedCall(self._new_id(), _json_string(match.group(1)))
        deltas.append({"index": len(self.calls), **call.as_dict()})
        self.calls.append(call)
        self._pending = self._pending[match.end() :]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False
        return True

    def _arguments(self, deltas: list[dict[str, Any]]) -> bool:
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
            add_arguments(deltas, len(self.calls) - 1, fragment)
        self._pending = self._pending[len(fragment) :]
        if end is None:
            return False
        self._state = "tail"
        return True

    def _tail(self) -> bool:
        """After a call's arguments: hermes, to the end of its block; else to the next call (the separator), the
        end of mistral's array, or text."""
        if self.syntax.close and not self._bare:
            end = self._pending.find(self.syntax.close)
            if end < 0:  # what comes before the block's end is dropped: keep only what may begin it
                self._pending = self._pending[len(self._pending) - partial_suffix(self._pending, self.syntax.close) :]
                return False
            self._pending = self._pending[end + len(self.syntax.close) :]
            self._state = "text"
            return True
        rest = self._pending.lstrip()
        if rest[:1] == "}":
            rest = rest[1:].lstrip()
        if self._bare and rest.startswith("`"):  # the code fence's end
            if len(rest) < 3:
                return False
            rest = rest.removeprefix("```").lstrip()
        if not rest:
            return False
        if rest[0] == self.syntax.separator.strip():
            self._pending, self._state = rest[1:], "head"
        else:
            self._pending, self._state = rest[1:] if self.syntax.array and rest[0] == "]" else rest, "text"
        return True


def _whole_name(head: str) -> str:
    """The function name in a call's head cut short after it (``{"name": "get_weather", "argu``); "" where the cut
    fell inside the name (``{"name": "get_wea``)."""
    match = _NAMED_HEAD.match(head)
    return _json_string(match.group(1)) if match else ""


def _json_string(literal: str) -> str:
    """A JSON string literal's value; one with a broken escape (``"a\\u12"``) as written, quotes aside."""
    try:
        return json.loads(literal)
    except ValueError:
        return literal[1:-1]


def add_arguments(deltas: list[dict[str, Any]], index: int, fragment: str) -> None:
    """One delta per call per chunk: a fragment joins the call's delta already in this chunk, if any."""
    if deltas and deltas[-1]["index"] == index:
        deltas[-1]["function"]["arguments"] += fragment
    else:
        deltas.append({"index": index, "function": {"arguments": fragment}})


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
