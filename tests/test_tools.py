"""Tool calling's parts on their own: the reply parser (whole or in any split, as a stream delivers it), the
grammar each tool_choice compiles to (what it lets through and what it refuses, token by token through
llguidance), and how tools and tool traffic are written into a prompt for a template that has no tools section."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from app.pipeline.tools import ToolCalling
from app.pipeline.tools.grammar import tool_grammar
from app.pipeline.tools.parser import ToolCallParser
from app.pipeline.tools.prompt import TOOL_PROMPT, call_text, render
from app.pipeline.tools.syntax import CLOSE, DEFAULT, HERMES, OPEN, ToolSyntax
from app.wire.openai.messages import Message, Tool
from engine.core.grammar import Grammars
from engine.core.tokenizer import ByteTokenizer

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
)
NOW = Tool.model_validate({"type": "function", "function": {"name": "now"}})  # no parameters: an empty object
NESTED = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {  # as pydantic writes a model with a nested model: $defs and references to them
                "$defs": {"Guest": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}},
                "type": "object",
                "properties": {"guest": {"$ref": "#/$defs/Guest"}},
                "required": ["guest"],
            },
        },
    }
)


def parse(
    text: str, splits: list[int] = (), syntax: ToolSyntax = HERMES
) -> tuple[ToolCallParser, list[str], list[dict[str, Any]]]:
    """Feed ``text`` cut at ``splits``; returns the parser, the content pieces and the call deltas released."""
    parser, pieces, deltas, start = ToolCallParser(syntax), [], [], 0
    for end in [*sorted(splits), len(text)]:
        piece, calls = parser.feed(text[start:end])
        pieces.append(piece)
        deltas += calls
        start = max(start, end)
    rest, more = parser.finish()
    pieces.append(rest)
    deltas += more
    return parser, pieces, deltas


def assembled(deltas: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Stream deltas joined as a client joins them: by index, the first naming the call."""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["type"] == "function"
            calls.append({"name": delta["function"]["name"], "arguments": delta["function"]["arguments"]})
        else:
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab{}[]"\\/<>_ é\n'), max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(alphabet=st.sampled_from('xy}{"<'), max_size=4), json_values, max_size=3)
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(
    before=st.text(alphabet=st.sampled_from("ab <tool_call/>\n"), max_size=20),
    calls=st.lists(st.tuples(names, arguments), max_size=3),
    data=st.data(),
)
def test_any_split_of_a_reply_gives_the_same_content_and_calls(before: str, calls: list, data: st.DataObject) -> None:
    """Arguments may hold braces, quotes, escapes and even "</tool_call>" inside strings: the parser follows
    the JSON, so a call ends where its arguments close, wherever the stream's chunks happen to break."""
    before = before.replace(OPEN, "")  # text before the first call cannot hold the trigger itself
    text = before + "\n".join(call_text(name, json.dumps(args)) for name, args in calls)
    splits = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole, whole_pieces, whole_deltas = parse(text)
    split, split_pieces, split_deltas = parse(text, splits)
    expected = [{"name": n, "arguments": json.dumps(a, ensure_ascii=False)} for n, a in calls]
    assert assembled(split_deltas) == assembled(whole_deltas) == expected
    assert [c.arguments for c in split.calls] == [c["arguments"] for c in expected]
    assert "".join(split_pieces) == "".join(whole_pieces) == (before if calls == [] or before.strip() else "")
    assert split.text == whole.text == (None if calls and not before.strip() else before)


def test_a_reply_cut_short_keeps_what_it_has() -> None:
    """max_tokens may end a reply anywhere: inside the trigger (text after all), inside the head (a call with its
    name once the name is whole, none before: never one with an empty or cut name such as ``get_`` that no tool
    answers to, nor the call syntax as text), or inside the arguments (the call, with the arguments so far)."""
    text = 'Hi <tool_call>\n{"name": "now", "arguments": {"a": [1, 2'
    parser, pieces, deltas = parse(text[: len("Hi <tool_c")])
    assert "".join(pieces) == "Hi <tool_c" and not parser.calls
    cuts = (('{"na', ""), ('{"name": "no', ""), ('{"name": "no\\', ""), ('{"name": "now"', "now"),
            ('{"name": "now", "argu', "now"))  # fmt: skip
    for cut, name in cuts:
        parser, pieces, deltas = parse("Hi <tool_call>\n" + cut)
        assert "".join(pieces) == "Hi " and assembled(deltas) == ([{"name": name, "arguments": ""}] if name else [])
        assert parser.text == "Hi "
    parser, pieces, deltas = parse(text)
    assert "".join(pieces) == "Hi " and assembled(deltas) == [{"name": "now", "arguments": '{"a": [1, 2'}]


# -- the grammars --------------------------------------------------------------------------------------------

GRAMMARS = Grammars(ByteTokenizer())


def allows(calling: ToolCalling, text: str) -> bool:
    """Whether ``text``, then the end of the reply, is a whole reply the grammar allows (one byte per token)."""
    matcher = GRAMMARS.matcher(tool_grammar(calling))
    for token in [*text.encode(), ByteTokenizer.EOS]:
        mask = np.unpackbits(np.frombuffer(matcher.allowed_tokens(), dtype=np.uint8), bitorder="little")
        if not mask[token]:
            return False
        matcher.accept(token)
    return True


