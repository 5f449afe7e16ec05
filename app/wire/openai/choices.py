"""One sequence's output as the endpoints shape it (``Choice``), the shape each endpoint gives it (``Format``),
the text offsets and token strings that logprobs use, and the envelope around choices: a response or a stream
chunk, with its id and usage."""

from __future__ import annotations

import codecs
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.services.backend import Stream
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
    accepted_tokens: int = 0  # drafted tokens the model accepted (speculative decoding)
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


def token_string(tokenizer: Tokenizer, token_id: int) -> str:
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a character
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def new_id() -> str:
    return uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts prompt tokens from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(
    request_id: str, object_name: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """The object around choices: a whole response, or one chunk of a stream (``object_name`` tells which)."""
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": choices}
