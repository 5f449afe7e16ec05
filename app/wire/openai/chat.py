"""The wire format of ``/v1/chat/completions``: its body, its request (with tools), and how a choice, a stream delta and
logprobs are shaped (``chat.completion``, ``chat.completion.chunk``). Tool calls in the reply become ``tool_calls``
(``app/pipeline/tools/parser.py``); a custom tool's call is ``{"type": "custom", "custom": {"name", "input"}}``,
streamed whole once it is (the model writes its input JSON-escaped, ``app/pipeline/tools/freeform.py``); chat's
``top_logprobs`` holds exactly the number asked for, and each token's ``bytes`` are its own bytes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from app.pipeline.reply import Piece, Reader, Reading
from app.pipeline.tools import ToolCalling, tool_calling
from app.pipeline.tools.freeform import custom_input, offer_custom
from app.wire.openai.choices import Choice, token_string
from app.wire.openai.errors import bad_request
from app.wire.openai.messages import AnyTool, CustomTool, Message, NamedCustomChoice, NamedToolChoice, Tool
from app.wire.openai.request import validated
from app.wire.openai.sampling import (
    MAX_LOGPROBS,
    Effort,
    GenerationOptions,
    SamplingBody,
    generation_options,
    reject_unsupported,
)
from engine.core.streams import Delta
from engine.core.tokenizer import Tokenizer
from engine.core.types import TokenLogprob


class ChatBody(SamplingBody):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | NamedCustomChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Effort | None = None


#: The chat template's variables the server sets itself, and the rendering's own parameters (transformers'
#: ``apply_chat_template``: ``conversation`` given again was a TypeError, a 500): ``chat_template_kwargs`` may not.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "continue_final_message", "return_dict", "documents",
     "chat_template", "tools_in_user_message", "custom_tools", "bos_token", "eos_token", "conversation",
     "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
     "tokenizer_kwargs", "processor_kwargs", "kwargs", "self"}
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class ChatRequest:
    model: str | None
    messages: list[Message]
    options: GenerationOptions
    tools: ToolCalling | None = None  # None: no tools offered
    #: vLLM's ``chat_template_kwargs``: more variables for the model's template (Qwen3's ``enable_thinking``).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The custom tools' names: their calls come back as ``custom`` calls.
    custom: frozenset[str] = frozenset()


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    reject_unsupported(body, chat=True)
    req: ChatBody = validated(ChatBody, body)
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # As in the OpenAI chat API, no limit means: up to the context length (the route fills it in).
    max_tokens = req.max_completion_tokens if field == "max_completion_tokens" else req.max_tokens
    options = generation_options(req, max_tokens, field, logprobs, allow_zero=False, default_max_tokens=None)
    calling = _tool_calling(req)
    if calling is not None and calling.calls_allowed:
        if options.structured is not None:
            param = options.structured.param
            raise bad_request(f"{param} cannot be combined with tool calls (unless tool_choice is none)", param)
        if options.min_tokens:
            raise bad_request("min_tokens cannot hold back the end of a tool call", "min_tokens")
    kwargs = template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    custom = frozenset(tool.custom.name for tool in req.tools or () if isinstance(tool, CustomTool))
    return ChatRequest(req.model, list(req.messages), options, calling, kwargs, custom)


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``, checked: the variables the server sets are not the client's to set."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            param = f"chat_template_kwargs.{key}"
            raise bad_request(f"{param}: the server sets {key} itself", param)
    return dict(kwargs or {})


def _tool_calling(req: ChatBody) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tools are offered. A custom tool is
    offered as a function of one string, its grammar holding that string (``app/pipeline/tools/freeform.py``)."""
    tools, grammars = [], {}
    for index, tool in enumerate(req.tools or ()):
        if isinstance(tool, CustomTool):
            spec, grammar = tool.custom, (tool.custom.format.grammar if tool.custom.format else None)
            offered, grammars[spec.name] = offer_custom(spec.name, spec.description, grammar and grammar.syntax,
                                                        grammar and grammar.definition,
                                                        f"tools[{index}].custom.format.grammar.definition")  # fmt: skip
            tools.append(offered)
        else:
            tools.append(tool)
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if isinstance(choice, NamedCustomChoice):
        named = choice.custom.name
    if named is not None and (named in grammars) != isinstance(choice, NamedCustomChoice):
        raise bad_request(f"tool_choice names {named}, which is not a {choice.type} tool", "tool_choice")
    mode = "named" if named is not None else choice
    parallel = req.parallel_tool_calls is not False
    calling = tool_calling(tools, mode, named, parallel, lambda index: _tool_param(req.tools or [], index, "name"))
    if calling is None:
        return None
    return dataclasses.replace(calling, freeform={name: grammar for name, grammar in grammars.items() if grammar})


