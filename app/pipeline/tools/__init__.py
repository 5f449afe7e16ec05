"""Tool calling: how tools reach the model, the grammar that holds its calls to their schemas, and how the calls
are read back out of the generated text (whole, or delta by delta as they stream). Torch-free.

The call syntax is Hermes's, which Qwen 2.5/3, Hermes and SmolLM3 were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that speaks it (it mentions ``<tool_call>``) gets the tools through its own ``tools``
argument. Any other template (SmolLM2's has no tools section) gets them in a system prompt, ``TOOL_PROMPT``,
ahead of the conversation; earlier calls and tool results are written into the conversation in the same syntax.

The grammar: ``required`` is one call (one or more with ``parallel_tool_calls``) to one of the tools; a named
``tool_choice`` is one call to that tool; ``auto`` lets the model write text, and once it writes ``<tool_call>``
(a lazy trigger, as llama.cpp's lazy grammars) the rest of the call is held to the grammar. Every call's
``arguments`` conform to the tool's ``parameters``, so a returned call always parses.

``syntax`` holds the call syntax; ``prompt`` puts tools and tool traffic into the conversation; ``grammar`` holds
calls to the tools' schemas; ``parser`` reads calls back out of the text. ``ToolCalling`` is a request's choice of
tools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from app.wire.openai.errors import bad_request
from app.wire.openai.messages import Tool


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """A chat request's ``tools``, ``tool_choice`` (none, auto, required, or a function's name) and
    ``parallel_tool_calls``."""

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    parallel: bool = True
    named: str | None = None  # the function a named choice calls
    #: Where tool i's parameters are in the request, for errors: chat nests them under ``function``.
    parameters_param: Callable[[int], str] = lambda index: f"tools[{index}].function.parameters"
    #: Custom (freeform) tools' input grammars by tool name: the Lark grammar a call's ``input`` string holds to,
    #: JSON-escaped (``app/pipeline/tools/freeform.py``); a custom tool of free text has none.
    freeform: Mapping[str, str] = field(default_factory=dict)

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    def offered(self) -> list[Tool]:
        """The tools the model may call: all of them, or the one named."""
        if self.choice != "named":
            return list(self.tools)
        return [tool for tool in self.tools if tool.function.name == self.named]

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the API spells them, for a prompt (``none`` shows them all: only calls are refused)."""
        return [tool.model_dump(exclude_none=True) for tool in self.offered()]


def tool_calling(
    tools: list[Tool], choice: str | None, named: str | None, parallel: bool, name_param: Callable[[int], str]
) -> ToolCalling | None:
    """A request's ``tools``, ``tool_choice`` (``"named"`` with ``named`` for a function's name) and
    ``parallel_tool_calls``, checked; None when no tools are offered. ``name_param(i)``: the path of tool i's name
    in the request, for errors."""
    if not tools:
        if choice not in (None, "none", "auto"):  # with no tools, "auto" means: no tool
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            param = name_param(index)
            raise bad_request(f"{param}: another tool is named {name} too", param)
    if named is not None:
        if named not in names:
            raise bad_request(f"tool_choice names {named}, which is not in tools", "tool_choice")
        return ToolCalling(tuple(tools), "named", parallel, named)
    return ToolCalling(tuple(tools), choice or "auto", parallel)  # type: ignore[arg-type]


def flat_parameters(index: int) -> str:
    """The Responses API's spelling of tool i's parameters (function tools are flat there)."""
    return f"tools[{index}].parameters"
