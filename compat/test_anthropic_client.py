"""The Messages API through Anthropic's own SDK on the real model (``ANTHROPIC_BASE_URL`` pointed at the server, as
Claude Code and the SDK's users point it): messages, the stream helper's text and final message, stop sequences,
a prefill continued, forced tool use that conforms to the schema and a tool result round trip, token counting, and
the SDK's typed errors."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
#: The SDK 2.x has no sampling arguments (newer Claude models take none); the API's fields still pick greedy here.
GREEDY = {"temperature": 0}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture
def claude(server_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0) as client:
        yield client


def test_a_message_and_its_stream_agree(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    assert final.stop_reason == message.stop_reason


def test_stop_sequences_and_a_prefill(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY).content[0].text
    stop = whole.split()[2]  # the third word: the reply stops before it
    cut = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert whole.startswith(cut.content[0].text) and stop not in cut.content[0].text
    prefill = [*ASK, {"role": "assistant", "content": "The weather in Paris is"}]
    continued = claude.messages.create(model=MODEL, max_tokens=12, messages=prefill, extra_body=GREEDY)
    assert continued.content and not continued.content[0].text.startswith("The weather in Paris is")
    count = claude.messages.count_tokens(model=MODEL, messages=prefill).input_tokens
    assert count == continued.usage.input_tokens + (continued.usage.cache_read_input_tokens or 0)


def test_forced_tool_use_and_a_tool_result(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=ONE_CALL, extra_body=GREEDY
    )
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and message.stop_reason == "tool_use"
    turn = [
        *ASK,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]},
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=20, messages=turn, tools=[WEATHER], extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with claude.messages.stream(
        model=MODEL, max_tokens=100, messages=ASK, tools=[WEATHER], tool_choice=ONE_CALL, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]


def test_errors_are_the_sdk_s_typed_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=[{"type": "web_search_20250305",
                                                                                "name": "web_search"}])  # fmt: skip
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_the_sdk_lists_and_retrieves_the_served_models(claude: anthropic.Anthropic) -> None:
    """``client.models.list()`` pages through the served models (Anthropic's page shape, not OpenAI's list);
    ``retrieve`` of a model not served is the SDK's NotFoundError."""
    listed = [model.id for model in claude.models.list(limit=1)]  # one a page: the SDK follows after_id
    assert MODEL in listed and len(listed) == len(set(listed)) >= 2  # the chat model and the embedding model
    info = claude.models.retrieve(MODEL)
    assert (info.id, info.type) == (MODEL, "model") and info.created_at.year >= 2026
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("claude-opus-4-1")
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
