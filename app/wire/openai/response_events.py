"""A response's output as it is generated: output items (an assistant message, function calls) built from the text
deltas, and the stream events of the Responses API, numbered from 0 (``sequence_number``).

The same builder makes a whole response's output (the text fed at once), so that a streamed response and a whole
one have the same items. With tools, the text goes through the call parser (``app/pipeline/tools/parser.py``): content
opens a message item, each call a ``function_call`` item whose arguments stream as deltas (a custom tool's call a
``custom_tool_call`` item, its input sent whole once the call is: the model writes it JSON-escaped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.pipeline.reply import Reader, Reading
from app.wire.openai.chat import token_logprobs
from app.wire.openai.responses import call_item, message_item, new_id, output_text_part, reasoning_item
from engine.core.tokenizer import Tokenizer
from engine.core.types import FinishReason, TokenLogprob


@dataclass(slots=True)
class _Message:
    item_id: str
    output_index: int
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class _Call:
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class ResponseEvents:
    """Feed it the deltas of one sequence; it returns the events each one makes, and keeps the output items."""

    tokenizer: Tokenizer
    #: How the reply is read (``app/pipeline/reply.py``): its reasoning, content and calls.
    reading: Reading
    #: ``include: ["message.output_text.logprobs"]``: the output text's logprobs, in items and deltas.
    logprobs: bool
    #: A namespace's functions by the name the model was offered (``call_item``).
    namespaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: The custom tools' names: their calls are ``custom_tool_call`` items, their input streamed when whole.
    custom: frozenset[str] = frozenset()
    #: ``include: ["reasoning.encrypted_content"]``: reasoning items carry it.
    encrypted_reasoning: bool = False
    output: list[dict[str, Any]] = field(default_factory=list)
    sequence_number: int = 0
    _reader: Reader | None = None
    _thought: _Message | None = None  # the reasoning item, while open
    _message: _Message | None = None
    _call: _Call | None = None

    def __post_init__(self) -> None:
        self._reader = self.reading.reader()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def feed(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        """The events of the next piece of generated text."""
        entries = token_logprobs(self.tokenizer, logprobs or []) if self.logprobs else []
        assert self._reader is not None
        piece = self._reader.feed(text)
        return self._reasoning(piece.reasoning) + self._text(piece.content, entries) + self._calls(piece.calls)

    def finish(self, finish_reason: FinishReason | None) -> list[dict[str, Any]]:
        """The events that close the output: what the parser held back, then each open item, done."""
        assert self._reader is not None
        piece = self._reader.finish()
        events = self._reasoning(piece.reasoning) + self._text(piece.content, []) + self._calls(piece.calls)
        status = "incomplete" if finish_reason == "length" else "completed"
        return events + self._close_reasoning(status) + self._close_message(status) + self._close_call(status)

    # -- items ------------------------------------------------------------------------------------------

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """A reasoning item (it comes first), its ``reasoning_text`` part streamed as deltas."""
        if not text:
            return []
        events: list[dict[str, Any]] = []
        thought = self._thought
        if thought is None:
            thought = self._thought = _Message(new_id("rs"), len(self.output))
            self.output.append(reasoning_item(thought.item_id, "", "in_progress"))
            events.append(self._item_event("response.output_item.added", thought.output_index))
            events.append(self.event("response.content_part.added", item_id=thought.item_id,
                                     output_index=thought.output_index, content_index=0,
                                     part={"type": "reasoning_text", "text": ""}))  # fmt: skip
        thought.text += text
        events.append(self.event("response.reasoning_text.delta", item_id=thought.item_id,
                                 output_index=thought.output_index, content_index=0, delta=text))  # fmt: skip
        return events

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        thought, self._thought = self._thought, None
        if thought is None:
            return []
        item = reasoning_item(thought.item_id, thought.text, status, self.encrypted_reasoning)
        self.output[thought.output_index] = item
        where = {"item_id": thought.item_id, "output_index": thought.output_index, "content_index": 0}
        return [
            self.event("response.reasoning_text.done", **where, text=thought.text),
            self.event("response.content_part.done", **where, part=item["content"][0]),
            self._item_event("response.output_item.done", thought.output_index),
        ]

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._close_reasoning("completed") + self._close_call("completed")
        message = self._message
        if message is None:
            message = self._message = _Message(new_id("msg"), len(self.output))
            self.output.append(message_item(message.item_id, "", "in_progress", None))
            events.append(self._item_event("response.output_item.added", message.output_index))
            part = output_text_part("")
            events.append(self.event("response.content_part.added", item_id=message.item_id,
                                     output_index=message.output_index, content_index=0, part=part))  # fmt: skip
        message.text += text
        message.logprobs += logprobs
        delta_logprobs = [{key: entry[key] for key in ("token", "logprob", "top_logprobs")} for entry in logprobs]
        events.append(self.event("response.output_text.delta", item_id=message.item_id,
                                 output_index=message.output_index, content_index=0, delta=text,
                                 logprobs=delta_logprobs))  # fmt: skip
        return events

    def _calls(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if "id" in delta:  # a new call: its head
                events += self._close_reasoning("completed") + self._close_message("completed")
                events += self._close_call("completed")
                function = delta["function"]
                prefix = "ctc" if function["name"] in self.custom else "fc"
                call = self._call = _Call(new_id(prefix), len(self.output), delta["id"], function["name"])
                self.output.append(self._call_item(call, "in_progress"))
                events.append(self._item_event("response.output_item.added", call.output_index))
                fragment = function.get("arguments") or ""
            else:
                fragment = delta["function"]["arguments"]
            call = self._call
            assert call is not None, "arguments come after their call's head"
            call.arguments += fragment
            if fragment and call.name not in self.custom:
                events.append(self.event("response.function_call_arguments.delta", item_id=call.item_id,
                                         output_index=call.output_index, delta=fragment))  # fmt: skip
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        logprobs = message.logprobs if self.logprobs else None
        item = self.output[message.output_index] = message_item(message.item_id, message.text, status, logprobs)
        delta_logprobs = [{key: entry[key] for key in ("token", "logprob", "top_logprobs")} for entry in logprobs or []]
        where = {"item_id": message.item_id, "output_index": message.output_index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=message.text, logprobs=delta_logprobs),
            self.event("response.content_part.done", **where, part=item["content"][0]),
            self._item_event("response.output_item.done", message.output_index),
        ]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        call, self._call = self._call, None
        if call is None:
            return []
        item = self.output[call.output_index] = self._call_item(call, status)
        if item["type"] == "custom_tool_call":
            where = {"item_id": call.item_id, "output_index": call.output_index}
            return [
                self.event("response.custom_tool_call_input.delta", **where, delta=item["input"]),
                self.event("response.custom_tool_call_input.done", **where, input=item["input"]),
                self._item_event("response.output_item.done", call.output_index),
            ]
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=call.item_id,
                output_index=call.output_index,
                name=item["name"],
                arguments=call.arguments,
            ),
            self._item_event("response.output_item.done", call.output_index),
        ]

    def _call_item(self, call: _Call, status: str) -> dict[str, Any]:
        return call_item(call.item_id, call.call_id, call.name, call.arguments, status, self.namespaced, self.custom)

    def _item_event(self, kind: str, output_index: int) -> dict[str, Any]:
        return self.event(kind, output_index=output_index, item=self.output[output_index])
