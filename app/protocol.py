"""The OpenAI wire format for /v1/completions: parsing requests, building responses and stream chunks."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from app import schema
from app.errors import bad_request
from app.schema import Message
from app.tools import ToolCalling
from engine.types import SamplingParams

DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API
MAX_N = 16
MAX_LOGPROBS = 20
MAX_TOKENS_UNSET = 2**31  # the bound on min_tokens while max_tokens is still to be filled in

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


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object whose every string is valid Unicode; else a 400."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and integers of over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
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
    echo = optional(body, "echo", bool, False)
    logprobs = optional(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    options = _generation_options(body, body.get("max_tokens"), "max_tokens", logprobs, allow_zero=echo)
    return CompletionRequest(parse_model(body), _prompts(body), echo, options)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    _reject_unsupported(body, chat=True)
    messages = parse_messages(body)
    logprobs = None
    if optional(body, "logprobs", bool, False):
        logprobs = optional(body, "top_logprobs", int, 0)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    elif body.get("top_logprobs") is not None:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # As in the OpenAI chat API, no limit means: up to the context length (the route fills it in).
    options = _generation_options(body, body.get(field), field, logprobs, allow_zero=False, default_max_tokens=None)
    calling = _tool_calling(body)
    if calling is not None and calling.calls_allowed:
        if options.structured is not None:
            param = options.structured.param
            raise bad_request(f"{param} cannot be combined with tool calls (unless tool_choice is none)", param)
        if options.min_tokens:
            raise bad_request("min_tokens cannot hold back the end of a tool call", "min_tokens")
    return ChatRequest(parse_model(body), messages, options, calling)


def parse_messages(body: dict[str, Any]) -> list[Message]:
    if body.get("messages") is None:
        raise bad_request("messages is required", "messages")
    return schema.validated(schema.Messages, body["messages"], "messages")


def _tool_calling(body: dict[str, Any]) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when no tools are offered."""
    tools = schema.validated(schema.Tools, body.get("tools") or [], "tools")
    choice = body.get("tool_choice")
    choice = None if choice is None else schema.validated(schema.ToolChoice, choice, "tool_choice")
    parallel = optional(body, "parallel_tool_calls", bool, True)
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
    body: dict[str, Any],
    max_tokens: Any,
    max_tokens_param: str,
    logprobs: int | None,
    *,
    allow_zero: bool,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> GenerationOptions:
    stream = optional(body, "stream", bool, False)
    stream_options = optional(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    stream_options = stream_options or {}
    include_usage = optional(stream_options, "include_usage", bool, False, param="stream_options")
    continuous = optional(stream_options, "continuous_usage_stats", bool, False, param="stream_options")
    max_tokens = optional({max_tokens_param: max_tokens}, max_tokens_param, int, default_max_tokens)
    if max_tokens is not None and max_tokens < (0 if allow_zero else 1):
        limit = "at least 1 (0 only with echo)" if not allow_zero else "at least 0"
        raise bad_request(f"{max_tokens_param} must be {limit}, got {max_tokens}", max_tokens_param)
    n = _bounded_int(body, "n", 1, 1, MAX_N)
    best_of = _bounded_int(body, "best_of", n, n, MAX_N)
    if best_of > n and stream:
        raise bad_request("best_of cannot be used with stream", "best_of")
    min_tokens = _bounded_int(body, "min_tokens", 0, 0, MAX_TOKENS_UNSET if max_tokens is None else max_tokens)
    stop_token_ids = token_ids(body.get("stop_token_ids") or [], "stop_token_ids")
    return GenerationOptions(
        max_tokens=max_tokens,
        n=n,
        best_of=best_of,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        logprobs=logprobs,
        stop=_stop(body),
        include_stop=optional(body, "include_stop_str_in_output", bool, False),
        stop_token_ids=frozenset(stop_token_ids),
        min_tokens=min_tokens,
        ignore_eos=optional(body, "ignore_eos", bool, False),
        sampling=_sampling(body),
        structured=_structured_output(body, min_tokens),
    )


def _structured_output(body: dict[str, Any], min_tokens: int) -> StructuredOutput | None:
    """OpenAI's ``response_format``, or vLLM's ``structured_outputs`` (one of json, regex, choice, grammar)."""
    found = _response_format(body)
    vllm = optional(body, "structured_outputs", dict, None)
    if vllm is not None:
        if found is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        found = _vllm_structured_output(vllm)
    if found is not None and min_tokens:
        raise bad_request("min_tokens cannot hold back the end of a structured output", "min_tokens")
    return found


def _response_format(body: dict[str, Any]) -> StructuredOutput | None:
    response_format = optional(body, "response_format", dict, None)
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutput("json", {"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", True) if isinstance(spec, dict) else None  # no schema: any JSON value
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema must be an object with a schema object", "response_format")
        return StructuredOutput("json", schema, "response_format")
    raise bad_request("response_format.type must be text, json_object or json_schema", "response_format")


def _vllm_structured_output(spec: dict[str, Any]) -> StructuredOutput:
    given = [key for key in ("json", "regex", "choice", "grammar") if spec.get(key) is not None]
    if len(given) != 1:
        raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar", "structured_outputs")
    kind, value = given[0], spec[given[0]]
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request("structured_outputs.json is not valid JSON", "structured_outputs") from None
    valid = {
        "json": isinstance(value, dict | bool),
        "regex": isinstance(value, str),
        "grammar": isinstance(value, str),
        "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value),
    }[kind]
    if not valid:
        raise bad_request(f"structured_outputs.{kind} has the wrong type", "structured_outputs")
    return StructuredOutput(kind, value, "structured_outputs")  # type: ignore[arg-type]


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of non-empty strings", "stop")
    return tuple(stops)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    top_k = optional(body, "top_k", int, 0)  # vLLM's: -1 or 0 turn it off
    if top_k < -1:
        raise bad_request(f"top_k must be -1 (off), 0 (off) or positive, got {top_k}", "top_k")
    seed = optional(body, "seed", int, None)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad_request("seed must fit in 64 bits", "seed")
    return SamplingParams(
        temperature=_bounded_number(body, "temperature", 1.0, 0.0, 2.0),  # 1: the OpenAI API's default
        top_p=_bounded_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=max(top_k, 0),
        min_p=_bounded_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        presence_penalty=_bounded_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_bounded_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_bounded_number(body, "repetition_penalty", 1.0, 0.0, math.inf, open_low=True),
        logit_bias=_logit_bias(body),
    )


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = optional(body, "logit_bias", dict, {})
    parsed = []
    for key, value in bias.items():
        # "²".isdigit() holds but int("²") fails; int() also refuses over 4300 digits.
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        parsed.append((int(key), _bounded_number({"logit_bias": value}, "logit_bias", 0.0, -100.0, 100.0)))
    return tuple(parsed)


def _bounded_int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = optional(body, name, int, default)
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _bounded_number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"{name} must be a number, got {json.dumps(value)[:50]}", name)
    in_range = (low < value) if open_low else (low <= value)
    if not (in_range and value <= high and math.isfinite(value)):  # also rejects NaN and infinities
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise bad_request(f"{name} must be in {interval}, got {value}", name)
    return float(value)


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt))
    ):
        prompts = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, or a list of token ids (or of lists)", "prompt")
    for p in prompts:
        if not p:
            raise bad_request("a prompt must not be empty", "prompt")
        if isinstance(p, list):
            token_ids(p, "prompt")
    return prompts


def token_ids(value: Any, param: str) -> list[int]:
    """``value`` checked to be a list of token ids (non-negative integers; the vocabulary is the caller's)."""
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
