"""A chat conversation's parts as typed models: messages (text or text parts, tool calls, tool results) and
function tools, as chat completions spells them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from app.openai.request import WireModel


class TextPart(WireModel):
    type: Literal["text"] = "text"
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)]


class FunctionCall(WireModel):
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(WireModel):
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


class FunctionDefinition(WireModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # as the OpenAI API requires
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # every call is held to its schema by the grammar, strict or not


class Tool(WireModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction
