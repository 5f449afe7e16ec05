"""Custom (freeform) tools: a grammar's texts held inside a call's JSON string (``app/pipeline/tools/freeform.py``), the
Responses API's ``custom`` tools and ``custom_tool_call`` items around them, and chat completions' ``custom`` tools."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from app_helpers import fake_client, named_events, sse_chunks
from hypothesis import given, settings
from hypothesis import strategies as st

from app.pipeline.tools.freeform import escaped_lark, escaped_regex
from app.wire.openai.errors import APIError
from engine.core.fake_engine import FakeEngine
from engine.core.grammar import Grammars
from engine.core.tokenizer import ByteTokenizer

#: Codex's ``apply_patch`` tool's grammar, as Codex sends it (codex-rs/core/src/tool_apply_patch.lark).
APPLY_PATCH = (Path(__file__).parent / "fixtures" / "grammars" / "apply_patch.lark").read_text()
REGEXES = [r'[a-z"\\]{2,5}\n(?:ok|no)\t.', r".*", r"(?s).+", r"\d+|[^\d\s]{1,3}", r"a[^b]c\W?", r"[\x00-\x1f]*"]
#: Text with what JSON escapes (quotes, backslashes, control characters), tabs, newlines and wide characters.
TEXT = st.text(st.sampled_from(['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "😀", "a", "b", "c", "1", " ",
                                "*", "+", "-", "@", ":"]), max_size=12)  # fmt: skip
_TOKENIZER = ByteTokenizer()
_GRAMMARS = Grammars(_TOKENIZER)


def accepts(lark: str, text: str) -> bool:
    """Whether llguidance takes ``text`` whole under ``lark``, byte by byte."""
    matcher = _GRAMMARS.matcher(Grammars.lark(lark))._matcher
    return all(matcher.consume_token(t) for t in _TOKENIZER.encode(text, add_special_tokens=False)) and bool(
        matcher.is_accepting()
    )


def escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


@cache
def regex_grammar(pattern: str) -> str:
    return f"start: {escaped_regex(pattern, 'p')}"


@settings(max_examples=150, deadline=None)
@given(pattern=st.sampled_from(REGEXES), text=TEXT)
def test_an_escaped_regex_takes_exactly_the_escaped_texts_the_regex_matches(pattern: str, text: str) -> None:
    assert accepts(regex_grammar(pattern), escaped(text)) == bool(re.fullmatch(pattern, text))


def patches() -> st.SearchStrategy[str]:
    line = st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=8)
    add = st.builds(lambda name, lines: f"*** Add File: {name}\n" + "".join(f"+{x}\n" for x in lines),
                    line.filter(bool), st.lists(line, min_size=1, max_size=3))  # fmt: skip
    change = st.builds(lambda sign, text: f"{sign}{text}\n", st.sampled_from("+- "), line)
    update = st.builds(lambda name, lines: f"*** Update File: {name}\n@@\n" + "".join(lines),
                       line.filter(bool), st.lists(change, min_size=1, max_size=3))  # fmt: skip
    hunks = st.lists(add | update, min_size=1, max_size=2)
    return st.builds(lambda parts: "*** Begin Patch\n" + "".join(parts) + "*** End Patch\n", hunks)


@settings(max_examples=40, deadline=None)
@given(patch=patches(), cut=st.integers(2, 30))  # 1 would cut the optional last newline
def test_codex_apply_patch_grammar_holds_the_escaped_patch(patch: str, cut: int) -> None:
    """Any patch, whatever its lines hold (quotes, backslashes, controls, any script), escaped, is taken; the raw
    patch is not (its newline is no escape), nor is a patch cut short."""
    grammar = escaped_lark(APPLY_PATCH, "p")
    assert accepts(grammar, escaped(patch))
    assert not accepts(grammar, patch)
    assert not accepts(grammar, escaped(patch[:-cut]))


@pytest.mark.parametrize(
    "grammar",
    ['start: %json {"type": "string"}', "start: <[1]>", 'start: "a"i', "start: /a/i", "%import common.FOO\nstart: FOO",
     "start: /(a)\\1/"],
)  # fmt: skip
def test_what_cannot_be_escaped_is_a_400(grammar: str) -> None:
    with pytest.raises(APIError) as raised:
        escaped_lark(grammar, "tools[0].format.definition")
    assert raised.value.status == 400 and raised.value.param == "tools[0].format.definition"


def test_imports_and_terminals_are_escaped_too() -> None:
    grammar = escaped_lark('start: WORD ":" WS_ONE NAME\nNAME.2: /[a-z]+/ // a comment\n'
                           "%import common.WORD\n%import common.WS -> WS_ONE\n", "p")  # fmt: skip
    assert accepts(grammar, escaped("ab:\n\t cd")) and not accepts(grammar, "ab:\n cd")


# -- the Responses API ----------------------------------------------------------------------------------------

TOOLS = [
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH}},
    {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex",
                                                  "definition": r'[a-z"\\]{2,5}\n(?:ok|no)\t.'}},
    {"type": "custom", "name": "note", "description": "Free text."},
]  # fmt: skip


def respond(client: Any, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/responses", json={"input": "go", "tools": TOOLS, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("seed", range(6))
def test_a_custom_call_is_an_item_whose_input_follows_the_grammar(seed: int) -> None:
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        body = respond(client, tool_choice={"type": "custom", "name": "code"}, temperature=1, seed=seed,
                       max_output_tokens=300)  # fmt: skip
    [call] = body["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "code" and call["id"].startswith("ctc_")
    assert re.fullmatch(TOOLS[1]["format"]["definition"], call["input"]) and call["status"] == "completed"


def test_a_custom_call_streams_its_input_and_goes_back_into_the_conversation() -> None:
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        stream = named_events(client, {"input": "go", "tools": TOOLS, "tool_choice": {"type": "custom", "name": "code"},
                                       "max_output_tokens": 300, "stream": True}, "/v1/responses")  # fmt: skip
        kinds = [event["type"] for event in stream]
        assert kinds[-4:] == ["response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                              "response.output_item.done", "response.completed"]  # fmt: skip
        call = stream[-1]["response"]["output"][0]
        assert stream[-4]["delta"] == stream[-3]["input"] == call["input"]
        assert "response.function_call_arguments.delta" not in kinds
        # The call and its output sent back (store: false, as Codex sends them), and the stored chain: both run.
        items = [{"role": "user", "content": "go"}, call,
                 {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "done"}]  # fmt: skip
        follow = respond(client, input=items, store=False, max_output_tokens=5)
        assert follow["status"] in ("completed", "incomplete")
        chained = respond(
            client,
            previous_response_id=stream[-1]["response"]["id"],
            max_output_tokens=5,
            input=[{"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "ok"}],
        )
        assert chained["status"] in ("completed", "incomplete")


def test_a_custom_call_cut_short_is_incomplete_with_the_input_written() -> None:
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        body = respond(client, tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=90)
    [call] = body["output"]
    assert call["type"] == "custom_tool_call" and call["status"] == "incomplete"
    assert call["input"].startswith("*** Begin Patch\n*** ")


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark"}}], None, "tools[0].format"),
        ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark",
                                                     "definition": "start: %json {}"}}], None,
         "tools[0].format.definition"),
        ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "regex", "definition": "(a"}}], None,
         "tools[0].format.definition"),
        ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "ebnf", "definition": "a"}}], None,
         "tools[0].format.syntax"),
        ([{"type": "custom", "name": "bad name"}], None, "tools[0].name"),
        ([{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "regex", "definition": "a" * 65537}}],
         None, "tools[0].format.definition"),
        (TOOLS, {"type": "function", "name": "code"}, "tool_choice"),
        ([{"type": "function", "name": "f"}], {"type": "custom", "name": "f"}, "tool_choice"),
    ],
)  # fmt: skip
def test_a_custom_tool_the_server_cannot_hold_is_a_400(tools: list[Any], choice: Any, param: str) -> None:
    with fake_client() as client:
        body: dict[str, Any] = {"input": "go", "tools": tools} | ({"tool_choice": choice} if choice else {})
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# -- chat completions ---------------------------------------------------------------------------------------------

CHAT_TOOLS = [
    {"type": "custom", "custom": {"name": "apply_patch", "description": "Edit files.", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": APPLY_PATCH}}}},
    {"type": "custom", "custom": {"name": "code", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": TOOLS[1]["format"]["definition"]}}}},
    {"type": "custom", "custom": {"name": "note", "description": "Free text.", "format": {"type": "text"}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]  # fmt: skip
ASK_CHAT = [{"role": "user", "content": "go"}]


def chat(client: Any, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": ASK_CHAT, "tools": CHAT_TOOLS, **fields})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("seed", range(4))
def test_a_chat_custom_call_is_a_custom_tool_call_whose_input_follows_the_grammar(seed: int) -> None:
    """OpenAI's chat spelling: ``{"type": "custom", "custom": {"name", "input"}}``, the input decoded."""
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        body = chat(client, tool_choice={"type": "custom", "custom": {"name": "code"}}, temperature=1, seed=seed,
                    max_tokens=300)  # fmt: skip
    choice = body["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "custom" and call["custom"]["name"] == "code" and "function" not in call
    assert re.fullmatch(TOOLS[1]["format"]["definition"], call["custom"]["input"])
    assert choice["finish_reason"] == "tool_calls"


def test_a_streamed_chat_custom_call_comes_whole_and_goes_back_into_the_conversation() -> None:
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        forced = {"tool_choice": {"type": "custom", "custom": {"name": "code"}}, "max_tokens": 300, "seed": 3}
        whole = chat(client, **forced)["choices"][0]["message"]["tool_calls"][0]
        chunks = sse_chunks(client, {"messages": ASK_CHAT, "tools": CHAT_TOOLS, "stream": True, **forced},
                            "/v1/chat/completions")  # fmt: skip
        deltas = [call for chunk in chunks for call in chunk["choices"][0]["delta"].get("tool_calls", [])]
        assert len(deltas) == 1 and deltas[0]["index"] == 0 and deltas[0]["type"] == "custom"
        assert deltas[0]["custom"] == whole["custom"] and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # The call and its result sent back, as the SDK returned them: the conversation goes on.
        messages = [*ASK_CHAT, {"role": "assistant", "content": None, "tool_calls": [whole]},
                    {"role": "tool", "tool_call_id": whole["id"], "content": "ok"}]  # fmt: skip
        assert chat(client, messages=messages, max_tokens=5)["choices"][0]["finish_reason"] in ("stop", "length")
        # A function tool beside the custom ones still streams its arguments as ever.
        chunks = sse_chunks(client, {"messages": ASK_CHAT, "tools": CHAT_TOOLS, "stream": True, "max_tokens": 60,
                                     "tool_choice": {"type": "function", "function": {"name": "now"}}},
                            "/v1/chat/completions")  # fmt: skip
        calls = [call for chunk in chunks for call in chunk["choices"][0]["delta"].get("tool_calls", [])]
        assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "now"


def test_a_chat_custom_call_cut_short_keeps_the_input_written() -> None:
    with fake_client(FakeEngine(max_model_len=4096)) as client:
        body = chat(client, tool_choice={"type": "custom", "custom": {"name": "apply_patch"}}, max_tokens=90)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["custom"]["input"].startswith("*** Begin Patch\n*** ")


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar"}}}], None, "tools[0].custom.format"),
        ([{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
            "syntax": "regex", "definition": "(a"}}}}], None, "tools[0].custom.format.grammar.definition"),
        ([{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
            "syntax": "ebnf", "definition": "a"}}}}], None, "tools[0].custom.format.grammar.syntax"),
        ([{"type": "custom", "custom": {"name": "bad name"}}], None, "tools[0].custom.name"),
        ([{"type": "custom", "custom": {"name": "now"}}, CHAT_TOOLS[3]], None, "tools[1].function.name"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        (CHAT_TOOLS, {"type": "custom", "custom": {"name": "now"}}, "tool_choice"),
        (CHAT_TOOLS, {"type": "function", "function": {"name": "code"}}, "tool_choice"),
        (CHAT_TOOLS, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.type"),
    ],
)  # fmt: skip
def test_a_chat_custom_tool_the_server_cannot_hold_is_a_400(tools: list[Any], choice: Any, param: str) -> None:
    with fake_client() as client:
        body: dict[str, Any] = {"messages": ASK_CHAT, "tools": tools} | ({"tool_choice": choice} if choice else {})
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
