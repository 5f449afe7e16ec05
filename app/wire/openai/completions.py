"""The wire format of ``/v1/completions``: its body, its request, and how a choice, a stream delta and logprobs
are shaped (``text_completion``).

Token strings in logprobs are the text each token stands for, special tokens included (``<|im_start|>``), so
the tokens of an echoed prompt join to its text. A token that holds only part of a UTF-8 character is written
as its bytes, ``bytes:\\xe6\\x97``, as OpenAI's API writes it. ``top_logprobs`` always holds the sampled token (up
to ``logprobs`` + 1 entries, as OpenAI documents); should two of its tokens still share a string, the later one is
keyed ``token_id:<id>`` (vLLM's spelling of a token by id) rather than lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, field_validator

from app.wire.openai.choices import Choice, TextOffsets, token_string
from app.wire.openai.errors import bad_request
from app.wire.openai.request import is_token, validated
from app.wire.openai.sampling import (
    MAX_LOGPROBS,
    GenerationOptions,
    SamplingBody,
    generation_options,
    reject_unsupported,
)
from engine.core.streams import Delta
from engine.core.tokenizer import Tokenizer
from engine.core.types import TokenLogprob

Prompt = str | list[int]


class CompletionBody(SamplingBody):
    prompt: Any = Field(None, validate_default=True)  # checked below: a union whose errors should name the prompt
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    #: Fill-in-the-middle: the text after the gap the completion fills (the prompt is the text before it).
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> list[str | list[int]]:
        """A string, a list of strings, a list of token ids, or a list of token-id lists: as a list of prompts."""
        if prompt is None:
            raise ValueError("prompt is required")
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(is_token(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and (_all(prompt, str) or _all(prompt, list)):
            prompts = prompt
        else:
            raise ValueError("prompt must be a string, a list of strings, or a list of token ids (or of lists)")
        for p in prompts:
            if not p:
                raise ValueError("a prompt must not be empty")
            if isinstance(p, list) and not all(is_token(t) for t in p):
                raise ValueError("token ids must be non-negative integers")
        return prompts


def _all(values: list[Any], kind: type) -> bool:
    return all(isinstance(value, kind) for value in values)


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[Prompt]
    echo: bool
    options: GenerationOptions
    suffix: str | None = None


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    reject_unsupported(body, chat=False)
    req: CompletionBody = validated(CompletionBody, body)
    echo = bool(req.echo)
    options = generation_options(req, req.max_tokens, "max_tokens", req.logprobs, allow_zero=echo)
    if req.suffix is not None and echo:
        raise bad_request("echo cannot be combined with suffix (fill-in-the-middle answers the middle only)", "echo")
    return CompletionRequest(req.model, req.prompt, echo, options, req.suffix)


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
