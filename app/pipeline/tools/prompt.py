"""Tools into the prompt: the default tool prompt for templates that do not render tools, and the conversation's
earlier calls and tool results written in the call syntax (or passed to a template that speaks it)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from app.pipeline.tools import ToolCalling
from app.pipeline.tools.pythonic_parser import call_text as pythonic_text
from app.pipeline.tools.syntax import CLOSE, OPEN, PYTHONIC, ToolSyntax
from app.wire.openai.messages import Message

TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def render(messages: list[Message], calling: ToolCalling | None, syntax: ToolSyntax) -> list[dict[str, Any]]:
    """The conversation as a chat template takes it. A template that renders tools and tool traffic itself
    (``syntax.native``) gets arguments as objects, as the templates expect, and call ids as it requires them;
    else they are written out as text here, in the default prompt's syntax."""
    if calling is not None and syntax.native:
        return [_native(message, syntax) for message in messages]
    turns = _as_text(messages)
    tools = calling.definitions() if calling is not None else []
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if turns[0]["role"] in ("system", "developer"):
            turns[0]["content"] += "\n\n" + prompt
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def _as_text(messages: list[Message]) -> list[dict[str, str]]:
    """Calls in the assistant's turn as the grammar spells them; tool results as one user turn of
    ``<tool_response>`` blocks per run of results, as Qwen's template writes them."""
    turns: list[dict[str, str]] = []
    after_result = False
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.text}\n</tool_response>"
            if after_result:
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response})
        elif message.tool_calls:
            calls = "\n".join(call_text(call.function.name, call.function.arguments) for call in message.tool_calls)
            turns.append({"role": "assistant", "content": "\n".join(filter(None, [message.text, calls]))})
        else:
            turns.append({"role": message.role, "content": message.text})
        after_result = message.role == "tool"
    return turns


def call_text(name: str, arguments: str) -> str:
    """One call as the grammar spells it (``JSON_STYLE``)."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:  # not JSON: passed on as the string it is
        args = json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def _native(message: Message, syntax: ToolSyntax) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.text}
    id_length = syntax.id_length
    if message.tool_calls and syntax.family == PYTHONIC.family:  # LFM2's template renders only content: the calls
        calls = [(c.function.name, _as_object(_loads(c))) for c in message.tool_calls]  # go in as the model wrote them
        rendered["content"] = (message.text or "") + pythonic_text(calls)
        return rendered
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": _call_id(c.id, id_length), "type": "function",
             "function": {"name": c.function.name, "arguments": _loads(c)}}
            for c in message.tool_calls
        ]  # fmt: skip
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = _call_id(message.tool_call_id, id_length)
    return rendered


def _call_id(call_id: str, length: int) -> str:
    """A call's id as the template requires it (Mistral's: 9 letters and digits): the id itself where it fits,
    else one made from it, the same for the call and its result."""
    if not length or (len(call_id) == length and call_id.isascii() and call_id.isalnum()):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:length]


def _as_object(arguments: Any) -> dict[str, Any]:
    """Arguments as keyword arguments: an object's members; anything else under ``arguments``."""
    return arguments if isinstance(arguments, dict) else {"arguments": arguments}


def _loads(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


# -- the grammar -------------------------------------------------------------------------------------------
