"""The OpenAI wire format: a request body (checked field by field by its model in ``schema.py``) becomes what a
generation needs, with the rules that tie fields together; plus the Unicode check and the response helpers."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from app import schema
from app.errors import bad_request
from app.schema import Message
from app.tools import ToolCalling
from engine.core.types import SamplingParams

DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API

Prompt = str | list[int]


@dataclass(slots=True, frozen=True)
class GenerationOptions:
    """What completions and chat completions share: how much to generate, how to sample, when to stop."""

    max_tokens: int | None  # None only for chat before the route knows the prompt's length
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None
    stop: tuple[str, ...]
    include_stop: bool
    stop_token_ids: frozenset[int]
    min_tokens: int
    ignore_eos: bool
    sampling: SamplingParams
    structured: StructuredOutput | None = None


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """What the output must match: JSON of a schema, a regex, one of some strings, or a Lark grammar."""

    kind: Literal["json", "regex", "choice", "grammar"]
    value: Any  # a JSON schema (an object or a boolean), a pattern, a list of strings, a grammar's text
    param: str  # the request field it came from, for errors


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[Prompt]
    echo: bool
    options: GenerationOptions


@dataclass(slots=True, frozen=True)
class ChatRequest:
    model: str | None
    messages: list[Message]
    options: GenerationOptions
    tools: ToolCalling | None = None  # None: no tools offered


def parse_json_object(raw: bytes, check: Callable[[dict[str, Any]], None] = lambda body: None) -> dict[str, Any]:
    """The request body as a JSON object whose every string is valid Unicode; else a 400. ``check`` runs first, on
    the parsed object: the cheap checks (list lengths) before the walk over every string."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and integers of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check(body)
    _check_unicode(body)
    return body


# JSON may escape half of a UTF-16 surrogate pair ("\udbff") on its own: valid JSON, but no character, so no
# tokenizer can encode it. Every text field arrives through the body, so one check here covers them all.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(body: dict[str, Any]) -> None:
    """A 400 naming the first field (``messages[0].content``) that holds an unpaired surrogate."""
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:  # not recursive: a deeply nested body must not exhaust the stack
        path, value = pending.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                raise bad_request(
                    f"{path} is not valid Unicode: it holds an unpaired surrogate "
                    f"(\\u{ord(found.group()):04x} at character {found.start()})",
                    path,
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    field = path or "the body"
                    raise bad_request(f"a key of {field} is not valid Unicode: it holds an unpaired surrogate", path)
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))


