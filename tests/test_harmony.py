"""gpt-oss's harmony format on the real engine path: a tiny gpt-oss GGUF with gpt-oss's own vocabulary (o200k_harmony,
201,088 tokens), its prompts rendered and its replies read by openai-harmony on chat completions, the Responses API
and the Messages API. The tiny model's weights are random: where a test needs a reply of harmony's shape, a grammar
holds it there (``tool_choice``, a structured output, a reasoning budget) and a logit bias on ``<|end|>`` keeps its
reasoning short."""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from app_helpers import LOCAL, named_events, sse_chunks
from hypothesis import given, settings
from hypothesis import strategies as st
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from app.pipeline.harmony import encoding as harmony_encoding
from app.pipeline.harmony.reader import HarmonyReader

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
#: ``<|end|>``: ends the reasoning at once where the grammar allows it.
END_NOW = {"200007": 100}
MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>")


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory: pytest.TempPathFactory):
    from gguf import GGMLQuantizationType as T
    from gguf_files import HARMONY_VOCAB, harmony_tokenizer, tiny_model, write_gguf
    from starlette.testclient import TestClient

    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine.chooser import build
    from engine.core.config import EngineConfig

    root = tmp_path_factory.mktemp("harmony")
    path = root / "tiny-gpt-oss.gguf"
    model = tiny_model("gpt-oss", vocab=HARMONY_VOCAB, positions=2048)
    write_gguf(model, "gpt-oss", path, harmony_tokenizer(), {"token_embd": T.Q8_0, "output": T.Q8_0})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
        served = build(EngineConfig(model=str(path), kv_cache_gib=0.25, max_model_len=2048, embedding_model="none"))
    with TestClient(create_app(served, ServerConfig()), base_url=LOCAL) as client:
        yield client, harmony_encoding.load(served.tokenizer), served.tokenizer


def chat(client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_prompt_is_harmony_s_own_rendering(harmony_server) -> None:
    """System (effort, date), developer (instructions, tools), the user, an earlier call and its result: the ids
    openai-harmony renders for the same conversation."""
    client, harmony, _ = harmony_server
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    messages = [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]  # fmt: skip
    body = {"messages": messages, "tools": [WEATHER], "chat_template_kwargs": {"reasoning_effort": "high"}}
    served = client.post("/tokenize", json=body).json()["tokens"]
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)
    system = system.with_conversation_start_date(datetime.date.today().isoformat())
    tool = ToolDescription.new("get_weather", "The weather", parameters=CITY)
    expected = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(
            Role.DEVELOPER, DeveloperContent.new().with_instructions("Be brief.").with_function_tools([tool])
        ),
        Message.from_role_and_content(Role.USER, ASK[0]["content"]),
        Message.from_role_and_content(Role.ASSISTANT, '{"city":"Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "18 C")
        .with_channel("commentary").with_recipient("assistant"),
    ])  # fmt: skip
    assert served == harmony.encoding.render_conversation_for_completion(expected, Role.ASSISTANT)
    text = client.post("/detokenize", json={"tokens": served}).json()["prompt"]
    assert "Reasoning: high" in text and "type get_weather" in text and text.endswith("18 Cassistant")


def test_a_required_call_comes_back_as_a_call_whole_and_streamed(harmony_server) -> None:
    client, *_ = harmony_server
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 80, "logit_bias": END_NOW}
    choice = chat(client, **body)
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Lyon")
    chunks = sse_chunks(client, {"messages": ASK, "temperature": 0, "stream": True, **body}, "/v1/chat/completions")
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [d for delta in deltas for d in delta.get("tool_calls") or []]
    assert streamed[0]["function"]["name"] == "get_weather" and streamed[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in streamed) == call["function"]["arguments"]
    assert not any(delta.get("content") for delta in deltas)


