"""Typed request models (pydantic v2) for the nested parts of a request: chat messages, tools, tool_choice.

Validation is strict (JSON types as sent: ``"1"`` is not an integer, ``true`` is not a number), and a
``ValidationError`` becomes one 400 in the OpenAI envelope whose ``param`` is the offending field's path in the
request body, ``messages[2].tool_calls[0].function.name`` style.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

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


Messages = TypeAdapter(Annotated[list[Message], Field(min_length=1)])


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


Tools = TypeAdapter(list[Tool])
ToolChoice = TypeAdapter(Literal["none", "auto", "required"] | NamedToolChoice)


def validated(adapter: TypeAdapter[Any], value: Any, param: str) -> Any:
    """``value`` (found at ``param`` in the body) checked by ``adapter``; a 400 naming the field if not."""
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError as exc:
        raise _as_bad_request(exc, value, param) from None


def _as_bad_request(exc: ValidationError, value: Any, param: str) -> APIError:
    # Of a union's errors (content is a string, or a list of parts: two errors), the one that got deepest.
    paths = [(_path(param, error, value), error) for error in exc.errors(include_url=False)]
    depth = max(path.count(".") + path.count("[") for path, _ in paths)
    path, error = next((p, e) for p, e in paths if p.count(".") + p.count("[") == depth)
    message = error["msg"].removeprefix("Value error, ")
    return bad_request(f"{path}: {message}", path)


def _path(param: str, error: Any, value: Any) -> str:
    """The body path of an error's location. Pydantic's ``loc`` also names the union member it tried
    (``str``, ``list[TextPart]``): walking the value itself keeps only the steps that are really there."""
    path, loc = param, error["loc"]
    for step in loc:
        if isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            path, value = f"{path}[{step}]", value[step]
        elif isinstance(value, dict) and isinstance(step, str) and step in value:
            path, value = f"{path}.{step}", value[step]
    if error["type"] == "missing" and loc and isinstance(loc[-1], str):
        path = f"{path}.{loc[-1]}"  # the field that is not there
    return path