# Fields that change what a client gets back and that this server does not implement yet: a 400 naming the field,
# never a 200 whose output silently ignores it (a client asking for JSON must not believe it got JSON).
_UNSUPPORTED = ("suffix", "functions", "function_call", "audio", "web_search_options")
_UNSUPPORTED += ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")
_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    for name in _UNSUPPORTED if chat else _UNSUPPORTED + _CHAT_ONLY:
        value = body.get(name)
        if value is not None and value != []:  # clients may send empty tools
            hint = "" if chat else " (tools are a chat completions feature)"
            raise bad_request(f"{name} is not supported by this server{hint}", name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request("only the text modality is supported", "modalities")


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    _reject_unsupported(body, chat=False)
    req: schema.CompletionBody = schema.validated(schema.CompletionBody, body)
    echo = bool(req.echo)
    options = _generation_options(req, req.max_tokens, "max_tokens", req.logprobs, allow_zero=echo)
    return CompletionRequest(req.model, req.prompt, echo, options)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    _reject_unsupported(body, chat=True)
    req: schema.ChatBody = schema.validated(schema.ChatBody, body)
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    elif req.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # As in the OpenAI chat API, no limit means: up to the context length (the route fills it in).
    max_tokens = req.max_completion_tokens if field == "max_completion_tokens" else req.max_tokens
    options = _generation_options(req, max_tokens, field, logprobs, allow_zero=False, default_max_tokens=None)
    calling = _tool_calling(req)
    if calling is not None and calling.calls_allowed:
        if options.structured is not None:
            param = options.structured.param
            raise bad_request(f"{param} cannot be combined with tool calls (unless tool_choice is none)", param)
        if options.min_tokens:
            raise bad_request("min_tokens cannot hold back the end of a tool call", "min_tokens")
    return ChatRequest(req.model, list(req.messages), options, calling)


def _tool_calling(req: schema.ChatBody) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tools are offered."""
    tools, choice = req.tools or [], req.tool_choice
    parallel = req.parallel_tool_calls is not False
    if not tools:
        if choice not in (None, "none", "auto"):  # with no tools, "auto" means: no tool
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            param = f"tools[{index}].function.name"
            raise bad_request(f"{param}: another tool is named {name} too", param)
    if isinstance(choice, schema.NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name}, which is not in tools", "tool_choice")
        return ToolCalling(tuple(tools), "named", parallel, choice.function.name)
    return ToolCalling(tuple(tools), choice or "auto", parallel)


def _generation_options(
    req: schema.CompletionBody | schema.ChatBody,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    *,
    allow_zero: bool,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> GenerationOptions:
    """The rules that tie fields together; each field on its own was checked by the body's model."""
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    stream_options = req.stream_options or schema.StreamOptions()
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens < (0 if allow_zero else 1):
        limit = "at least 1 (0 only with echo)" if not allow_zero else "at least 0"
        raise bad_request(f"{max_tokens_param} must be {limit}, got {max_tokens}", max_tokens_param)
    n = req.n or 1
    best_of = n if req.best_of is None else req.best_of
    if best_of < n:
        raise bad_request(f"best_of must be at least n ({n}), got {best_of}", "best_of")
    if best_of > n and stream:
        raise bad_request("best_of cannot be used with stream", "best_of")
    min_tokens = req.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
    stop = req.stop if req.stop is not None else []
    return GenerationOptions(
        max_tokens=max_tokens,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=bool(stream_options.include_usage),
        continuous_usage=bool(stream_options.continuous_usage_stats),
        logprobs=logprobs,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        include_stop=bool(req.include_stop_str_in_output),
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        min_tokens=min_tokens,
        ignore_eos=bool(req.ignore_eos),
        sampling=_sampling(req),
        structured=_structured_output(req, min_tokens),
    )


def _structured_output(req: schema.CompletionBody | schema.ChatBody, min_tokens: int) -> StructuredOutput | None:
    """OpenAI's ``response_format``, or vLLM's ``structured_outputs`` (one of json, regex, choice, grammar)."""
    found = _response_format(req.response_format)
    spec = req.structured_outputs
    if spec is not None:
        if found is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        found = StructuredOutput(*spec.chosen(), "structured_outputs")
    if found is not None and min_tokens:
        raise bad_request("min_tokens cannot hold back the end of a structured output", "min_tokens")
    return found


def _response_format(response_format: schema.ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json", {"type": "object"}, "response_format")
    spec = response_format.json_schema
    return StructuredOutput("json", True if spec is None else spec.schema_, "response_format")


def _sampling(req: schema.CompletionBody | schema.ChatBody) -> SamplingParams:
    def number(value: float | None, default: float) -> float:
        return default if value is None else float(value)

    return SamplingParams(
        temperature=number(req.temperature, 1.0),  # 1: the OpenAI API's default
        top_p=number(req.top_p, 1.0),
        top_k=max(req.top_k or 0, 0),
        min_p=number(req.min_p, 0.0),
        seed=req.seed,
        presence_penalty=number(req.presence_penalty, 0.0),
        frequency_penalty=number(req.frequency_penalty, 0.0),
        repetition_penalty=number(req.repetition_penalty, 1.0),
        logit_bias=req.token_biases(),
    )


def token_ids(value: Any, param: str) -> list[int]:
    """``value`` checked to be a list of token ids (non-negative integers; the vocabulary is the caller's)."""
    if not isinstance(value, list) or not all(schema.is_token(t) for t in value):
        raise bad_request(f"{param} must be a list of non-negative integer token ids", param)
    return value


def parse_model(body: dict[str, Any]) -> str | None:
    return optional(body, "model", str, None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "a list"}


def optional(body: dict[str, Any], name: str, kind: type, default: Any, *, param: str | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (JSON null means absent); a wrong type is a 400."""
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise bad_request(f"{name} must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:50]}", param or name)
    return value


# -- responses ------------------------------------------------------------------------------------------


def new_id() -> str:
    return uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts prompt tokens from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
