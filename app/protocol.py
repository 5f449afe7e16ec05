"""The OpenAI wire format for /v1/completions: parsing requests, building responses and stream chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from app.errors import bad_request
from engine.types import FinishReason, SamplingParams

DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    sampling: SamplingParams


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    stream = _optional(body, "stream", bool, False)
    stream_options = _optional(body, "stream_options", dict, None)
    include_usage = False
    if stream_options is not None:
        include_usage = _optional(stream_options, "include_usage", bool, False, param="stream_options")
    max_tokens = _optional(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    return CompletionRequest(
        model=_optional(body, "model", str, None),
        prompt=_prompt(body),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_optional(body, "ignore_eos", bool, False),
        sampling=_sampling(body),
    )


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)  # the OpenAI API's default
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _optional(body, "top_k", int, 0)  # vLLM's: -1 or 0 turn it off
    if top_k < -1:
        raise bad_request(f"top_k must be -1 (off), 0 (off) or positive, got {top_k}", "top_k")
    seed = _optional(body, "seed", int, None)
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad_request("seed must fit in 64 bits", "seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:  # value != value: NaN
        raise bad_request(f"{name} must be a number, got {json.dumps(value)[:50]}", name)
    return float(value)


def _prompt(body: dict[str, Any]) -> str | list[int]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return prompt
    raise bad_request("prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", str: "a string", dict: "an object"}


def _optional(body: dict[str, Any], name: str, kind: type, default: Any, *, param: str | None = None) -> Any:
    """``body[name]`` checked to be of ``kind`` (JSON null means absent); a wrong type is a 400."""
    value = body.get(name)
    if value is None:
        return default
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise bad_request(f"{name} must be {_TYPE_NAMES[kind]}, got {json.dumps(value)[:50]}", param or name)
    return value


# -- responses ------------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    request_id: str, model: str, text: str, finish_reason: FinishReason | None, usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_chunk(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    *,
    include_usage: bool,
    usage_: dict[str, int] | None = None,
) -> str:
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if include_usage:
        chunk["usage"] = usage_
    return json.dumps(chunk, ensure_ascii=False)


def chunk_choice(text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
