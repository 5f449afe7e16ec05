"""A chat conversation as harmony's ``Conversation``, rendered to tokens by openai-harmony: the system message with
the reasoning effort and today's date (as gpt-oss's own template writes it), the system and developer messages as
the developer's instructions, the function tools in the developer message, earlier calls as ``commentary``
messages addressed to their function and tool results as messages from it."""

from __future__ import annotations

import datetime
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from app.pipeline.harmony.encoding import CHANNEL, MESSAGE, Harmony
from app.pipeline.harmony.reader import FUNCTIONS
from app.pipeline.tools import ToolCalling
from app.wire.openai.errors import bad_request
from app.wire.openai.messages import Message as ChatMessage

#: ``reasoning_effort`` as the APIs spell it (OpenAI's ``none`` and ``minimal``, ``xhigh``), on harmony's three.
EFFORTS = {
    "none": ReasoningEffort.LOW, "minimal": ReasoningEffort.LOW, "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH, "xhigh": ReasoningEffort.HIGH,
}  # fmt: skip
#: The template variables a harmony prompt honours (gpt-oss's template's, and the server's own).
VARIABLES = frozenset({"reasoning_effort", "model_identity", "enable_thinking", "continue_final_message"})


def render(
    harmony: Harmony, messages: list[ChatMessage], calling: ToolCalling | None, extra: dict[str, Any]
) -> list[int]:
    """The prompt's tokens, ending where the assistant's reply begins (inside its final message where the
    conversation ends in the assistant's own text and ``continue_final_message`` asks it continued)."""
    unknown = sorted(set(extra) - VARIABLES)
    if unknown:
        param = f"chat_template_kwargs.{unknown[0]}"
        raise bad_request(f"{param}: this model's prompt is harmony's, which has no such variable", param)
    prefill = messages[-1].text if extra.get("continue_final_message") and messages[-1].role == "assistant" else None
    turns = messages[:-1] if prefill is not None else messages
    conversation = Conversation.from_messages([_system(extra), *_developer(turns, calling), *_turns(turns)])
    tokens = harmony.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    if prefill is not None:
        tokens += harmony.encoding.encode(f"{CHANNEL}final{MESSAGE}", allowed_special="all")
        tokens += harmony.encoding.encode(prefill)
    return tokens


def effort(extra: dict[str, Any]) -> ReasoningEffort:
    """The reasoning effort asked for: medium unless said; reasoning turned off (Anthropic's ``thinking``
    disabled) is the least, since gpt-oss always reasons."""
    if extra.get("enable_thinking") is False:
        return ReasoningEffort.LOW
    asked = extra.get("reasoning_effort", "medium")
    if asked not in EFFORTS:
        raise bad_request(f"reasoning_effort: one of {', '.join(EFFORTS)}", "reasoning_effort")
    return EFFORTS[asked]


def _system(extra: dict[str, Any]) -> Message:
    content = SystemContent.new().with_reasoning_effort(effort(extra))
    content = content.with_conversation_start_date(datetime.date.today().isoformat())
    if extra.get("model_identity"):
        content = content.with_model_identity(str(extra["model_identity"]))
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(messages: list[ChatMessage], calling: ToolCalling | None) -> list[Message]:
    """The developer message: the system and developer messages' text as instructions, and the tools."""
    instructions = "\n\n".join(m.text for m in messages if m.role in ("system", "developer") and m.text)
    tools = [
        ToolDescription.new(tool.function.name, tool.function.description or "", parameters=tool.function.parameters)
        for tool in (calling.offered() if calling is not None else [])
    ]
    if not instructions and not tools:
        return []
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(tools)
    return [Message.from_role_and_content(Role.DEVELOPER, content)]


def _turns(messages: list[ChatMessage]) -> list[Message]:
    """The user's, the assistant's and the tools' messages, in order."""
    names: dict[str, str] = {}  # the function each earlier call called, by its id
    turns: list[Message] = []
    for index, message in enumerate(messages):
        if message.role == "user":
            turns.append(Message.from_role_and_content(Role.USER, message.text))
        elif message.role == "assistant":
            turns += _assistant(message, names)
        elif message.role == "tool":
            name = names.get(message.tool_call_id or "")
            if name is None:
                param = f"messages[{index}].tool_call_id"
                raise bad_request(f"{param}: no earlier assistant message made a call with this id", param)
            author = Author.new(Role.TOOL, FUNCTIONS + name)
            result = Message.from_author_and_content(author, message.text)
            turns.append(result.with_channel("commentary").with_recipient("assistant"))
    return turns


def _assistant(message: ChatMessage, names: dict[str, str]) -> list[Message]:
    """An earlier reply: its text as the final answer (a preamble where calls follow it), its calls."""
    turns = []
    if message.text:
        channel = "commentary" if message.tool_calls else "final"
        turns.append(Message.from_role_and_content(Role.ASSISTANT, message.text).with_channel(channel))
    for call in message.tool_calls or []:
        names[call.id] = call.function.name
        said = Message.from_role_and_content(Role.ASSISTANT, call.function.arguments).with_channel("commentary")
        turns.append(said.with_recipient(FUNCTIONS + call.function.name).with_content_type("<|constrain|>json"))
    return turns
