"""``POST /v1/messages``'s body, checked as Anthropic's API checks it (unknown top-level fields are a 400, as there),
and turned into the conversation, options and tools the chat pipeline runs.

Content blocks: ``text``; ``tool_use`` (assistant) becomes a call, ``tool_result`` (user, string or text-block
content, ``is_error``) a tool message; earlier ``thinking`` and ``redacted_thinking`` blocks are left out of the
prompt (the templates drop earlier turns' reasoning); ``image`` and ``document`` are a 400 while the model has no
vision. ``system`` (a string or text blocks) and ``system`` messages inside ``messages`` (Claude Code sends one
after the user's) are system messages; Claude Code's ``x-anthropic-billing-header: ...`` line is left out (it
changes on every request, and would end every prefix-cache hit there). A last ``assistant`` message of text is a
prefill: the reply continues it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from app.pipeline.tools import ToolCalling, tool_calling
from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.messages import FunctionCall, Message, Tool, ToolCall
from app.wire.openai.request import Bounded, NonEmpty, validated
from app.wire.openai.sampling import GenerationOptions, StructuredOutput
from engine.core.types import SamplingParams

BILLING_HEADER = "x-anthropic-billing-header:"


class MessagesBody(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    model: NonEmpty
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Any], Field(min_length=1)]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[Bounded, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Bounded, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    #: Accepted, and no change to the reply here: ``user_id``, the tier, Claude Code's context management (the
    #: server clears nothing), automatic caching (the prefix cache is always on), where
    #: and how fast to run, the SDK 2.x's account fields.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    container: str | dict[str, Any] | None = None
    #: Not implemented (remote MCP servers the API itself would call): a 400 naming it.
    mcp_servers: None = None


@dataclass(slots=True, frozen=True)
class MessagesRequest:
    model: str
    messages: list[Message]
    options: GenerationOptions
    tools: ToolCalling | None
    #: The chat template's variables (``enable_thinking`` from ``thinking``).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The conversation ends in the assistant's own text, which the reply continues.
    prefill: bool = False
    #: ``thinking.budget_tokens``: the most tokens a reasoning model's reasoning may take.
    thinking_budget: int | None = None


def parse_messages_request(body: dict[str, Any]) -> MessagesRequest:
    req: MessagesBody = validated(MessagesBody, body)
    messages = [*_system(req.system), *_conversation(req.messages)]
    tools = [_tool(tool, index) for index, tool in enumerate(req.tools or [])]
    calling = _tool_choice(req.tool_choice, tools)
    structured = _output_format(req)
    if structured is not None and calling is not None and calling.calls_allowed:
        raise bad_request("output_format cannot be combined with tool calls (unless tool_choice is none)", "tools")
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
    )
    options = GenerationOptions(
        max_tokens=req.max_tokens, n=1, best_of=1, stream=bool(req.stream), include_usage=False,
        continuous_usage=False, logprobs=None, stop=tuple(req.stop_sequences or ()), include_stop=True,
        stop_token_ids=frozenset(), min_tokens=0, ignore_eos=False, sampling=sampling, structured=structured,
    )  # fmt: skip
    last = messages[-1]
    prefill = last.role == "assistant" and not last.tool_calls and bool(last.text)
    template_kwargs, budget = _thinking(req.thinking, req.max_tokens)
    template_kwargs.update(_effort(req.output_config))
    return MessagesRequest(req.model, messages, options, calling, template_kwargs, prefill, budget)


def _system(system: str | list[Any] | None) -> list[Message]:
    if system is None:
        return []
    texts = [system] if isinstance(system, str) else [_text_block(b, f"system[{i}]") for i, b in enumerate(system)]
    text = "\n".join(_without_billing_header(t) for t in texts)
    return [Message(role="system", content=text)] if text else []


def _without_billing_header(text: str) -> str:
    if not text.startswith(BILLING_HEADER):
        return text
    _, _, rest = text.partition("\n")
    return rest


def _text_block(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f"{param}: a system block must be {{'type': 'text', 'text': ...}}", param)
    return block["text"]


def _conversation(messages: list[Any]) -> list[Message]:
    out: list[Message] = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"{param}.role: must be user, assistant or system", f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append(Message(role=message["role"], content=content))
        elif isinstance(content, list):
            out += _blocks(message["role"], content, f"{param}.content")
        else:
            raise bad_request(f"{param}.content: must be a string or a list of content blocks", f"{param}.content")
    return out


def _blocks(role: str, blocks: list[Any], param: str) -> list[Message]:
    """One message's content blocks: tool results (each a tool message), then the text and calls."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[Message] = []
    for index, block in enumerate(blocks):
        where = f"{param}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use" and role == "assistant":
            call = validated(_ToolUse, block)
            arguments = json.dumps(call.input, ensure_ascii=False)
            calls.append(ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=arguments)))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning: the templates leave it out
        elif kind in ("image", "document"):
            raise bad_request(f"{where}.type: this model reads text only ({kind} blocks need vision)", f"{where}.type")
        else:
            raise bad_request(f"{where}.type: {kind!r} blocks are not supported in a {role} message", f"{where}.type")
    text = "".join(texts)
    turn = [Message(role=role, content=text or None, tool_calls=calls or None)] if text or calls else []
    return results + turn