PARIS = call_text("get_weather", '{"city": "Paris", "unit": "C"}')


def test_required_is_one_or_more_conforming_calls() -> None:
    required = ToolCalling((WEATHER, NOW), "required")
    assert allows(required, PARIS)
    assert allows(required, PARIS + "\n" + call_text("now", "{}"))
    assert not allows(ToolCalling((WEATHER, NOW), "required", parallel=False), PARIS + "\n" + call_text("now", "{}"))
    assert not allows(required, "Sure. " + PARIS)  # no text: a call
    assert not allows(required, "")
    assert not allows(required, call_text("get_time", "{}"))  # not an offered tool
    assert not allows(required, call_text("get_weather", '{"city": "Paris"}'))  # unit is required
    assert not allows(required, call_text("get_weather", '{"city": "Paris", "unit": "K"}'))
    assert not allows(required, call_text("get_weather", '{"city": "Paris in the spring", "unit": "C"}'))
    assert not allows(required, call_text("now", '{"x": 1}'.replace("1", "1, ")))  # broken JSON


def test_a_named_choice_calls_that_tool_once() -> None:
    named = ToolCalling((WEATHER, NOW), "named", named="now")
    assert allows(named, call_text("now", "{}"))
    assert not allows(named, PARIS)
    assert not allows(named, call_text("now", "{}") + "\n" + call_text("now", "{}"))


def test_auto_is_text_or_text_then_conforming_calls() -> None:
    auto = ToolCalling((WEATHER, NOW), "auto")
    assert allows(auto, "It is sunny, I think. <tool and all that")
    assert allows(auto, "Let me look.\n" + PARIS)
    assert allows(auto, PARIS + "\n" + call_text("now", "{}"))
    assert not allows(auto, "Let me look.\n" + call_text("get_weather", '{"city": 3, "unit": "C"}'))
    assert not allows(auto, OPEN + "\nI changed my mind")  # once the trigger is written, a call follows
    assert not allows(ToolCalling((WEATHER, NOW), "auto", parallel=False), PARIS + "\n" + call_text("now", "{}"))


def test_parameters_with_defs_keep_their_references() -> None:
    required = ToolCalling((NESTED,), "required")
    assert allows(required, call_text("book", '{"guest": {"age": 30}}'))
    assert not allows(required, call_text("book", '{"guest": {"age": "thirty"}}'))


def test_none_lets_any_text_through_but_no_call() -> None:
    none = ToolCalling((WEATHER,), "none")
    assert allows(none, "It is sunny in Paris. <tool> and tool_call are words too.")
    assert not allows(none, 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


# -- into the prompt ------------------------------------------------------------------------------------------


def messages(*raw: dict[str, Any]) -> list[Message]:
    return [Message.model_validate(m) for m in raw]


def test_tools_and_tool_traffic_are_written_into_the_conversation() -> None:
    conversation = messages(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    )
    rendered = render(conversation, ToolCalling((WEATHER, NOW), "auto"), DEFAULT)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    tools = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in (WEATHER, NOW))
    assert rendered[0]["content"] == "Be brief.\n\n" + TOOL_PROMPT.format(tools=tools)
    assert rendered[2]["content"] == (
        f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n'
        f'{OPEN}\n{{"name": "now", "arguments": {{}}}}\n{CLOSE}'
    )
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"


def test_the_tool_prompt_comes_first_without_a_system_message_and_for_none_too() -> None:
    """``none`` keeps the tools visible, as OpenAI and vLLM do: only calls are refused (by the grammar)."""
    conversation = messages({"role": "user", "content": "hi"})
    for choice in ("required", "none"):
        rendered = render(conversation, ToolCalling((NOW,), choice), DEFAULT)
        assert rendered[0]["role"] == "system" and '"name": "now"' in rendered[0]["content"]


def test_a_native_template_gets_arguments_as_objects() -> None:
    conversation = messages(
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "now", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "noon"},
    )
    rendered = render(conversation, ToolCalling((NOW,), "auto"), HERMES)
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert rendered[2] == {"role": "tool", "content": "noon", "tool_call_id": "c"}


def _streamed_seconds(head: str, filler: str, count: int, syntax: ToolSyntax = HERMES) -> float:
    import time

    best = float("inf")
    for _ in range(3):
        parser, started = ToolCallParser(syntax), time.perf_counter()
        parser.feed(head)
        for _ in range(count):
            parser.feed(filler)
        parser.finish()
        best = min(best, time.perf_counter() - started)
    return best


def test_streamed_white_space_costs_the_same_per_token_however_much_came_before() -> None:
    """A reply of white space after a call's marker re-ran a backtracking regex over all of it at every token:
    8,000 spaces took 460 s, blocking the event loop. Four times the tokens now cost about four times the time."""
    for head in (OPEN, OPEN + '{"name"', ""):
        short, long = _streamed_seconds(head, " ", 1500), _streamed_seconds(head, " ", 6000)
        assert long < 8 * short + 0.05, (head, short, long)


def test_a_head_that_never_becomes_a_call_is_content() -> None:
    parser = ToolCallParser(HERMES)
    content, deltas = parser.feed(OPEN + '{"nome": ' + "x" * 1100)
    rest, more = parser.finish()
    assert content + rest == OPEN + '{"nome": ' + "x" * 1100 and not deltas and not more and not parser.calls
