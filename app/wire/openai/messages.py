"""A chat conversation's parts as typed models: messages (text or text parts, tool calls, tool results) and
function and custom tools, as chat completions spells them."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from app.wire.openai.request import WireModel


class TextPart(WireModel):
    type: Literal["text"] = "text"
    text: str


Content = str | Annotated[list[TextPart], Field(min_length=1)]


class FunctionCall(WireModel):
    name: str
    arguments: str  # JSON text, as the API sends it


def custom_arguments(text: str) -> str:
    """A custom tool's input as the model writes its call: the arguments of a function of one string."""
    return json.dumps({"input": text}, ensure_ascii=False)


class ToolCall(WireModel):
    id: str
    #: A custom tool's call (``{"type": "custom", "custom": {"name", "input"}}``) is read as the call of the
    #: function of one string the model was offered (``custom_arguments``).
    type: Literal["function", "custom"] = "function"
    function: FunctionCall

    @model_validator(mode="before")
    @classmethod
    def _custom_as_function(cls, value: Any) -> Any:
        if not (isinstance(value, dict) and value.get("type") == "custom" and isinstance(value.get("custom"), dict)):
            return value
        custom = value["custom"]
        text = custom.get("input")
        arguments = custom_arguments(text) if isinstance(text, str) else text
        function = {"name": custom.get("name"), "arguments": arguments}
        return {"id": value.get("id"), "type": "custom", "function": function}


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


class GrammarDefinition(WireModel):
    definition: Annotated[str, Field(min_length=1)]
    syntax: Literal["lark", "regex"]


class CustomFormat(WireModel):
    """A custom tool's input: free text, or text of a grammar (Lark, as llguidance reads it, or a regex)."""

    type: Literal["text", "grammar"]
    grammar: GrammarDefinition | None = None

    @model_validator(mode="after")
    def _grammar_given(self) -> CustomFormat:
        if (self.type == "grammar") != (self.grammar is not None):
            raise ValueError("a grammar format needs its grammar, and only it has one")
        return self


class CustomDefinition(WireModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    format: CustomFormat | None = None


class CustomTool(WireModel):
    """A custom (freeform) tool: its call's input is text, held to its grammar where it has one."""

    type: Literal["custom"]
    custom: CustomDefinition


AnyTool = Annotated[Tool | CustomTool, Field(discriminator="type")]


class NamedFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomChoice(WireModel):
    type: Literal["custom"]
    custom: NamedFunction
