"""What completions and chat (and every endpoint that generates) share: the body's sampling, stopping, streaming
and structured-output fields, and the rules that tie them together into ``GenerationOptions``. Fields this server
does not implement are a 400 naming them, never silently ignored. The limits that depend on the model
(vocabulary size, context length) are checked by the server state (``app/server/state.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from app.pipeline.reply_budget import COMPLETIONS_DEFAULT
from app.wire.openai.errors import bad_request
from app.wire.openai.request import Bounded, NonEmpty, TokenId, WireModel
from engine.core.types import SamplingParams

MAX_N = 16


MAX_LOGPROBS = 20
#: ``prompt_cache_key``: a client session's id, bounded as every field a body controls.
MAX_CACHE_KEY = 256


class StreamOptions(WireModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's


class JsonSchemaFormat(WireModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # no schema: any JSON value
    strict: bool | None = None  # the grammar holds the output to the schema either way


class ResponseFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(WireModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex, a choice of strings, a Lark grammar."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if len(self._given()) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar")
        if isinstance(self.json_, str):
            try:
                object.__setattr__(self, "json_", json.loads(self.json_))
            except ValueError:
                raise ValueError("json is not valid JSON") from None
        return self

    def chosen(self) -> tuple[Literal["json", "regex", "choice", "grammar"], Any]:
        """The one kind given, and its value."""
        [(kind, value)] = self._given().items()
        return kind, value  # type: ignore[return-value]

    def _given(self) -> dict[str, Any]:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}
        return {kind: value for kind, value in given.items() if value is not None}


class SamplingBody(WireModel):
    """What both endpoints take. Unknown fields are allowed (``user``, ``metadata``) and ignored."""

    model_config = ConfigDict(strict=True, frozen=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None  # its lower bound depends on the endpoint: see protocol
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    temperature: Annotated[Bounded, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Bounded, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: -1 or 0 turn it off
    min_p: Annotated[Bounded, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64)] | None = None
    presence_penalty: Annotated[Bounded, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Bounded, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Bounded, Field(gt=0)] | None = None  # vLLM's
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    #: vLLM's: lower values are admitted first from the waiting queue.
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] | None = None
    #: OpenAI's: requests that share it share a cache (here: a cluster routes them to one replica).
    prompt_cache_key: Annotated[str, Field(max_length=MAX_CACHE_KEY)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (bias or {}).items():
            # "²".isdigit() holds but int("²") fails; int() also refuses over 4300 digits.
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise ValueError(f"keys must be token ids, got {key[:20]!r}")
            if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
                raise ValueError(f"values must be numbers in [-100, 100], got {json.dumps(value)[:20]}")
        return bias

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), float(value)) for key, value in (self.logit_bias or {}).items())


@dataclass(slots=True, frozen=True)
class GenerationOptions:
    """What completions and chat completions share: how much to generate, how to sample, when to stop."""

    max_tokens: int | None  # None only for chat before the route knows the prompt's length
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    stop: tuple[str, ...]
    include_stop: bool
    stop_token_ids: frozenset[int]
    min_tokens: int
    ignore_eos: bool
    sampling: SamplingParams
    structured: StructuredOutput | None = None
    #: Admission order among waiting requests (vLLM's ``priority``: lower first).
    priority: int = 0
    #: OpenAI's ``prompt_cache_key``: a routing hint on a cluster (``cluster.routing``).
    cache_key: str | None = None


#: ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) as OpenAI spells them: passed to the chat template
#: as its ``reasoning_effort`` variable (as vLLM does), which gpt-oss's harmony prompt honours.
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """What the output must match: JSON of a schema, a regex, one of some strings, or a Lark grammar."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: Any  # a JSON schema (an object or a boolean), a pattern, a list of strings, a grammar's text
    param: str  # the request field it came from, for errors
    #: The grammar is of the whole reply (a reasoning budget's), not of its answer alone: a model whose replies
    #: have a shape of their own (harmony) does not wrap it in that shape.
    whole: bool = False