class _ToolUse(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]


def _tool_result(block: dict[str, Any], param: str) -> Message:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        raise bad_request(f"{param}.tool_use_id: must be a non-empty string", f"{param}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(part, f"{param}.content[{i}]") for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content: must be a string or text blocks", f"{param}.content")
    if block.get("is_error"):
        content = f"Error: {content}"
    return Message(role="tool", content=content, tool_call_id=tool_use_id)


def _tool(tool: dict[str, Any], index: int) -> Tool:
    """A client tool (``name``, ``description``, ``input_schema``); server tools (web search, code execution,
    Anthropic's bash and editor) are a 400 naming their type."""
    param = f"tools[{index}]"
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise bad_request(f"{param}.type: {kind!r} tools run on Anthropic's servers, not here", f"{param}.type")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{param}.input_schema: must be a JSON schema object", f"{param}.input_schema")
    function = {"name": tool.get("name"), "description": tool.get("description"), "parameters": schema}
    try:
        return Tool.model_validate({"type": "function", "function": function})
    except ValueError:
        raise bad_request(f"{param}.name: must be 1-64 letters, digits, _ or -", f"{param}.name") from None


def _tool_choice(choice: dict[str, Any] | None, tools: list[Tool]) -> ToolCalling | None:
    choice = choice or {}
    kind = choice.get("type", "auto")
    modes = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    if kind not in modes:
        raise bad_request("tool_choice.type: must be auto, any, tool or none", "tool_choice.type")
    named = choice.get("name") if kind == "tool" else None
    if kind == "tool" and not isinstance(named, str):
        raise bad_request("tool_choice.name: a tool choice names the tool", "tool_choice.name")
    parallel = not choice.get("disable_parallel_tool_use", False)
    mode = modes[kind] if named is None else None
    try:
        calling = tool_calling(tools, mode, named, parallel, lambda index: f"tools[{index}].name")
    except APIError as exc:
        raise bad_request(exc.message, exc.param) from None
    if calling is None:
        return None
    return dataclasses.replace(calling, parameters_param=lambda index: f"tools[{index}].input_schema")


#: The fields of each kind of ``thinking``.
_THINKING = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"}, "disabled": {"type"}}
#: Anthropic's least reasoning budget.
MIN_BUDGET = 1024


def _thinking(thinking: dict[str, Any] | None, max_tokens: int) -> tuple[dict[str, Any], int | None]:
    """``thinking``: the template's variables and the reasoning's budget. Enabled (with ``budget_tokens``, as
    Anthropic's rules have it: at least 1,024 and less than ``max_tokens``) or adaptive lets a reasoning model reason
    (its default), disabled turns it off."""
    kind = (thinking or {}).get("type")
    if thinking is None:
        return {}, None
    if kind not in _THINKING:
        raise bad_request("thinking.type: must be enabled, disabled or adaptive", "thinking.type")
    unknown = sorted(set(thinking) - _THINKING[kind])
    if unknown:
        raise bad_request(f"thinking.{unknown[0]}: not a field of {kind} thinking", f"thinking.{unknown[0]}")
    if kind == "disabled":
        return {"enable_thinking": False}, None
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_BUDGET):
        raise bad_request(f"thinking.budget_tokens: an integer of at least {MIN_BUDGET}", "thinking.budget_tokens")
    if budget is not None and budget >= max_tokens:
        raise bad_request("max_tokens must be greater than thinking.budget_tokens", "max_tokens")
    return {}, budget


#: ``output_config.effort`` as the template's ``reasoning_effort`` (harmony honours it; ``max`` is its ``high``).
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


def _effort(config: dict[str, Any] | None) -> dict[str, Any]:
    effort = (config or {}).get("effort")
    if effort is None:
        return {}
    if effort not in _EFFORTS:
        raise bad_request(f"output_config.effort: one of {', '.join(_EFFORTS)}", "output_config.effort")
    return {"reasoning_effort": _EFFORTS[effort]}


def _output_format(req: MessagesBody) -> StructuredOutput | None:
    """Structured outputs: ``output_format`` (the beta's) or ``output_config.format``, a JSON schema."""
    spec = req.output_format or (req.output_config or {}).get("format")
    if spec is None:
        return None
    param = "output_format" if req.output_format is not None else "output_config.format"
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise bad_request(f"{param}: must be {{'type': 'json_schema', 'schema': {{...}}}}", param)
    return StructuredOutput("json", spec["schema"], param)
