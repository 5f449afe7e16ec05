"""What one request may ask of the server before it is admitted: the body's size, the lengths of its lists, and
text that could never fit the context. Each is checked before the work it bounds (reading, parsing, tokenizing),
so that one client cannot stall the event loop or bloat the heap for everyone else.

- The body: ``--max-request-bytes`` (default 4 MiB), from ``Content-Length`` or while the body streams in; a 413.
  4 MiB holds a full 8,192-token context many times over (~32 KB of plain text; ~74 KB for CJK text with every
  character JSON-escaped; ~49 KB as token ids), 128 tools of 2 KB each, and a batch of 32 full-context prompts
  escaped at worst, or 128 of plain text. A 5 MB prompt took 1.8 s to tokenize and raised RSS by ~400 MB.
- Lists: prompts per request, messages, tools, stop strings (and their lengths), stop token ids and ``logit_bias``
  entries; a 400 naming the field (a 429 would tell the client to retry what can never succeed). The sequences a
  request asks for (prompts x ``n`` or ``best_of``) must also fit the waiting queue at once.
- Text: a prompt (or a conversation) longer in characters than the context could hold, at the tokenizer's longest
  token, is a 400 without tokenizing it: no token stands for more characters than the longest one's spelling.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.wire.openai.errors import APIError, bad_request, error_body


@dataclass(slots=True, frozen=True)
class RequestLimits:
    #: Bytes of one request body (``--max-request-bytes``).
    max_request_bytes: int = 4 * 2**20
    #: Prompts in one completions request (lm-eval sends batches of up to a few dozen).
    max_prompts: int = 256
    #: Messages in one conversation.
    max_messages: int = 2048
    #: Tools offered in one request (OpenAI's limit).
    max_tools: int = 128
    #: Stop strings, OpenAI's ``stop`` or Anthropic's ``stop_sequences`` (vLLM and llama.cpp set no bound).
    max_stop: int = 64
    #: Characters of one stop string: all of a sequence's are matched in one pass over each new token's text
    #: (``engine/core/stop.py``), at a cost that does not grow with them; but their automaton is built once per
    #: request (64 x 256 characters: ~20 ms) and as much text may be held back from a stream.
    max_stop_chars: int = 256
    #: ``stop_token_ids`` and ``logit_bias`` entries.
    max_token_ids: int = 1024


def check_lists(body: dict[str, Any], limits: RequestLimits, max_sequences: int) -> None:
    """A 400 naming the first list field longer than its limit, or a request whose sequences exceed
    ``max_sequences`` (the waiting queue: it could never be queued at once)."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    stop = body.get("stop")
    sizes = {
        "prompt": (prompts, limits.max_prompts),
        "messages": (_length(body.get("messages")), limits.max_messages),
        "tools": (_length(body.get("tools")), limits.max_tools),
        "stop": (_length(stop) if isinstance(stop, list) else 0, limits.max_stop),
        "stop_sequences": (_length(body.get("stop_sequences")), limits.max_stop),
        "stop_token_ids": (_length(body.get("stop_token_ids")), limits.max_token_ids),
        "logit_bias": (_length(body.get("logit_bias")), limits.max_token_ids),
    }
    for name, (size, most) in sizes.items():
        if size > most:
            raise bad_request(f"{name} has {size} entries; this server accepts at most {most}", name)
    _check_stop_lengths(body, limits.max_stop_chars)
    samples = max(_count(body.get("n")), _count(body.get("best_of")))
    if prompts * samples > max_sequences:
        param = "prompt" if prompts > max_sequences else "n"
        raise bad_request(
            f"the request asks for {prompts * samples} sequences ({prompts} prompts x {samples} samples); at most "
            f"{max_sequences} can wait for the batch at once",
            param,
        )


def _check_stop_lengths(body: dict[str, Any], most: int) -> None:
    for name in ("stop", "stop_sequences"):
        value = body.get(name)
        for index, stop in enumerate([value] if isinstance(value, str) else value if isinstance(value, list) else []):
            if isinstance(stop, str) and len(stop) > most:
                where = name if isinstance(value, str) else f"{name}[{index}]"
                raise bad_request(f"{where} has {len(stop)} characters; this server accepts at most {most}", where)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list | dict) else 0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def check_text(texts: list[str], max_chars: int, max_model_len: int, param: str) -> None:
    """A 400 for ``texts`` that need more tokens than the context holds, whatever their tokens: each token stands
    for at most ``max_chars / max_model_len`` characters. White space is not counted (a tokenizer may fold a run
    of it into less), so the bound holds for every tokenizer; it is only counted past the quick bound."""
    if sum(map(len, texts)) <= max_chars:
        return
    length = sum(len(text) - _blanks(text) for text in texts)
    if length > max_chars:
        raise bad_request(
            f"{param} has {length} characters other than white space: more than this model's maximum context "
            f"length of {max_model_len} tokens could hold ({max_chars} characters, at its tokenizer's longest token)",
            param,
        )


def _blanks(text: str) -> int:
    return len(text) - len("".join(text.split()))


class BodyLimitMiddleware:
    """Reads each request body up to ``max_bytes``, then hands it to the app; a 413 in the error envelope as soon
    as ``Content-Length`` or the bytes received so far exceed it (the rest is never read). An upload route's body
    (``paths``) is not read first: it streams to the route, counted, and the 413 comes from the route as soon as
    the count passes its limit."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = lambda: None,
                 paths: dict[str, int] | None = None) -> None:  # fmt: skip
        """``paths``: routes with limits of their own (a file upload's)."""
        self.app = app
        self.max_bytes = max_bytes
        self._on_reject = on_reject
        self._paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self._paths.get(scope["path"], self.max_bytes)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, int(declared), limit)
            return
        if scope["path"] in self._paths:
            await self.app(scope, _counted(receive, limit, self._on_reject), send)
            return
        body = await self._read(receive, limit)
        if body is None:
            await self._refuse(scope, receive, send, None, limit)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive, limit: int) -> bytes | None:
        """The whole body, or None once it grows past the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees an empty body and no one
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int | None, limit: int) -> None:
        self._on_reject()
        said = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        body = error_body(413, f"the request body has {said}; this server accepts at most {limit}")
        body["error"]["code"] = "request_too_large"
        await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)


def _counted(receive: Receive, limit: int, on_reject: Callable[[], None]) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that counts the body's bytes as they pass, raising a 413 once they exceed ``limit``."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            on_reject()
            raise APIError(413, f"the request body has more than {limit} bytes; this server accepts at most {limit}",
                           code="request_too_large")  # fmt: skip
        return message

    return counted


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that gives the app the body read already, then passes on what comes (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