def _tool_param(tools: list[Tool | CustomTool], index: int, name: str) -> str:
    return f"tools[{index}].{'custom' if isinstance(tools[index], CustomTool) else 'function'}.{name}"


def _with_calls(finish_reason: str | None) -> str | None:
    """A reply that made calls and ended on its own ends for them; one cut by max_tokens stays "length"."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass(slots=True)
class ChatFormat:
    tokenizer: Tokenizer
    #: How replies are read: their tool calls become ``tool_calls`` (``app/pipeline/tools/``), their reasoning
    #: ``reasoning_content`` (``app/pipeline/reasoning.py``), and neither is content.
    reading: Reading = field(default_factory=Reading)
    object_name: str = "chat.completion"
    chunk_object_name: str = "chat.completion.chunk"
    id_prefix: str = "chatcmpl"
    #: The custom tools' names: their calls are ``custom`` calls, each streamed whole once it is.
    custom: frozenset[str] = frozenset()
    _readers: dict[int, Reader] = field(default_factory=dict)  # a stream's, by choice
    _held: dict[int, dict[str, Any]] = field(default_factory=dict)  # a stream's custom call being written, by choice

    def choice(self, index: int, choice: Choice, want_logprobs: bool) -> dict[str, Any]:
        reader = self.reading.reader()
        reader.feed(choice.text)
        reader.finish()  # what it held back joins the content, the reasoning or the calls
        message: dict[str, Any] = {"role": "assistant", "content": reader.content}
        if self.reading.reasons:
            message["reasoning_content"] = message["reasoning"] = reader.reasoning
        finish_reason: str | None = choice.finish_reason
        if reader.calls:
            message["tool_calls"] = [self._shaped(call.as_dict()) for call in reader.calls]
            finish_reason = _with_calls(finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": token_logprobs(self.tokenizer, choice.logprobs)} if want_logprobs else None,
            "finish_reason": finish_reason,
        }

    def delta(
        self, index: int, choice: Choice, delta: Delta, want_logprobs: bool, first: bool
    ) -> dict[str, Any] | None:
        finish_reason = delta.finish_reason
        reader = self._readers.setdefault(index, self.reading.reader())
        piece = reader.feed(delta.text)
        if finish_reason is not None:
            rest = reader.finish()
            piece = Piece(piece.reasoning + rest.reasoning, piece.content + rest.content, piece.calls + rest.calls)
            finish_reason = _with_calls(finish_reason) if reader.calls else finish_reason
        if self.custom and (piece.calls or finish_reason is not None):
            piece.calls = self._hold_custom(index, piece.calls, finish_reason is not None)
        if not (piece.reasoning or piece.content or piece.calls or first or want_logprobs or finish_reason):
            return None  # the reader holds the text back: it may begin a call, or end the reasoning
        content: dict[str, Any] = {"role": "assistant"} if first else {}
        if piece.reasoning:
            content["reasoning_content"] = content["reasoning"] = piece.reasoning
        if piece.content or not (piece.calls or piece.reasoning):
            content["content"] = piece.content
        if piece.calls:
            content["tool_calls"] = piece.calls
        return {
            "index": index,
            "delta": content,
            "logprobs": {"content": token_logprobs(self.tokenizer, delta.logprobs or [])} if want_logprobs else None,
            "finish_reason": finish_reason,
        }

    def _shaped(self, call: dict[str, Any]) -> dict[str, Any]:
        """A whole call as chat returns it: a custom tool's with its ``input``."""
        function = call.get("function", {})
        if function.get("name") not in self.custom:
            return call
        shaped = {"id": call["id"], "type": "custom", "custom": {"name": function["name"]}}
        shaped["custom"]["input"] = custom_input(function["arguments"])
        return {"index": call["index"], **shaped} if "index" in call else shaped

    def _hold_custom(self, index: int, deltas: list[dict[str, Any]], finished: bool) -> list[dict[str, Any]]:
        """A stream's call deltas with each custom call's held back and sent whole, once the next call begins or
        the reply ends (its input is JSON-escaped text until then)."""
        out: list[dict[str, Any]] = []
        for delta in deltas:
            held = self._held.get(index)
            if held is not None and "id" in delta:
                out.append(self._shaped(self._held.pop(index)))
                held = None
            if "id" in delta and delta["function"]["name"] in self.custom:
                self._held[index] = {**delta, "function": dict(delta["function"])}
            elif held is not None:
                held["function"]["arguments"] += delta["function"]["arguments"]
            else:
                out.append(delta)
        if finished and index in self._held:
            out.append(self._shaped(self._held.pop(index)))
        return out


def token_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's (and the Responses API's) logprobs: each token's string, logprob, own bytes and alternatives."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        return {"token": token_string(tokenizer, token_id), "logprob": logprob, "bytes": list(raw)}

    return [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries]