# Fields that change what a client gets back and that this server does not implement yet: a 400 naming the field,
# never a 200 whose output silently ignores it (a client asking for JSON must not believe it got JSON).
_UNSUPPORTED = ("suffix", "functions", "function_call", "audio", "web_search_options")
# Predicted Outputs: the text would be the same, but its usage details (accepted and rejected prediction tokens)
# would be missing; prompt-lookup speculation drafts from the prompt, where such a prediction usually is, anyway.
_UNSUPPORTED += ("prediction",)


_UNSUPPORTED += ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")


_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


def reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    # suffix: completions' fill-in-the-middle (models with FIM tokens: app/server/state.py); not a chat field
    for name in _UNSUPPORTED if chat else tuple(n for n in _UNSUPPORTED if n != "suffix") + _CHAT_ONLY:
        value = body.get(name)
        if value is not None and value != []:  # clients may send empty tools
            hint = "" if chat else " (tools are a chat completions feature)"
            raise bad_request(f"{name} is not supported by this server{hint}", name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only the text modality is supported", "modalities")


def generation_options(
    req: SamplingBody,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    *,
    allow_zero: bool,
    default_max_tokens: int | None = COMPLETIONS_DEFAULT,
) -> GenerationOptions:
    """The rules that tie fields together; each field on its own was checked by the body's model."""
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    stream_options = req.stream_options or StreamOptions()
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens < (0 if allow_zero else 1):
        limit = (
            "at least 0"
            if allow_zero
            else "at least 1 (0 only with echo)"
            if max_tokens_param == "max_tokens"
            else "at least 1"
        )
        raise bad_request(f"{max_tokens_param} must be {limit}, got {max_tokens}", max_tokens_param)
    n = req.n or 1
    best_of = n if req.best_of is None else req.best_of
    if best_of < n:
        raise bad_request(f"best_of must be at least n ({n}), got {best_of}", "best_of")
    if best_of > n and stream:
        raise bad_request("best_of cannot be used with stream", "best_of")
    min_tokens = req.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    stop = req.stop if req.stop is not None else []
    return GenerationOptions(
        max_tokens=max_tokens,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=bool(stream_options.include_usage),
        continuous_usage=bool(stream_options.continuous_usage_stats),
        logprobs=logprobs,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        include_stop=bool(req.include_stop_str_in_output),
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        min_tokens=min_tokens,
        ignore_eos=bool(req.ignore_eos),
        sampling=_sampling(req),
        structured=_structured_output(req, min_tokens),
        priority=req.priority or 0,
        cache_key=req.prompt_cache_key,
    )


def _structured_output(req: SamplingBody, min_tokens: int) -> StructuredOutput | None:
    """OpenAI's ``response_format``, or vLLM's ``structured_outputs`` (one of json, regex, choice, grammar)."""
    found = _response_format(req.response_format)
    spec = req.structured_outputs
    if spec is not None:
        if found is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        found = StructuredOutput(*spec.chosen(), "structured_outputs")
    if found is not None and min_tokens:
        raise bad_request("min_tokens cannot hold back the end of a structured output", "min_tokens")
    return found


def _response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json", {"type": "object"}, "response_format")
    spec = response_format.json_schema
    return StructuredOutput("json", True if spec is None else spec.schema_, "response_format")


def _sampling(req: SamplingBody) -> SamplingParams:
    def number(value: float | None, default: float) -> float:
        return default if value is None else float(value)

    return SamplingParams(
        temperature=number(req.temperature, 1.0),  # 1: the OpenAI API's default
        top_p=number(req.top_p, 1.0),
        top_k=max(req.top_k or 0, 0),
        min_p=number(req.min_p, 0.0),
        seed=req.seed,
        presence_penalty=number(req.presence_penalty, 0.0),
        frequency_penalty=number(req.frequency_penalty, 0.0),
        repetition_penalty=number(req.repetition_penalty, 1.0),
        logit_bias=req.token_biases(),
    )
