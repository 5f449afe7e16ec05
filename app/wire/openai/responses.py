"""The wire format of ``/v1/responses`` (OpenAI's Responses API): its body, its input items as a chat
conversation, and the response object and stream events it answers with.

``instructions`` become the system message and the input items the conversation, so that a response and a chat
completion of the same conversation see the same prompt. Function tools are spelled flat
(``{"type": "function", "name", "parameters"}``); calls come back as ``function_call`` output items. The stream is
``app/wire/openai/response_events.py``'s.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import Field

from app.pipeline.tools import ToolCalling, flat_parameters, tool_calling
from app.pipeline.tools.freeform import custom_input, offer_custom
from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.messages import FunctionCall, FunctionDefinition, Message, Tool, ToolCall, custom_arguments
from app.wire.openai.request import NonEmpty, WireModel, validated
from app.wire.openai.sampling import (
    MAX_LOGPROBS,
    Effort,
    GenerationOptions,
    JsonSchemaFormat,
    ResponseFormat,
    SamplingBody,
    generation_options,
    reject_unsupported,
)

Model = TypeVar("Model", bound=WireModel)

#: ``include`` values the API defines. Only the logprobs one changes what this server returns; the others ask for
#: parts of items (search results, images, reasoning) this server never produces.
INCLUDABLE = frozenset({
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
})  # fmt: skip
#: Tools OpenAI runs on its own side (search, files, code, computers, images, remote MCP servers): a server on the
#: user's machine has none to run. A drop-in must not refuse the request (Codex offers ``web_search`` every turn):
#: they are not offered to the model, and ``SKIPPED_HEADER`` and the log name them.
HOSTED_TOOLS = ("web_search", "file_search", "code_interpreter", "computer_use", "image_generation", "mcp",
                "tool_search")  # fmt: skip
#: The response header naming the hosted tools a request offered and the model was not offered.
SKIPPED_HEADER = "x-smolserve-skipped-tools"
#: How a namespace's function is named to the model: unique among the request's tools, within OpenAI's pattern.
NAMESPACE_JOINER = "__"
#: Body fields of the API that change the answer and that this server does not implement: a 400 naming them.
_UNSUPPORTED = ("conversation", "prompt", "n", "best_of", "response_format", "messages", "echo", "suffix")
#: Other endpoints' spellings of what the Responses API names otherwise: a 400 that says which field to use.
_RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "logprobs": "include: ['message.output_text.logprobs']"}  # fmt: skip


class InputPart(WireModel):
    """Text in a message: ``input_text`` (sent), ``output_text`` (an assistant message as returned)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(WireModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[InputPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(WireModel):
    type: Literal["function_call"]
    call_id: NonEmpty
    name: NonEmpty
    arguments: str
    #: The namespace tool the function belongs to, as a response returns it.
    namespace: NonEmpty | None = None

    @property
    def qualified_name(self) -> str:
        """The name the model was offered (a namespace's function: ``namespace__name``)."""
        return self.name if self.namespace is None else f"{self.namespace}{NAMESPACE_JOINER}{self.name}"


class FunctionCallOutputItem(WireModel):
    type: Literal["function_call_output"]
    call_id: NonEmpty
    output: str | Annotated[list[InputPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class CustomCallItem(WireModel):
    """A custom tool's call as a response returned it: its ``input`` is the tool's free text."""

    type: Literal["custom_tool_call"]
    call_id: NonEmpty
    name: NonEmpty
    input: str

    @property
    def arguments(self) -> str:
        """The call as the model wrote it: a function call of one string (``custom_arguments``)."""
        return custom_arguments(self.input)


class CustomCallOutputItem(FunctionCallOutputItem):
    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


class ReasoningPart(WireModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(WireModel):
    """A reasoning item a response returned, sent back with the conversation (as the SDK passes ``output`` on):
    kept in the listed input, left out of the prompt (the templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] | None = None
    content: list[ReasoningPart] | None = None
    #: What ``include: ["reasoning.encrypted_content"]`` returned (``stateless`` store: false clients send it
    #: back); never read into the prompt: the templates drop earlier turns' reasoning.
    encrypted_content: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | CustomCallItem
_ITEM_MODELS: dict[str | None, type[WireModel]] = {
    None: InputMessage,
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "custom_tool_call": CustomCallItem,
    "custom_tool_call_output": CustomCallOutputItem,
}


class FunctionTool(WireModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomFormat(WireModel):
    """A custom tool's input: free text, or text of a grammar (Lark, as llguidance reads it, or a regex)."""

    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class CustomTool(WireModel):
    type: Literal["custom"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    format: CustomFormat | None = None


class NamedFunctionChoice(WireModel):
    type: Literal["function", "custom"]
    name: NonEmpty


class TextFormat(WireModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # for reasoning models: nothing to change here


class ResponsesBody(SamplingBody):
    input: Any = None  # a string or a list of items: checked item by item (``input_items``)
    instructions: str | None = None
    max_output_tokens: int | None = None
    store: bool | None = None
    previous_response_id: NonEmpty | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    #: ``effort`` is the template's ``reasoning_effort`` (harmony honours it); ``summary``: no summary is made, the
    #: reasoning items hold the reasoning's own text.
    reasoning: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: a tool type this server lacks is a 400
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    text: TextConfig | None = None
    background: bool | None = None


@dataclass(slots=True, frozen=True)
class ResponsesRequest:
    """A checked Responses request: what to run, and what the response object echoes back."""

    model: str | None
    items: list[InputItem]  # the new input, as items
    options: GenerationOptions
    tools: ToolCalling | None
    body: ResponsesBody
    #: ``include`` asked for the output text's logprobs.
    logprobs: bool = False
    wire_tools: list[dict[str, Any]] = field(default_factory=list)  # the tools as sent, for the response object
    #: A namespace's functions by the name the model was offered: (namespace, name).
    namespaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: The custom tools' names: their calls are ``custom_tool_call`` items.
    custom: frozenset[str] = frozenset()
    #: The hosted tools offered that this server does not run (``HOSTED_TOOLS``), by type.
    skipped: tuple[str, ...] = ()
    #: ``include`` asked for reasoning items' ``encrypted_content``.
    encrypted_reasoning: bool = False

    @property
    def store(self) -> bool:
        return self.body.store is not False

    @property
    def instructions(self) -> str | None:
        return self.body.instructions

    @property
    def truncate(self) -> bool:
        return self.body.truncation == "auto"

    @property
    def template_kwargs(self) -> dict[str, Any]:
        effort = (self.body.reasoning or {}).get("effort")
        return {} if effort is None else {"reasoning_effort": effort}


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request(f"{name} is not supported by /v1/responses on this server", name)
    for name, instead in _RENAMED.items():
        if body.get(name) is not None:
            raise bad_request(f"{name} is not a field of /v1/responses: use {instead}", name)
    reject_unsupported(body, chat=True)
    if body.get("background"):
        raise bad_request("background responses are not supported by this server", "background")
    req: ResponsesBody = validated(ResponsesBody, body)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in get_args(Effort):
        raise bad_request(f"reasoning.effort: one of {', '.join(get_args(Effort))}", "reasoning.effort")
    items = input_items(req.input)
    include = req.include or []
    for index, name in enumerate(include):
        if name not in INCLUDABLE:
            raise bad_request(f"include[{index}]: unknown value {name!r}", f"include[{index}]")
    logprobs = "message.output_text.logprobs" in include
    if req.top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs include: ['message.output_text.logprobs']", "top_logprobs")
    wire_tools = req.tools or []
    offered = _offered_tools(wire_tools)
    calling = _tool_calling(req, offered)
    sampling = req.model_copy(update={"response_format": _response_format(req.text)})
    options = generation_options(
        sampling, req.max_output_tokens, "max_output_tokens", (req.top_logprobs or 0) if logprobs else None,
        allow_zero=False, default_max_tokens=None,
    )  # fmt: skip
    if options.structured is not None:  # errors name the field as this endpoint spells it
        options = dataclasses.replace(options, structured=dataclasses.replace(options.structured, param="text.format"))
    if calling is not None and calling.calls_allowed and options.structured is not None:
        raise bad_request("text.format cannot be combined with tool calls (unless tool_choice is none)", "text.format")
    return ResponsesRequest(req.model, items, options, calling, req, logprobs, wire_tools, offered.namespaced,
                            frozenset(offered.freeform), tuple(offered.skipped),
                            "reasoning.encrypted_content" in include)  # fmt: skip


def input_items(value: Any) -> list[InputItem]:
    """``input``: a string (one user message) or a non-empty list of items, each checked by its type."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input must not be empty", "input")
        return [InputMessage(role="user", content=value)]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string or a non-empty list of items", "input")
    return [_item(item, index) for index, item in enumerate(value)]


def _item(item: Any, index: int) -> InputItem:
    param = f"input[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object", param)
    kind = item.get("type")
    model = _ITEM_MODELS.get(kind)
    if model is None:
        raise bad_request(f"{param}.type: items of type {kind!r} are not supported by this server", f"{param}.type")
    return _validated_at(model, item, param)


def _validated_at(model: type[Model], value: Any, param: str) -> Model:
    """``validated``, its errors naming the field under ``param`` (an item or a tool of the request)."""
    try:
        return validated(model, value)
    except APIError as exc:
        inner = f"{param}.{exc.param}" if exc.param else param
        raise bad_request(f"{param}: {exc.message}", inner) from None


@dataclass(slots=True)
class _Offered:
    """The request's tools as the model is offered them."""

    functions: list[Tool] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Custom tools by name: their input's grammar, JSON-escaped ("" for free text).
    freeform: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _offered_tools(wire_tools: list[Any]) -> _Offered:
    """Function tools as they are; a ``namespace`` tool's functions each as ``namespace__name``; hosted tools
    left out (``HOSTED_TOOLS``); any other type a 400 naming it."""
    offered = _Offered()
    for index, tool in enumerate(wire_tools):
        param = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind.startswith(HOSTED_TOOLS):
            if kind not in offered.skipped:
                offered.skipped.append(kind)
        elif kind == "namespace":
            _namespace(tool, param, offered)
        elif kind == "custom":
            _custom(tool, param, offered)
        else:
            offered.functions.append(_function_tool(tool, param))
    return offered


def _namespace(tool: dict[str, Any], param: str, offered: _Offered) -> None:
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise bad_request(f"{param}.name: a namespace's name is required", f"{param}.name")
    if not isinstance(inner, list):
        raise bad_request(f"{param}.tools: a namespace holds a list of tools", f"{param}.tools")
    for index, function in enumerate(inner):
        spec = _function_tool(function, f"{param}.tools[{index}]")
        qualified = f"{namespace}{NAMESPACE_JOINER}{spec.function.name}"
        renamed = spec.function.model_copy(update={"name": qualified})
        try:
            renamed = FunctionDefinition.model_validate(renamed.model_dump())
        except ValueError:
            raise bad_request(f"{param}.tools[{index}].name: {qualified!r}, the name the model is offered, is "
                              "longer than 64 characters", f"{param}.tools[{index}].name") from None  # fmt: skip
        offered.functions.append(Tool(type="function", function=renamed))
        offered.namespaced[qualified] = (namespace, spec.function.name)


def _custom(tool: dict[str, Any], param: str, offered: _Offered) -> None:
    """A custom tool, offered as a function of one string whose text its grammar holds
    (``app/pipeline/tools/freeform.py``)."""
    spec = _validated_at(CustomTool, tool, param)
    form = spec.format or CustomFormat(type="text")
    syntax, definition = (form.syntax, form.definition) if form.type == "grammar" else (None, None)
    if form.type == "grammar" and (syntax is None or not definition):
        raise bad_request(f"{param}.format: a grammar needs its syntax and definition", f"{param}.format")
    offered_tool, grammar = offer_custom(spec.name, spec.description, syntax, definition, f"{param}.format.definition")
    offered.functions.append(offered_tool)
    offered.freeform[spec.name] = grammar


def _function_tool(tool: Any, param: str) -> Tool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise bad_request(f"{param}.type: {kind!r} tools are not supported by this server", f"{param}.type")
    spec = _validated_at(FunctionTool, tool, param)
    definition = {"name": spec.name, "description": spec.description, "strict": spec.strict}
    if spec.parameters is not None:
        definition["parameters"] = spec.parameters
    return Tool(type="function", function=FunctionDefinition(**definition))


def _tool_calling(req: ResponsesBody, offered: _Offered) -> ToolCalling | None:
    choice = req.tool_choice
    named = choice.name if isinstance(choice, NamedFunctionChoice) else None
    if isinstance(choice, NamedFunctionChoice) and (choice.type == "custom") != (named in offered.freeform):
        raise bad_request(f"tool_choice names {named}, which is not a {choice.type} tool", "tool_choice")
    mode = "named" if named is not None else choice
    parallel = req.parallel_tool_calls is not False
    calling = tool_calling(offered.functions, mode, named, parallel, lambda index: f"tools[{index}].name")
    if calling is None:
        return None
    grammars = {name: grammar for name, grammar in offered.freeform.items() if grammar}
    return dataclasses.replace(calling, parameters_param=flat_parameters, freeform=grammars)


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    spec = text.format if text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return ResponseFormat(type="json_object")
    schema = True if spec.schema_ is None else spec.schema_
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(name=spec.name, schema=schema, strict=spec.strict)
    )


# -- the conversation ----------------------------------------------------------------------------------------


def conversation(items: list[InputItem]) -> list[Message]:
    """Input items as chat messages: consecutive function calls join the assistant message before them (or a new
    one), as a chat completion's ``tool_calls``; a call's output is a ``tool`` message."""
    messages: list[Message] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append(Message(role=item.role, content=item.text))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(Message(role="tool", content=item.text, tool_call_id=item.call_id))
        elif isinstance(item, FunctionCallItem | CustomCallItem):
            name = item.qualified_name if isinstance(item, FunctionCallItem) else item.name
            call = ToolCall(id=item.call_id, function=FunctionCall(name=name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                content = last.content if last.content != "" else None
                messages[-1] = Message(role="assistant", content=content, tool_calls=[*(last.tool_calls or []), call])
            else:
                messages.append(Message(role="assistant", tool_calls=[call]))
    return messages


def with_instructions(instructions: str | None, messages: list[Message]) -> list[Message]:
    return messages if instructions is None else [Message(role="system", content=instructions), *messages]


def output_messages(output: list[dict[str, Any]]) -> list[Message]:
    """A response's output items as the conversation continues them: one assistant message, its text and calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
        if item["type"] == "function_call"
        else ToolCall(
            id=item["call_id"], function=FunctionCall(name=item["name"], arguments=custom_arguments(item["input"]))
        )
        for item in output
        if item["type"] in ("function_call", "custom_tool_call")
    ]
    return [Message(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)]


def item_texts(items: list[InputItem]) -> list[str]:
    """Every text an item carries, for the check that the input could fit the context at all."""
    texts = []
    for item in items:
        texts.append(item.arguments if isinstance(item, FunctionCallItem | CustomCallItem) else item.text)
    return texts


# -- what goes back ------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def stored_input_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """The input as the API lists it (``GET /v1/responses/{id}/input_items``): every item with an id."""
    listed = []
    for item in items:
        if isinstance(item, InputMessage):
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": kind, "text": item.text}]
            listed.append({"id": new_id("msg"), "type": "message", "role": item.role, "content": content,
                           "status": "completed"})  # fmt: skip
        elif isinstance(item, FunctionCallItem):
            listed.append({"id": new_id("fc"), "type": "function_call", "call_id": item.call_id, "name": item.name,
                           "arguments": item.arguments, "status": "completed"})  # fmt: skip
        elif isinstance(item, CustomCallItem):
            listed.append({"id": new_id("ctc"), "type": "custom_tool_call", "call_id": item.call_id,
                           "name": item.name, "input": item.input, "status": "completed"})  # fmt: skip
        elif isinstance(item, ReasoningItem):
            listed.append(reasoning_item(new_id("rs"), item.text, "completed"))
        else:
            listed.append({"id": new_id("fco"), "type": item.type, "call_id": item.call_id, "output": item.text,
                           "status": "completed"})  # fmt: skip
    return listed


def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def reasoning_item(item_id: str, text: str, status: str, encrypted: bool = False) -> dict[str, Any]:
    """The model's reasoning (``app/pipeline/reasoning.py``), as its text: no summary is made. ``encrypted``: with
    OpenAI's ``encrypted_content`` too, an opaque blob of it (base64 of its JSON; nothing kept on the server: a client
    that does not store responses sends the item back as it came)."""
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}  # fmt: skip
    if encrypted:
        item["encrypted_content"] = base64.b64encode(json.dumps({"reasoning_text": text}).encode()).decode()
    return item


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str,
              namespaced: Mapping[str, tuple[str, str]] = MappingProxyType({}),
              custom: frozenset[str] = frozenset()) -> dict[str, Any]:  # fmt: skip
    """A ``function_call`` item; a namespace's function named as the client offered it, with its ``namespace``;
    a custom tool's call a ``custom_tool_call`` item with its ``input``."""
    if name in custom:
        return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name,
                "input": custom_input(arguments), "status": status}  # fmt: skip
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip
    if name in namespaced:
        item["namespace"], item["name"] = namespaced[name]
    return item


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        # Prompt tokens this response computed: the prefix cache keeps their full blocks for later requests.
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": input_tokens - cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def text_config(body: ResponsesBody) -> dict[str, Any]:
    spec = body.text.format if body.text is not None else None
    if spec is None:
        return {"format": {"type": "text"}}
    return {"format": spec.model_dump(by_alias=True, exclude_none=True)}


def tool_choice(body: ResponsesBody) -> Any:
    choice = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def response_object(
    req: ResponsesRequest,
    response_id: str,
    model: str,
    created_at: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object: every field the SDK's ``Response`` requires, and the request's settings echoed."""
    body = req.body
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "background": False,
        "error": error, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
        "store": req.store, "temperature": body.temperature, "text": text_config(body),
        "tool_choice": tool_choice(body), "tools": req.wire_tools, "top_p": body.top_p,
        "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {},
    }  # fmt: skip


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def input_item_list(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: a page of the input items, ``order`` ``desc`` (the API's default) or
    ``asc``, ``limit`` 1..100 (20), starting ``after`` an item's id."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"after: no input item {after!r} in this response", "after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[: int(limit_text)]
    return {
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page),
    }  # fmt: skip
