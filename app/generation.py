"""Running one API request's choices through the scheduler, for completions and chat alike.

A request becomes ``len(prompts) * best_of`` sequences, each its own ``RequestStream``, sharing the batch
with everyone else's. Choice ``prompt_index * n + sample_index`` is built from sample ``sample_index`` of
prompt ``prompt_index``; with ``best_of > n`` the ``n`` samples with the highest cumulative logprob win.
The endpoint's wire format is a ``Format``: completions and chat differ only in how a choice is shaped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from app import protocol
from app.errors import APIError, error_body
from app.metrics import Metrics
from engine.scheduler import Delta, EngineError, RequestStream, Scheduler
from engine.tokenizer import Tokenizer
from engine.types import FinishReason, GenerationRequest, TokenLogprob


@dataclass(slots=True)
class Choice:
    """One sequence's output so far."""

    prompt_index: int
    prefix: str = ""  # the echoed prompt
    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None

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
        self, index: int, text: str, finish: FinishReason | None, logprobs: list[TokenLogprob] | None, first: bool
    ) -> dict[str, Any]: ...


@dataclass(slots=True)
class Generation:
    """One API request: its sequences, and how to answer with them."""

    scheduler: Scheduler
    metrics: Metrics
    tokenizer: Tokenizer
    model_name: str
    fmt: Format
    options: protocol.GenerationOptions
    prompts: list[list[int]]
    echo_texts: list[str] | None  # the prompt text per prompt, when echoing
    arrived: float
    streams: list[RequestStream] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    request_id: str = ""

    def __post_init__(self) -> None:
        self.request_id = f"{self.fmt.id_prefix}-{protocol.new_id()}"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def submit(self) -> None:
        """Queue every sequence; if the queue fills part-way, withdraw them all (429 for the request)."""
        opts = self.options
        for prompt_index, ids in enumerate(self.prompts):
            prefix = self.echo_texts[prompt_index] if self.echo_texts else ""
            for sample in range(opts.best_of):
                self.choices.append(Choice(prompt_index, prefix))
                if opts.max_tokens == 0:
                    continue  # echo only: nothing to generate
                try:
                    self.streams.append(self.scheduler.submit(self._request(ids, sample), opts.stop, opts.include_stop))
                except Exception:
                    self.abort()
                    raise
        if opts.max_tokens == 0:
            for choice in self.choices:
                choice.finish_reason = "length"

    def _request(self, prompt_ids: list[int], sample: int) -> GenerationRequest:
        opts = self.options
        sampling = opts.sampling
        if sampling.seed is not None and sample:
            # Each sample of a seeded request draws its own, still reproducible, stream.
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + sample) % 2**64)
        # best_of ranks samples by cumulative logprob, so it needs the chosen tokens' logprobs.
        logprobs = opts.logprobs if opts.logprobs is not None else (0 if opts.best_of > opts.n else None)
        return GenerationRequest(
            tuple(prompt_ids),
            opts.max_tokens,
            ignore_eos=opts.ignore_eos,
            sampling=sampling,
            stop_token_ids=opts.stop_token_ids,
            min_tokens=opts.min_tokens,
            logprobs=logprobs,
        )

    def abort(self) -> None:
        for stream in self.streams:
            self.scheduler.abort(stream)

    def usage(self) -> dict[str, int]:
        return protocol.usage(self.num_prompt_tokens, self.num_completion_tokens)

    # -- a whole response -------------------------------------------------------------------------------

    async def complete(self) -> dict[str, Any]:
        try:
            await asyncio.gather(*(self._collect(i, s) for i, s in enumerate(self.streams)))
        except EngineError as exc:
            raise APIError(500, str(exc), code="engine_error") from None
        finally:
            self.abort()
        winners = self._best()
        want_logprobs = self.options.logprobs is not None
        return {
            "id": self.request_id,
            "object": self.fmt.object_name,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [self.fmt.choice(i, choice, want_logprobs) for i, choice in enumerate(winners)],
            "usage": protocol.usage(self.num_prompt_tokens, sum(len(c.token_ids) for c in winners)),
        }

    async def _collect(self, index: int, stream: RequestStream) -> None:
        choice = self.choices[index]
        async for delta in self.metrics.observe(stream.deltas(), self.arrived):
            self._record(choice, delta)

    @staticmethod
    def _record(choice: Choice, delta: Delta) -> None:
        choice.parts.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs or [])
        choice.finish_reason = delta.finish_reason

    def _best(self) -> list[Choice]:
        n, best_of = self.options.n, self.options.best_of
        if best_of == n:
            return self.choices
        winners = []
        for start in range(0, len(self.choices), best_of):
            samples = self.choices[start : start + best_of]
            winners += sorted(samples, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
        return winners

    # -- a stream of chunks ------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[str]:
        """Server-sent event payloads: chunks as each choice produces text, then usage, then [DONE]."""
        merged: asyncio.Queue[tuple[int, Delta | EngineError | None]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, s, merged)) for i, s in enumerate(self.streams)]
        try:
            if self.echo_texts is not None:
                for index, choice in enumerate(self.choices):
                    finish = choice.finish_reason if not self.streams else None
                    yield self._chunk([self.fmt.delta(index, choice.prefix, finish, None, first=True)])
            remaining = len(pumps)
            started: set[int] = set()
            while remaining:
                index, item = await merged.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, EngineError):
                    yield json.dumps(error_body(500, str(item), code="engine_error"))
                    break
                self._record(self.choices[index], item)
                if item.text or item.finish_reason is not None or index not in started:
                    first = index not in started and self.echo_texts is None
                    started.add(index)
                    logprobs = item.logprobs if self.options.logprobs is not None else None
                    yield self._chunk([self.fmt.delta(index, item.text, item.finish_reason, logprobs, first)])
            else:
                if self.options.include_usage:
                    yield self._chunk([], usage=self.usage())
        finally:
            for pump in pumps:
                pump.cancel()
            self.abort()  # the client may have left mid-stream: the sequences leave the batch at the next step
        yield "[DONE]"

    async def _pump(self, index: int, stream: RequestStream, out: asyncio.Queue[Any]) -> None:
        try:
            async for delta in self.metrics.observe(stream.deltas(), self.arrived):
                out.put_nowait((index, delta))
        except EngineError as exc:
            out.put_nowait((index, exc))
        out.put_nowait((index, None))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": self.fmt.chunk_object_name,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
        }
        if self.options.include_usage:
            continuous = self.options.continuous_usage and usage is None
            chunk["usage"] = usage if usage is not None else (self.usage() if continuous else None)
        return json.dumps(chunk, ensure_ascii=False)


