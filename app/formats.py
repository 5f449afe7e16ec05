"""The two wire formats of a generation: how completions and chat shape a choice, a stream delta, and logprobs.

Token strings in logprobs are the text each token stands for, special tokens included (``<|im_start|>``), so
the tokens of an echoed prompt join to its text. A token that holds only part of a UTF-8 character is written
as its bytes, ``bytes:\\xe6\\x97``, as OpenAI's API writes it; chat's ``bytes`` field carries the token's own
bytes. Completions' ``top_logprobs`` always holds the sampled token (up to ``logprobs`` + 1 entries, as OpenAI
documents); should two of its tokens still share a string, the later one is keyed ``token_id:<id>`` (vLLM's
spelling of a token by id) rather than lost. Chat's ``top_logprobs`` holds exactly the number asked for.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.backend import Stream
from app.tools import ToolCallParser
from engine.core.streams import Delta
from engine.core.tokenizer import Tokenizer
from engine.core.types import FinishReason, TokenLogprob


class TextOffsets:
    """Where each token's text starts in a choice's text, counting the characters its bytes complete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def advance(self, raw: bytes) -> int:
        start = self._offset
        self._offset += len(self._decoder.decode(raw))
        return start


@dataclass(slots=True)
class Choice:
    """One sequence's output so far."""

    prompt_index: int
    prefix: str = ""  # the echoed prompt
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs
    cached_tokens: int = 0  # of its prompt, from the engine's prefix cache
    prompt_only: bool = False  # max_tokens 0: the sequence runs only to score the prompt
    stream: Stream | None = None  # None when there is nothing to run (echo alone)
    offsets: TextOffsets = field(default_factory=TextOffsets)  # text_offset across a stream's deltas

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


class Format(Protocol):
    object_name: str
    chunk_object_name: str
    id_prefix: str

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]: ...

    def delta(
        self, index: int, choice: Choice, delta: Delta, want_logprobs: bool, first: bool
    ) -> dict[str, Any] | None:
        """The stream's piece for ``delta``; None when it has nothing to tell yet."""
        ...


def _with_calls(finish_reason: str | None) -> str | None:
    """A reply that made calls and ended on its own ends for them; one cut by max_tokens stays "length"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a character
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


@dataclass(slots=True)
class CompletionFormat:
    tokenizer: Tokenizer
    prompts: list[list[int]]
    object_name: str = "text_completion"
    chunk_object_name: str = "text_completion"
    id_prefix: str = "cmpl"

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]:
        logprobs = None
        if want_logprobs:
            logprobs = self._logprobs(self._prompt_entries(choice) + list(choice.logprobs), TextOffsets())
        return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def delta(self, index: int, choice: Choice, delta: Delta, want_logprobs: bool, first: bool) -> dict[str, Any]:
        text, logprobs = delta.text, None
        if want_logprobs:
            entries = list(delta.logprobs or [])
            if first and choice.prompt_logprobs is not None:  # echo with logprobs: the prompt comes first
                text = choice.prefix + text
                entries = self._prompt_entries(choice) + entries
            logprobs = self._logprobs(entries, choice.offsets)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    def _prompt_entries(self, choice: Choice) -> list[TokenLogprob | int]:
        """The scored prompt, its first token (which has no logprob) as a bare id."""
        if choice.prompt_logprobs is None:
            return []
        return [self.prompts[choice.prompt_index][0], *choice.prompt_logprobs[1:]]  # type: ignore[list-item]

    def _logprobs(self, entries: list[TokenLogprob | int], offsets: TextOffsets) -> dict[str, list[Any]]:
        result: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            scored = entry if isinstance(entry, TokenLogprob) else None
            token_id = entry if scored is None else scored.token_id
            result["tokens"].append(token_string(self.tokenizer, token_id))
            result["token_logprobs"].append(None if scored is None else scored.logprob)
            result["top_logprobs"].append(None if scored is None else self._top(scored))
            result["text_offset"].append(offsets.advance(self.tokenizer.token_bytes(token_id)))
        return result

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """The alternatives asked for, and the sampled token whether or not it is among them."""
        pairs = list(entry.top)
        if all(token_id != entry.token_id for token_id, _ in pairs):
            pairs.append((entry.token_id, entry.logprob))  # it is no likelier than the last of them
        top: dict[str, float] = {}
        for token_id, logprob in pairs:
            key = token_string(self.tokenizer, token_id)
            top[f"token_id:{token_id}" if key in top else key] = logprob
        return top


@dataclass(slots=True)
class ChatFormat:
    tokenizer: Tokenizer
    #: Whether the reply may hold tool calls, which become ``tool_calls`` (``app/tools.py``) and not content.
    parses_tool_calls: bool = False
    object_name: str = "chat.completion"
    chunk_object_name: str = "chat.completion.chunk"
    id_prefix: str = "chatcmpl"
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # a stream's, by choice

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish_reason: str | None = choice.finish_reason
        if self.parses_tool_calls:
            parser = ToolCallParser()
            parser.feed(choice.text)
            parser.finish()
            message["content"] = parser.text
            if parser.calls:
                message["tool_calls"] = [call.as_dict() for call in parser.calls]
                finish_reason = _with_calls(finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": self._logprobs(choice.logprobs)} if want_logprobs else None,
            "finish_reason": finish_reason,
        }

    def delta(
        self, index: int, choice: Choice, delta: Delta, want_logprobs: bool, first: bool
    ) -> dict[str, Any] | None:
        text, calls, finish_reason = delta.text, [], delta.finish_reason
        if self.parses_tool_calls:
            parser = self._parsers.setdefault(index, ToolCallParser())
            text, calls = parser.feed(delta.text)
            if finish_reason is not None:
                text += parser.finish()
                finish_reason = _with_calls(finish_reason) if parser.calls else finish_reason
            if not (text or calls or first or want_logprobs or finish_reason):
                return None  # the parser holds the text back: it may begin a call
        content: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or not calls:
            content["content"] = text
        if calls:
            content["tool_calls"] = calls
        return {
            "index": index,
            "delta": content,
            "logprobs": {"content": self._logprobs(delta.logprobs or [])} if want_logprobs else None,
            "finish_reason": finish_reason,
        }

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        def token(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.tokenizer.token_bytes(token_id)
            return {"token": token_string(self.tokenizer, token_id), "logprob": logprob, "bytes": list(raw)}

        return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries]
