"""A submitted request as its caller sees it: the deltas of text it receives, made from the engine's tokens by the
incremental detokenizer and the stop strings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.stop import StopMatcher
from engine.core.tokenizer import Tokenizer
from engine.core.types import FinishReason, GenerationRequest, StepOutput, TokenLogprob


class EngineError(Exception):
    """The engine failed while this request was in its batch, or rejected it at admission."""


@dataclass(slots=True)
class Delta:
    """New text for one request, with the tokens behind it; ``finish_reason`` is set on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: With the first delta: prompt tokens that came from the engine's prefix cache.
    cached_tokens: int | None = None


class RequestStream:
    """A submitted request as its caller sees it: ``async for delta in stream.deltas()``."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer, stop: StopMatcher | None = None) -> None:
        self.request = request
        self.num_generated = 0
        self.finished = False
        self.seq_id: int | None = None
        #: What runs it when there are several engines (a cluster's replica); None in one process.
        self.replica: str | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._queue: asyncio.Queue[Delta | EngineError] = asyncio.Queue()

    async def deltas(self) -> AsyncIterator[Delta]:
        while True:
            item = await self._queue.get()
            if isinstance(item, EngineError):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def _push(self, output: StepOutput) -> bool:
        """Hand out one step's tokens as text. Returns True when a stop string ended the request here."""
        self.num_generated += len(output.token_ids)
        finish = output.finish_reason
        text = self._detokenizer.add(output.token_ids)
        if finish is not None:
            text += self._detokenizer.flush()
        stopped = False
        if self._stop is not None:
            # Stop strings count only once min_tokens are out, as the stop tokens do.
            text = self._stop.feed(text, check=self.num_generated >= self.request.min_tokens)
            stopped = self._stop.matched
            if stopped:
                finish = "stop"
            elif finish is not None:
                text += self._stop.flush()
        self.finished = finish is not None
        delta = Delta(text, output.token_ids, finish, output.logprobs, output.prompt_logprobs, output.cached_tokens)
        self._queue.put_nowait(delta)
        return stopped

    def _fail(self, error: EngineError) -> None:
        self.finished = True
        self._queue.put_nowait(error)