# -- the two wire formats -----------------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionFormat:
    tokenizer: Tokenizer
    object_name: str = "text_completion"
    chunk_object_name: str = "text_completion"
    id_prefix: str = "cmpl"

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]:
        logprobs = self._logprobs(choice.logprobs, len(choice.prefix)) if want_logprobs else None
        return {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def delta(
        self, index: int, text: str, finish: FinishReason | None, logprobs: list[TokenLogprob] | None, first: bool
    ) -> dict[str, Any]:
        formatted = None if logprobs is None else self._logprobs(logprobs, 0)
        return {"index": index, "text": text, "logprobs": formatted, "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, list[Any]]:
        tokens = [self.tokenizer.decode([e.token_id]) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }


@dataclass(slots=True)
class ChatFormat:
    tokenizer: Tokenizer
    object_name: str = "chat.completion"
    chunk_object_name: str = "chat.completion.chunk"
    id_prefix: str = "chatcmpl"

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": {"content": self._logprobs(choice.logprobs)} if want_logprobs else None,
            "finish_reason": choice.finish_reason,
        }

    def delta(
        self, index: int, text: str, finish: FinishReason | None, logprobs: list[TokenLogprob] | None, first: bool
    ) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": self._logprobs(logprobs)},
            "finish_reason": finish,
        }

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        def token(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries]
