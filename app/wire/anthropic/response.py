"""A Messages API reply as it is generated: content blocks (``thinking``, ``text``, ``tool_use``) built from the
text deltas through the family's reader (``app/pipeline/reply.py``), and the stream's events (``content_block_start``,
``content_block_delta`` with ``thinking_delta`` / ``text_delta`` / ``input_json_delta``, ``content_block_stop``).
The same builder makes a whole message (the text fed at once), so a streamed reply and a whole one have the same
blocks.

``stop_sequences`` run with the stop string kept in the text (``include_stop``): a reply that ends in one ends with
``stop_reason: "stop_sequence"`` and names it, the string itself left out, as Anthropic answers."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.pipeline.reply import Reader, Reading
from engine.core.types import FinishReason


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class MessageBuilder:
    reading: Reading
    stop: tuple[str, ...] = ()
    blocks: list[dict[str, Any]] = field(default_factory=list)
    stop_sequence: str | None = None
    _reader: Reader | None = None
    _open: str | None = None  # the type of the block being written
    _calls: dict[int, int] = field(default_factory=dict)  # the parser's call index -> block index
    _arguments: dict[int, str] = field(default_factory=dict)  # block index -> its input's JSON so far

    def __post_init__(self) -> None:
        self._reader = self.reading.reader()

    def feed(self, text: str, last: bool = False) -> list[dict[str, Any]]:
        """The events of the next piece of text; ``last``: the reply ended with it (where a stop string ends)."""
        assert self._reader is not None
        if last:
            text = self._without_stop(text)
        piece = self._reader.feed(text)
        events = self._write("thinking", piece.reasoning) + self._write("text", piece.content)
        events += self._tool_calls(piece.calls)
        if last:
            rest = self._reader.finish()
            events += self._write("thinking", rest.reasoning) + self._write("text", rest.content)
            events += self._tool_calls(rest.calls) + self._close()
        return events

    def stop_reason(self, finish_reason: FinishReason | None) -> str:
        if finish_reason == "length":
            return "max_tokens"
        if self.stop_sequence is not None:
            return "stop_sequence"
        return "tool_use" if self._calls else "end_turn"

    def _without_stop(self, text: str) -> str:
        for stop in sorted(self.stop, key=len, reverse=True):
            if stop and text.endswith(stop):
                self.stop_sequence = stop
                return text[: -len(stop)]
        return text

    def _write(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = [] if self._open == kind else self._close() + self._start({"type": kind, kind: text[:0]})
        block = self.blocks[-1]
        block[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        if block["type"] == "thinking":
            block["signature"] = ""  # no signature: these blocks are not Anthropic's to verify
        self.blocks.append(block)
        self._open = block["type"]
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index = len(self.blocks) - 1
        if self._open == "tool_use":
            self.blocks[index]["input"] = _input(self._arguments.get(index, ""))
        self._open = None
        return [{"type": "content_block_stop", "index": index}]

    def _tool_calls(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if "id" in delta:  # a new call: its block
                events += self._close() + self._start(
                    {"type": "tool_use", "id": new_id("toolu"), "name": delta["function"]["name"], "input": {}}
                )
                self._calls[delta["index"]] = len(self.blocks) - 1
            fragment = delta["function"].get("arguments") or ""
            if fragment:
                index = self._calls[delta["index"]]
                self._arguments[index] = self._arguments.get(index, "") + fragment
                partial = {"type": "input_json_delta", "partial_json": fragment}
                events.append({"type": "content_block_delta", "index": index, "delta": partial})
        return events


def _input(arguments: str) -> dict[str, Any]:
    """A call's input: its arguments, or (cut short by ``max_tokens``) an empty object."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_object(
    message_id: str, model: str, blocks: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
    usage: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}  # fmt: skip


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input tokens beside those read from the prefix cache (which it counts apart)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens, "output_tokens": output_tokens}  # fmt: skip
