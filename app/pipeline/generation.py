"""Running one API request's choices through the scheduler, for completions and chat alike.

A request becomes ``len(prompts) * best_of`` sequences, each its own ``RequestStream``, sharing the batch
with everyone else's. Choice ``prompt_index * n + sample_index`` is built from sample ``sample_index`` of
prompt ``prompt_index``; with ``best_of > n`` the ``n`` samples with the highest cumulative logprob win.
The endpoint's wire format is a ``Format`` (``app/wire/openai/``): completions and chat differ only in how a choice
is shaped. Every chunk of a stream, and the whole response, carry the same ``created``: when the request came.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from app.pipeline.reply_budget import reply_budget
from app.server.metrics import Metrics
from app.services.backend import Backend, Stream, Submission
from app.wire.openai.choices import Choice, Format, envelope, new_id, usage
from app.wire.openai.errors import APIError, error_body
from app.wire.openai.sampling import GenerationOptions
from engine.core.streams import Delta, EngineError
from engine.core.tokenizer import Tokenizer
from engine.core.types import GenerationRequest


@dataclass(slots=True)
class Generation:
    """One API request: its sequences, and how to answer with them."""

    backend: Backend
    metrics: Metrics
    tokenizer: Tokenizer
    model_name: str
    fmt: Format
    options: GenerationOptions
    prompts: list[list[int]]
    echo_texts: list[str] | None  # the prompt text per prompt, when echoing
    arrived: float
    #: The grammar every sequence's tokens follow (structured output, tool calls), compiled already.
    grammar: str | None = None
    #: Special tokens whose spelling the text keeps: the markers of the tool calls the reply may hold.
    kept_special: frozenset[int] = frozenset()
    #: The model's context: each sequence's ``max_tokens`` is clamped to what its prompt leaves (None: as asked).
    context: int | None = None
    choices: list[Choice] = field(default_factory=list)
    request_id: str = ""
    created: int = 0  # seconds since the epoch, one value for the whole response

    def __post_init__(self) -> None:
        self.request_id = f"{self.fmt.id_prefix}-{new_id()}"
        self.created = int(time.time())

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache gave: each prompt's first sample's, as prompts count once."""
        return sum(choice.cached_tokens for choice in self.choices[:: self.options.best_of])

    @property
    def num_accepted_tokens(self) -> int:
        """Drafted tokens the model accepted, over every sequence (speculative decoding; the access log)."""
        return sum(choice.accepted_tokens for choice in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    async def submit(self) -> None:
        """Queue every sequence; if the queue fills part-way, withdraw them all (429 for the request)."""
        opts = self.options
        for prompt_index, ids in enumerate(self.prompts):
            prefix = self.echo_texts[prompt_index] if self.echo_texts else ""
            for sample in range(opts.best_of):
                choice = Choice(prompt_index, prefix, prompt_only=opts.max_tokens == 0)
                self.choices.append(choice)
                if choice.prompt_only and not self.scores_prompt:
                    choice.finish_reason = "length"  # echo alone: nothing to run
                    continue
                submission = Submission(
                    self._request(ids, sample), opts.stop, opts.include_stop, self.grammar, opts.cache_key
                )
                try:
                    choice.stream = await self.backend.submit(submission)
                except BaseException:  # cancelled too: the client left while it was being routed
                    self.abort()
                    raise

    @property
    def scores_prompt(self) -> bool:
        """Echo with logprobs: the prompt's tokens get logprobs too."""
        return self.echo_texts is not None and self.options.logprobs is not None

    def _request(self, prompt_ids: list[int], sample: int) -> GenerationRequest:
        opts = self.options
        sampling = opts.sampling
        if sampling.seed is not None and sample:
            # Each sample of a seeded request draws its own, still reproducible, stream.
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + sample) % 2**64)
        # best_of ranks samples by cumulative logprob, so it needs the chosen tokens' logprobs.
        logprobs = opts.logprobs if opts.logprobs is not None else (0 if opts.best_of > opts.n else None)
        max_tokens = opts.max_tokens
        if self.context is not None:  # at most what the prompt leaves (app/pipeline/reply_budget.py)
            max_tokens = reply_budget(max_tokens, len(prompt_ids), self.context)
        return GenerationRequest(
            tuple(prompt_ids),
            max(max_tokens, 1),  # a prompt-only sequence generates one token nobody sees
            ignore_eos=opts.ignore_eos,
            sampling=sampling,
            stop_token_ids=opts.stop_token_ids,
            min_tokens=min(opts.min_tokens, max(max_tokens, 1)),
            logprobs=logprobs,
            prompt_logprobs=opts.logprobs if self.scores_prompt else None,
            kept_special=self.kept_special,
            priority=opts.priority,
        )

    def abort(self) -> None:
        for _, stream in self.running:
            self.backend.abort(stream)

    @property
    def replicas(self) -> str | None:
        """What ran the sequences (a cluster's replicas, comma-separated), for the access log."""
        names = sorted({s.replica for _, s in self.running if s.replica is not None})
        return ",".join(names) or None

    @property
    def running(self) -> list[tuple[int, Stream]]:
        """The choices that have a sequence in the scheduler, by index."""
        return [(i, c.stream) for i, c in enumerate(self.choices) if c.stream is not None]

    def usage(self) -> dict[str, int]:
        return usage(self.num_prompt_tokens, self.num_completion_tokens, self.num_cached_tokens)

    # -- a whole response -------------------------------------------------------------------------------

    async def collect(self) -> list[Choice]:
        """Run every sequence to its end; the choices to answer with (``best_of``'s winners)."""
        collectors = [asyncio.ensure_future(self._collect(i, s)) for i, s in self.running]
        try:
            await asyncio.gather(*collectors)
        except EngineError as exc:
            raise APIError(500, str(exc), code="engine_error") from None
        finally:
            for collector in collectors:  # after a failure, the others would wait forever
                collector.cancel()
            self.abort()
        return self._best()

    async def complete(self) -> dict[str, Any]:
        winners = await self.collect()
        want_logprobs = self.options.logprobs is not None
        choices = [self.fmt.choice(i, choice, want_logprobs) for i, choice in enumerate(winners)]
        response = envelope(self.request_id, self.fmt.object_name, self.created, self.model_name, choices)
        num_completion = sum(len(c.token_ids) for c in winners)
        return {**response, "usage": usage(self.num_prompt_tokens, num_completion, self.num_cached_tokens)}

    async def _collect(self, index: int, stream: Stream) -> None:
        choice = self.choices[index]
        async for delta in self.metrics.observe(stream.deltas(), self.arrived):
            self._record(choice, delta)

    @staticmethod
    def _record(choice: Choice, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.cached_tokens is not None:
            choice.cached_tokens = delta.cached_tokens
        choice.accepted_tokens += delta.accepted
        if choice.prompt_only:
            choice.finish_reason = "length"
            return
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

    async def deltas(self) -> AsyncIterator[tuple[int, Delta | EngineError]]:
        """Each choice's deltas as they come (recorded in its ``Choice`` first), merged; an ``EngineError`` ends
        them. Leaving early aborts the sequences: they leave the batch at the next step."""
        merged: asyncio.Queue[tuple[int, Delta | EngineError | None]] = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(i, s, merged)) for i, s in self.running]
        try:
            remaining = len(pumps)
            while remaining:
                index, item = await merged.get()
                if item is None:
                    remaining -= 1
                    continue
                if not isinstance(item, EngineError):
                    self._record(self.choices[index], item)
                yield index, item
                if isinstance(item, EngineError):
                    return
        finally:
            for pump in pumps:
                pump.cancel()
            self.abort()

    async def events(self) -> AsyncIterator[str]:
        """Server-sent event payloads: chunks as each choice produces text, then usage, then [DONE]."""
        want_logprobs = self.options.logprobs is not None
        if self.echo_texts is not None and not self.scores_prompt:
            for index, choice in enumerate(self.choices):
                echoed = Delta(choice.prefix, [], choice.finish_reason)
                yield self._chunk([self.fmt.delta(index, choice, echoed, False, first=True) or {}])
        started: set[int] = set()
        failed = False
        deltas = self.deltas()
        try:
            async for index, item in deltas:
                if isinstance(item, EngineError):
                    yield json.dumps(error_body(500, str(item), code="engine_error"))
                    failed = True
                    break
                choice = self.choices[index]
                first = index not in started and (self.echo_texts is None or self.scores_prompt)
                if choice.prompt_only:
                    item = Delta("", [], "length", [])
                if item.text or item.finish_reason is not None or first:
                    started.add(index)
                    piece = self.fmt.delta(index, choice, item, want_logprobs, first)
                    if piece is not None:
                        yield self._chunk([piece])
        finally:
            await deltas.aclose()  # the client may have left mid-stream: its sequences leave the batch
        if not failed and self.options.include_usage:
            yield self._chunk([], usage=self.usage())
        yield "[DONE]"

    async def _pump(self, index: int, stream: Stream, out: asyncio.Queue[Any]) -> None:
        try:
            async for delta in self.metrics.observe(stream.deltas(), self.arrived):
                out.put_nowait((index, delta))
        except EngineError as exc:
            out.put_nowait((index, exc))
        out.put_nowait((index, None))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        chunk = envelope(self.request_id, self.fmt.chunk_object_name, self.created, self.model_name, choices)
        if self.options.include_usage:
            continuous = self.options.continuous_usage and usage is None
            chunk["usage"] = usage if usage is not None else (self.usage() if continuous else None)
        return json.dumps(chunk, ensure_ascii=False)


def named_event(event: dict[str, Any]) -> dict[str, str]:
    """A server-sent event named by its ``type`` (the Responses and Messages APIs' framing; chat's chunks are
    unnamed)."""
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
