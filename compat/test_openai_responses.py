"""The Responses API on the real model through the official client, as the SDK's users and the Agents SDK drive it:
create, stream (events in order, numbered from 0, deltas joining to the final text, the SDK's stream helper), parse
into a pydantic model, retrieve, delete, input items; greedy parity with chat completions; function calls that
conform to their schemas and the round trip with their outputs; ``previous_response_id`` over several turns, with
the earlier turns from the prefix cache; the token limit; errors."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather like in Paris today?"


def test_create_retrieve_input_items_delete(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Name three colours.", instructions="Answer in one line.", max_output_tokens=24,
        temperature=0, metadata={"team": "blue"},
    )  # fmt: skip
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.instructions == "Answer in one line." and response.metadata == {"team": "blue"}
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 24
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert client.responses.retrieve(response.id).output_text == response.output_text
    items = client.responses.input_items.list(response.id)
    assert [(item.type, item.role, item.content[0].text) for item in items.data] == [
        ("message", "user", "Name three colours.")
    ]
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert response.id in str(missing.value)


def test_greedy_output_equals_chat_completions(invariant_client: OpenAI) -> None:
    """On a batch-invariant server: the second request finds the first's prompt in the prefix cache, so its
    prompt rows are computed in other steps (on AMX machines ``auto`` computes many-row steps on dense weights)."""
    client = invariant_client
    response = client.responses.create(
        model=MODEL, instructions="You are terse.", input=[{"role": "user", "content": "Why is the sky blue?"}],
        temperature=0, max_output_tokens=40, store=False,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=40,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)  # store: false keeps nothing


def test_a_stream_s_events_come_in_order_and_join_to_the_response(client: OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="Tell me a short story.", max_output_tokens=30, stream=True)
    events = list(stream)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"
    ]  # fmt: skip
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    joined = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert joined == final.output_text == events[-4].text
    assert final.usage.output_tokens == 30


def test_the_sdk_stream_helper_and_parse(client: OpenAI) -> None:
    # The helper's final response is a completed one (an incomplete one raises there, as against OpenAI).
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(texts) == final.output_text

    class City(BaseModel):
        name: str
        country: str

    parsed = client.responses.parse(
        model=MODEL, input="Give me a city in France as JSON.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)


def test_function_calls_conform_and_round_trip(client: OpenAI) -> None:
    for seed in (None, 1, 2):
        sampled = {"temperature": 0} if seed is None else {"temperature": 1, "extra_body": {"seed": seed}}
        response = client.responses.create(
            model=MODEL,
            input=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=120,
            parallel_tool_calls=False,
            **sampled,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and response.status == "completed"
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    call = calls[0]
    answer = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=30, temperature=0,
        input=[
            {"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "sky": "clear"}'},
        ],
    )  # fmt: skip
    assert answer.output_text


def test_a_custom_tool_s_call_follows_its_grammar_through_the_sdk(client: OpenAI) -> None:
    """A custom tool (a regex grammar), forced, on the real model: the SDK reads a ``custom_tool_call`` whose input
    matches the grammar, and takes the call and its output back into the conversation."""
    pattern = r"(add|sub) [0-9]{1,3} [0-9]{1,3}"
    tool = {"type": "custom", "name": "calc", "description": "Integer arithmetic.",
            "format": {"type": "grammar", "syntax": "regex", "definition": pattern}}  # fmt: skip
    response = client.responses.create(model=MODEL, input="What is 12 plus 30?", tools=[tool],  # type: ignore[list-item]
                                       tool_choice={"type": "custom", "name": "calc"}, max_output_tokens=60,
                                       temperature=0)  # fmt: skip
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "calc" and re.fullmatch(pattern, call.input), call.input
    answer = client.responses.create(
        model=MODEL, tools=[tool], max_output_tokens=20, temperature=0,  # type: ignore[list-item]
        input=[{"role": "user", "content": "What is 12 plus 30?"},
               {"type": "custom_tool_call", "call_id": call.call_id, "name": "calc", "input": call.input},
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "42"}],
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete")


def test_a_call_cut_by_the_token_limit_is_an_incomplete_call_not_text(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=14, temperature=0
    )
    assert response.status == "incomplete"
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output[0].status == "incomplete" and "<tool_call>" not in response.output[0].arguments
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=14, temperature=0, tool_choice="required",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
    )  # fmt: skip
    choice = chat.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and choice.message.tool_calls


def test_previous_response_id_continues_the_conversation_from_the_cache(client: OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada. Remember it.", instructions="Be brief.", max_output_tokens=20, temperature=0
    )
    second = client.responses.create(
        model=MODEL, input="What did I just tell you?", previous_response_id=first.id, max_output_tokens=20,
        instructions="Be brief.", temperature=0,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= 16
    third = client.responses.create(
        model=MODEL, input="And once more?", previous_response_id=second.id, max_output_tokens=10,
        instructions="Be brief.", temperature=0,
    )  # fmt: skip
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens_details.cached_tokens
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing")
    assert "resp_missing" in str(missing.value)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
         "text.format"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(client: OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, **fields)
    assert bad.value.body["param"] == param


def test_an_unknown_model_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o", input="hi")


def test_include_logprobs_gives_each_output_token_its_logprob_and_alternatives(client: OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, input="Say something.", max_output_tokens=6, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens == 6
    assert "".join(entry.token for entry in part.logprobs) == part.text
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the likeliest token is the one taken
