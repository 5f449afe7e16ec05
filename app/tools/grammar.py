"""The grammar that holds a reply's calls to the offered tools' schemas (llguidance's Lark dialect)."""

from __future__ import annotations

import json
from typing import Any

from app.openai.messages import Tool
from app.tools import ToolCalling
from app.tools.syntax import CLOSE, OPEN
from engine.core.grammar import JSON_STYLE


def call_schema(tool: Tool) -> dict[str, Any]:
    """A JSON schema for one call of ``tool``: ``{"name": <its name>, "arguments": <its parameters>}``, in
    that order. The parameters' ``$defs`` move to the root, where their ``#/$defs/...`` references point."""
    parameters = dict(tool.function.parameters)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    parameters.setdefault("type", "object")  # the API's arguments are an object
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": JSON_STYLE,  # as the tool prompt and call_text write calls
        **hoisted,
    }


#: ``tool_choice: "none"``: any text without the call marker. The tools stay in the prompt, as OpenAI and vLLM
#: show them, but no call can start.
NO_CALLS = f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{OPEN}.*)/\n"


def tool_grammar(calling: ToolCalling) -> str:
    """The Lark grammar (llguidance's dialect) the reply must follow."""
    if not calling.calls_allowed:
        return "%llguidance {}\n" + NO_CALLS
    bodies = [f"fn_{i}: %json {json.dumps(call_schema(tool))}" for i, tool in enumerate(calling.offered())]
    call = f'"{OPEN}\\n" body "\\n{CLOSE}"'
    more = ' ("\\n" call)*' if calling.parallel and calling.choice in ("auto", "required") else ""
    if calling.choice == "auto":
        # Text, or text up to the trigger and then calls: the lazy trigger ends at the first "<tool_call>".
        rules = [
            f"start: TEXT | first_call{more}",
            f'first_call: trigger "\\n" body "\\n{CLOSE}"',
            f'trigger[lazy]: TEXT "{OPEN}"',
            "TEXT: /(.|\\n)*/",
        ]
    else:
        rules = [f"start: call{more}"]
    rules += [f"call: {call}", "body: " + " | ".join(f"fn_{i}" for i in range(len(bodies))), *bodies]
    return "%llguidance {}\n" + "\n".join(rules) + "\n"
