"""The request bodies of /v1/completions and /v1/chat/completions as typed models (pydantic v2), declared once.

Validation is strict (JSON types as sent: ``"1"`` is not an integer, ``true`` is not a number), JSON null means
absent, and a ``ValidationError`` becomes one 400 in the OpenAI envelope whose ``param`` is the offending
field's path in the body, ``messages[2].tool_calls[0].function.name`` style. Rules that tie fields together
(``best_of`` >= ``n``, ``min_tokens`` <= ``max_tokens``, ``stream_options`` needs ``stream``) are checked where the
request becomes generation options (``protocol.py``); so are the limits that depend on the model (vocabulary
size, context length).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from app.errors import APIError, bad_request


class _Model(BaseModel):
    # Unknown keys inside these objects are ignored (clients add their own, e.g. ``name`` on messages); strict
    # types; frozen, so a parsed request cannot be changed on its way through the server.
    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


# -- messages --------------------------------------------------------------------------------------------


class TextPart(_Model):
    type: Literal["text"] = "text"
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)]


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    #: An assistant's earlier calls.
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None
    #: A tool message answers this call.
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and self.tool_calls is None:
            raise ValueError("a message needs content (an assistant message may have tool_calls instead)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        content = self.content
        if content is None:
            return ""
        return content if isinstance(content, str) else "".join(part.text for part in content)


# -- tools -----------------------------------------------------------------------------------------------


class FunctionDefinition(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # as the OpenAI API requires
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # every call is held to its schema by the grammar, strict or not


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


# -- the bodies ------------------------------------------------------------------------------------------

MAX_N = 16
MAX_LOGPROBS = 20

Bounded = Annotated[float, Field(allow_inf_nan=False)]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # no schema: any JSON value
    strict: bool | None = None  # the grammar holds the output to the schema either way


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Model):
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


class _Body(_Model):
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


class CompletionBody(_Body):
    prompt: Any = Field(None, validate_default=True)  # checked below: a union whose errors should name the prompt
    echo: bool | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

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


class ChatBody(_Body):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


def is_token(value: Any) -> bool:
    """A token id: a non-negative integer (the vocabulary's bound is the server's to check)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _all(values: list[Any], kind: type) -> bool:
    return all(isinstance(value, kind) for value in values)


def validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``body`` checked by ``model``; a 400 naming the offending field if not."""
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise _as_bad_request(exc, body) from None


def _as_bad_request(exc: ValidationError, body: dict[str, Any]) -> APIError:
    # Of a union's errors (content is a string, or a list of parts: two errors), the one that got deepest.
    paths = [(_path(error, body), error) for error in exc.errors(include_url=False)]
    depth = max(path.count(".") + path.count("[") for path, _ in paths)
    path, error = next((p, e) for p, e in paths if p.count(".") + p.count("[") == depth)
    message = error["msg"].removeprefix("Value error, ")
    return bad_request(f"{path}: {message}" if path else message, path or None)


def _path(error: Any, value: Any) -> str:
    """The body path of an error's location. Pydantic's ``loc`` also names the union member it tried
    (``str``, ``list[TextPart]``): walking the value itself keeps only the steps that are really there."""
    path, loc = "", error["loc"]
    for step in loc:
        if isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}" if path else step, value[step]
    missing = loc[-1] if error["type"] == "missing" else (loc[0] if loc and not path else None)
    if isinstance(missing, str):  # a field that is not there (required, or checked although absent)
        path = f"{path}.{missing}" if path else missing
    return path
