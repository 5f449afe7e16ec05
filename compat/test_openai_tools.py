"""Tool calling on the real model through the official client, as an agent framework drives it: forced and
named calls conform to the tools' schemas, `none` answers in text, `parallel_tool_calls=False` gives one call,
streamed calls assemble (by hand and through the SDK's stream helper) into the non-streamed ones, and a
round trip (call, tool result, answer) works."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def conforming(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and arguments, checked: an offered tool, arguments valid for its parameters."""
    result = []
    for call in calls:
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, tool["function"]["parameters"])
        assert call.type == "function" and call.id.startswith("call_")
        result.append((call.function.name, arguments))
    return result


def create(client: OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        **{"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120, **fields}
    )


def test_required_calls_conform_greedy_and_sampled(client: OpenAI) -> None:
    """Sampled, one call each: with parallel calls allowed, a sampled 135M model may call on and on until
    max_tokens cuts the last call short."""
    sampled = [{"temperature": 1, "seed": seed, "parallel_tool_calls": False} for seed in (1, 2)]
    for fields in ({"temperature": 0}, *sampled):
        choice = create(client, tool_choice="required", **fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert conforming(choice.message.tool_calls)


def test_a_named_choice_and_no_parallel_calls_give_exactly_that_one_call(client: OpenAI) -> None:
    named = create(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0)
    [(name, _)] = conforming(named.choices[0].message.tool_calls)
    assert name == "get_time"
    single = create(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert len(conforming(single.choices[0].message.tool_calls)) == 1


def test_none_answers_in_text(client: OpenAI) -> None:
    choice = create(client, tool_choice="none", temperature=0, max_tokens=30).choices[0]
    assert choice.message.tool_calls is None and choice.message.content


def test_auto_answers_in_text_or_with_a_conforming_call(client: OpenAI) -> None:
    for seed in range(3):
        choice = create(client, temperature=1, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert conforming(choice.message.tool_calls) and choice.finish_reason == "tool_calls"
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_streamed_calls_assemble_into_the_non_streamed_ones(client: OpenAI) -> None:
    whole = conforming(create(client, tool_choice="required", temperature=0).choices[0].message.tool_calls)
    by_hand: list[dict[str, str]] = []
    for chunk in create(client, tool_choice="required", temperature=0, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                by_hand.append({"name": delta.function.name, "arguments": ""})
            by_hand[delta.index]["arguments"] += delta.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in by_hand] == whole
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120
    ) as stream:
        final = stream.get_final_completion()
    assert conforming(final.choices[0].message.tool_calls) == whole


def test_a_round_trip_from_call_to_answer(client: OpenAI) -> None:
    first = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),  # the assistant's turn, as the SDK hands it back
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_custom_tool_s_call_follows_its_grammar_through_chat(client: OpenAI) -> None:
    """A custom tool (a regex grammar) on chat completions, forced, on the real model: the SDK reads a ``custom``
    tool call whose input matches the grammar, the stream carries the same, and the call and its result go back."""
    pattern = r"(add|sub) [0-9]{1,3} [0-9]{1,3}"
    grammar = {"type": "grammar", "grammar": {"syntax": "regex", "definition": pattern}}
    tool = {"type": "custom", "custom": {"name": "calc", "description": "Integer arithmetic.", "format": grammar}}
    ask = [{"role": "user", "content": "What is 12 plus 30?"}]
    forced = {"tools": [tool], "tool_choice": {"type": "custom", "custom": {"name": "calc"}}, "temperature": 0}
    completion = create(client, messages=ask, max_tokens=60, **forced)
    [call] = completion.choices[0].message.tool_calls
    assert call.type == "custom" and call.custom.name == "calc" and re.fullmatch(pattern, call.custom.input)
    # The SDK's stream types know function deltas only (its stream helper fails on any custom call, OpenAI's own
    # included): the delta's ``custom`` is an untyped extra, OpenAI's shape, the input whole in one delta here.
    chunks = list(create(client, messages=ask, max_tokens=60, stream=True, **forced))
    streamed = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or []]
    assert [(c.type, c.index, c.id, c.model_extra["custom"]) for c in streamed] == [
        ("custom", 0, streamed[0].id, {"name": "calc", "input": call.custom.input})]  # fmt: skip
    answer = create(client, tools=[tool], max_tokens=20, temperature=0, messages=[
        *ask, completion.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"}])  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")
