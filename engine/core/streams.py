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
    #: Speculative decoding: of the tokens drafted for this step, those the model accepted.
    accepted: int = 0


class RequestStream:
    """A submitted request as its caller sees it: ``async for delta in stream.deltas()``."""

    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer, stop: StopMatcher | None = None) -> None:
        self.request = request
        self.num_generated = 0
        #: Speculative decoding: tokens drafted for this request, and accepted.
        self.num_drafted = 0
        self.num_accepted = 0
        self._released = ""
        self.finished = False
        self.seq_id: int | None = None
        #: What runs it when there are several engines (a cluster's replica); None in one process.
        self.replica: str | None = None
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.kept_special)
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
        """Hand out one step's tokens as text. Returns True when a stop string ended the request here.

        A step may bring several tokens (speculative decoding); they are taken one at a time, as if they had
        come in steps of their own: a stop string in the text of one of them ends the request there, and the
        tokens after it are not handed out (nor counted)."""
        self.num_drafted += output.drafted
        self.num_accepted += output.accepted
        finish = output.finish_reason
        text, taken, stopped = "", 0, False
        for token in output.token_ids:
            taken += 1
            self.num_generated += 1
            piece = self._detokenizer.add([token])
            stopped = self._feed_stop(piece)
            text += self._released
            if stopped:
                break
        if not stopped and finish is not None:
            stopped = self._feed_stop(self._detokenizer.flush())
            text += self._released
            if not stopped and self._stop is not None:
                text += self._stop.flush()
        if stopped:
            finish = "stop"
        self.finished = finish is not None
        logprobs = None if output.logprobs is None else output.logprobs[:taken]
        token_ids = output.token_ids[:taken]
        self._queue.put_nowait(
            Delta(text, token_ids, finish, logprobs, output.prompt_logprobs, output.cached_tokens, output.accepted)
        )
        return stopped

    def _feed_stop(self, piece: str) -> bool:
        """Pass new text through the stop strings (``_released``: what may go out); whether one matched."""
        if self._stop is None:
            self._released = piece
            return False
        # Stop strings count only once min_tokens are out, as the stop tokens do.
        self._released = self._stop.feed(piece, check=self.num_generated >= self.request.min_tokens)
        return self._stop.matched

    def _fail(self, error: EngineError) -> None:
        self.finished = True
        self._queue.put_nowait(error)
