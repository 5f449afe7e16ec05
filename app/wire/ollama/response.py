"""Ollama's answers: ``/api/chat``'s messages (content, ``thinking``, ``tool_calls`` with object arguments) and
``/api/generate``'s ``response`` text (with ``context``, the ids to send back), whole or as newline-delimited JSON
objects, the last one ``done`` with ``done_reason`` and the timings in nanoseconds."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.pipeline.generation import Generation
from app.pipeline.reply import Piece, Reading
from app.pipeline.tools.parser import ParsedCall
from app.wire.openai.choices import Choice
from app.wire.openai.errors import APIError
from engine.core.streams import EngineError

#: Ollama's version as ``/api/version`` reports it: clients check for features by it (Codex CLI 0.171 refuses
#: one before 0.13.4).
VERSION = "0.13.5"


def timestamp(seconds: float | None = None) -> str:
    """A moment (seconds since the epoch; now where not given) as Ollama writes it: ISO 8601, UTC, with a Z."""
    moment = datetime.datetime.fromtimestamp(time.time() if seconds is None else seconds, datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


@dataclass(slots=True)
class OllamaGeneration(Generation):
    """One ``/api/chat`` or ``/api/generate`` request: one sequence."""

    reading: Reading = field(default_factory=Reading)
    #: ``/api/generate``'s shape (``response``, ``context``); else ``/api/chat``'s ``message``.
    generate: bool = False
    _first: float | None = None  # when the first token came (perf_counter)

    async def complete(self) -> dict[str, Any]:
        async for _, item in self.deltas():  # as collect(), noting when the first token came
            if isinstance(item, EngineError):
                raise APIError(500, str(item), code="engine_error")
            self._first = self._first or time.perf_counter()
        choice = self.choices[0]
        reader = self.reading.reader()
        piece = reader.feed(choice.text)
        rest = reader.finish()
        whole = Piece(piece.reasoning + rest.reasoning, piece.content + rest.content)
        return {**self._line(whole, reader.calls), **self._done(choice)}

    async def events(self) -> AsyncIterator[str]:
        reader = self.reading.reader()
        deltas = self.deltas()
        try:
            async for _, item in deltas:
                if isinstance(item, EngineError):
                    yield _json({"error": str(item)})
                    return
                self._first = self._first or time.perf_counter()
                piece = reader.feed(item.text)
                if item.finish_reason is not None:
                    rest = reader.finish()
                    piece = Piece(piece.reasoning + rest.reasoning, piece.content + rest.content)
                if piece.reasoning or piece.content:
                    yield _json(self._line(piece, []))
        finally:
            await deltas.aclose()
        if reader.calls:
            yield _json(self._line(Piece(), reader.calls))
        yield _json({**self._line(Piece(), []), **self._done(self.choices[0])})

    def _line(self, piece: Piece, calls: list[ParsedCall]) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model_name, "created_at": timestamp()}
        if self.generate:
            line["response"] = piece.content
            if piece.reasoning:
                line["thinking"] = piece.reasoning
        else:
            message: dict[str, Any] = {"role": "assistant", "content": piece.content}
            if piece.reasoning:
                message["thinking"] = piece.reasoning
            if calls:
                message["tool_calls"] = [_call(call) for call in calls]
            line["message"] = message
        return {**line, "done": False}

    def _done(self, choice: Choice) -> dict[str, Any]:
        """The last object's fields: why it ended, the counts and the timings (nanoseconds)."""
        now = time.perf_counter()
        first = self._first or now
        done = {
            "done": True, "done_reason": "length" if choice.finish_reason == "length" else "stop",
            "total_duration": _ns(now - self.arrived), "load_duration": 0,
            "prompt_eval_count": self.num_prompt_tokens, "prompt_eval_duration": _ns(first - self.arrived),
            "eval_count": len(choice.token_ids), "eval_duration": _ns(now - first),
        }  # fmt: skip
        if self.generate:
            done["context"] = [*self.prompts[0], *choice.token_ids]
        return done


def _call(call: ParsedCall) -> dict[str, Any]:
    """A call as Ollama writes it: its arguments an object."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = {}
    return {"function": {"name": call.name, "arguments": arguments}}


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)