def test_reasoning_is_reasoning_content_and_the_final_channel_content(harmony_server) -> None:
    """Unconstrained, the random model reasons on (the analysis channel) until its budget; held to an answer without
    calls (``tool_choice: none``, a JSON schema) and its reasoning ended, the final channel is the content."""
    client, *_ = harmony_server
    thinking = chat(client, max_tokens=24, tools=[WEATHER], tool_choice="none")
    assert thinking["message"]["reasoning_content"] and not thinking["message"]["content"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = chat(client, max_tokens=40, response_format=fmt, logit_bias=END_NOW)
    assert json.loads(answer["message"]["content"])["ok"] in (True, False)
    assert answer["finish_reason"] == "stop" and answer["message"]["reasoning_content"] is None
    assert not any(marker in json.dumps(answer) for marker in MARKERS)


def test_the_responses_api_gives_reasoning_and_function_call_items(harmony_server) -> None:
    client, *_ = harmony_server
    body = {
        "input": ASK[0]["content"],
        "tools": [{"type": "function", "name": "get_weather", "parameters": CITY}],
        "tool_choice": "required",
        "max_output_tokens": 80,
        "temperature": 0,
        "reasoning": {"effort": "low"},
    }
    output = client.post("/v1/responses", json={**body, "logit_bias": END_NOW}).json()["output"]
    assert [item["type"] for item in output] == ["function_call"]
    assert json.loads(output[0]["arguments"])["city"] in ("Paris", "Lyon")
    reasoning = client.post("/v1/responses", json={**body, "tool_choice": "auto", "max_output_tokens": 16}).json()
    assert reasoning["output"][0]["type"] == "reasoning" and reasoning["output"][0]["content"][0]["text"]


def test_anthropic_thinking_blocks_and_a_prefill_continued_in_the_final_channel(harmony_server) -> None:
    """The analysis channel is a thinking block (the tools' grammar holds the random model to harmony's shape);
    an assistant prefill is continued inside the final message (the reader primed with it), a text block."""
    client, *_ = harmony_server
    tool = {"name": "get_weather", "description": "The weather", "input_schema": CITY}
    body = {"model": "tiny-gpt-oss", "max_tokens": 16, "messages": ASK, "temperature": 0, "tools": [tool],
            "tool_choice": {"type": "none"}}  # fmt: skip
    reply = client.post("/v1/messages", json=body).json()
    assert [block["type"] for block in reply["content"]] == ["thinking"] and reply["content"][0]["thinking"]
    events = named_events(client, {**body, "stream": True}, "/v1/messages")
    streamed = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    assert streamed == reply["content"][0]["thinking"]
    prefilled = {**body, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}
    reply = client.post("/v1/messages", json=prefilled).json()
    assert [block["type"] for block in reply["content"]] == ["text"] and reply["content"][0]["text"]
    assert not any(marker in reply["content"][0]["text"] for marker in MARKERS)


def allowed(matcher, token: int) -> bool:
    mask = np.frombuffer(matcher.allowed_tokens(), dtype=np.uint32)
    return bool(mask[token // 32] >> (token % 32) & 1)


def test_a_reasoning_budget_ends_the_analysis_channel_at_its_token(harmony_server) -> None:
    """``thinking.budget_tokens``'s grammar: after the budget's tokens of reasoning only ``<|end|>`` may come."""
    from app.pipeline.harmony.grammar import reply_grammar
    from engine.core.grammar import Grammars

    _, harmony, tokenizer = harmony_server
    matcher = Grammars(tokenizer).matcher(Grammars.lark(reply_grammar(harmony, None, None, 3)))
    ids = harmony.ids
    word = harmony.encoding.encode(" word")[0]
    for token in (ids["<|channel|>"], *harmony.encoding.encode("analysis"), ids["<|message|>"], word, word, word):
        assert allowed(matcher, token), token
        matcher.accept(token)
    assert not allowed(matcher, word) and allowed(matcher, ids["<|end|>"])


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"builtin_tools": ["browser"]}},
         "chat_template_kwargs.builtin_tools"),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ("/v1/chat/completions", {"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}]},
         "messages[1].tool_call_id"),
    ],
)  # fmt: skip
def test_what_harmony_cannot_honour_is_a_400_naming_the_field(harmony_server, path: str, body: dict,
                                                              param: str) -> None:  # fmt: skip
    client, *_ = harmony_server
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@settings(max_examples=40, deadline=None)
@given(
    thought=st.text(max_size=40),
    ending=st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(['{"city":"Paris"}', "{}", '{"a": [1, 2]}'])),
    calls=st.booleans(),
    cuts=st.lists(st.integers(min_value=1, max_value=6), max_size=30),
)
def test_any_split_of_a_reply_s_tokens_reads_the_same(harmony_server, thought: str, ending: str, calls: bool,
                                                      cuts: list[int]) -> None:  # fmt: skip
    """A reply as harmony writes it (reasoning, then the answer or a call), its tokens' text fed in any grouping,
    as the detokenizer releases it: the same reasoning, content and call."""
    _, harmony, _ = harmony_server
    encoding = harmony.encoding
    messages = [Message.from_role_and_content(Role.ASSISTANT, thought).with_channel("analysis")]
    last = Message.from_role_and_content(Role.ASSISTANT, ending)
    if calls:
        last = last.with_channel("commentary").with_recipient("functions.get_weather").with_content_type("json")
    else:
        last = last.with_channel("final")
    tokens = [t for m in [*messages, last] for t in encoding.render(m)][2:-1]  # after <|start|>assistant; no stop
    reader, pieces, at, held = HarmonyReader(harmony), [], 0, []
    for cut in [*cuts, len(tokens)]:
        held += tokens[at : at + cut]
        at += cut
        text = encoding.decode(held)
        if not text.endswith("\ufffd"):  # as the detokenizer releases text: whole characters
            pieces.append(reader.feed(text))
            held = []
    pieces.append(reader.finish())
    assert reader.reasoning == (thought or None) and "".join(p.reasoning for p in pieces) == thought
    if calls:
        assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", ending)] and reader.content is None
    else:
        assert reader.content == ending and not reader.calls


def test_text_outside_harmony_s_shape_is_content(harmony_server) -> None:
    _, harmony, _ = harmony_server
    plain = HarmonyReader(harmony)
    said = plain.feed("Just text, no channel.").content + plain.finish().content
    assert said == plain.content == "Just text, no channel."
    broken = HarmonyReader(harmony)
    broken.feed("<|channel|>final<|message|>Hi<|end|>then text")
    assert broken.content == "Hithen text"


class _Vocabulary:
    """A tokenizer whose template writes harmony but whose vocabulary is not o200k's."""

    vocab_size = 1000
    added = dict.fromkeys(harmony_encoding.MARKERS, 1)

    def info(self) -> dict[str, Any]:
        return {"chat_template": "<|start|>{{ m }}<|channel|>final<|message|>"}


def test_a_vocabulary_that_is_not_o200k_is_not_read_as_harmony(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert harmony_encoding.load(_Vocabulary()) is None  # type: ignore[arg-type]
    assert "fewer than o200k's" in caplog.text


def test_the_ranks_file_is_o200k_base_s(tmp_path: Path) -> None:
    """The vocabulary the tests build is OpenAI's (the hash openai-harmony checks)."""
    import base64
    import hashlib

    from gguf_files import o200k_ranks

    ranks = b"".join(b"%s %d\n" % (base64.b64encode(token), i) for i, token in enumerate(o200k_ranks()))
    assert hashlib.sha256(ranks).hexdigest() == harmony_encoding.O200K_SHA256
