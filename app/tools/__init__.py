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

from dataclasses import dataclass
from typing import Any, Literal

from app.openai.messages import Tool


@dataclass(slots=True, frozen=True)
class ToolCalling:
    """A chat request's ``tools``, ``tool_choice`` (none, auto, required, or a function's name) and
    ``parallel_tool_calls``."""

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    parallel: bool = True
    named: str | None = None  # the function a named choice calls

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    def offered(self) -> list[Tool]:
        """The tools the model may call: all of them, or the one named."""
        if self.choice != "named":
            return list(self.tools)
        return [tool for tool in self.tools if tool.function.name == self.named]

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the API spells them, for a prompt (``none`` shows the model none)."""
        if not self.calls_allowed:
            return []
        return [tool.model_dump(exclude_none=True) for tool in self.offered()]
