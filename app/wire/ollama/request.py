"""Ollama's ``/api/chat`` and ``/api/generate`` bodies as the chat pipeline takes them: its messages (tool calls with
object arguments, ``tool`` messages by ``tool_name``), ``format``, ``think`` and ``options`` onto chat completions'
fields, checked there (``app/wire/openai/chat.py``). An option that changes the reply and is not implemented is a 400
naming it; options about where and how the model runs (threads, GPUs, memory mapping) do not change a reply here."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from app.wire.openai.errors import bad_request

#: Ollama's sampling options, as chat completions names them.
SAMPLING = {
    "num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}  # fmt: skip
#: Options about the runtime (where and how the model runs), none of which changes a reply here.
RUNTIME = frozenset({"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_thread", "numa",
                     "low_vram", "num_keep"})  # fmt: skip
#: Sampling options at the value that turns them off (Ollama's defaults): accepted; any other value is a 400.
OFF = {"repeat_last_n": (-1, 64), "typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,), "mirostat_tau": (5.0,),
       "mirostat_eta": (0.1,), "penalize_newline": (False, True)}  # fmt: skip
#: Fields of both bodies that need what this server does not have.
_REFUSED = {"images": "images: no vision model is served", "template": "template: the model's own template is used"}


#: A Go duration's units (Ollama's ``keep_alive`` is one: "5m", "1h30m", "-1"), in seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def keep_alive(value: Any) -> float | None:
    """``keep_alive`` in seconds (negative: for good; 0: unload at once); None where not given."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        sign, text = (-1.0, value[1:]) if value.startswith("-") else (1.0, value)
        with contextlib.suppress(ValueError):
            return sign * float(text)
        parts = _DURATION.findall(text)
        if parts and "".join(number + unit for number, unit in parts) == text:
            return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)
    raise bad_request('keep_alive: seconds, or a duration such as "5m" or "1h30m" (negative: for good)', "keep_alive")


def model_name(body: dict[str, Any]) -> str:
    """The model asked for, without the ``:latest`` tag Ollama's clients add."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    return name.removesuffix(":latest")


def chat_body(body: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """``/api/chat``'s body as chat completions' (the stream on unless ``stream`` is false)."""
    _refuse(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    chat = {"model": model_name(body), "messages": _messages(messages), "stream": body.get("stream") is not False,
            **options(body.get("options"), max_model_len), **_format(body.get("format"))}  # fmt: skip
    if body.get("tools"):
        chat["tools"] = body["tools"]
    if body.get("think") is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": bool(body["think"])}
    return chat


def options(given: Any, max_model_len: int) -> dict[str, Any]:
    """``options`` as chat completions' fields; ``num_predict`` -1 or -2 (until the end, or the context's): none."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise bad_request("options must be an object", "options")
    fields: dict[str, Any] = {}
    for key, value in given.items():
        if key in SAMPLING:
            fields[SAMPLING[key]] = value
        elif key == "num_ctx":
            if not isinstance(value, int) or value > max_model_len:
                raise bad_request(f"options.num_ctx: at most the model's context, {max_model_len}", "options.num_ctx")
        elif key in OFF and value not in OFF[key]:
            raise bad_request(f"options.{key}: not implemented (only {OFF[key][0]})", f"options.{key}")
        elif key not in RUNTIME and key not in OFF:
            raise bad_request(f"options.{key}: not an option this server knows", f"options.{key}")
    if fields.get("max_tokens") in (-1, -2):
        del fields["max_tokens"]
    return fields


def _format(value: Any) -> dict[str, Any]:
    """``format``: ``"json"``, or a JSON schema the reply must match."""
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise bad_request('format: "json" or a JSON schema', "format")


def _refuse(body: dict[str, Any]) -> None:
    for name, why in _REFUSED.items():
        if body.get(name):
            raise bad_request(why, name)
    for index, message in enumerate(body.get("messages") or []):
        if isinstance(message, dict) and message.get("images"):
            raise bad_request(_REFUSED["images"], f"messages[{index}].images")


def _messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Ollama's messages as chat completions': each call gets an id, which the ``tool`` message naming its function
    after it answers (Ollama's tool messages name the function, not a call)."""
    out: list[dict[str, Any]] = []
    pending: dict[str, list[str]] = {}  # call ids not yet answered, by function
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object", f"messages[{index}]")
        turn = {key: message[key] for key in ("role", "content") if key in message}
        calls = message.get("tool_calls")
        if calls:
            turn["tool_calls"] = [_call(call, f"call_{index}_{n}", pending) for n, call in enumerate(calls)]
        if message.get("role") == "tool":
            name = message.get("tool_name") or message.get("name") or ""
            waiting = pending.get(name) or next((ids for ids in pending.values() if ids), None)
            turn["tool_call_id"] = waiting.pop(0) if waiting else f"call_{index}"
        out.append(turn)
    return out


def _call(call: Any, call_id: str, pending: dict[str, list[str]]) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    name, arguments = function.get("name", ""), function.get("arguments", {})
    pending.setdefault(name, []).append(call_id)
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
