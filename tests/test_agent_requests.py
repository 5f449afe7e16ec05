"""Coding agents' first requests, recorded from the agents themselves (``tests/fixtures/agents/``: Codex CLI 0.171's
``codex exec`` over the Responses API, Qwen Code 0.24's ``qwen -p`` and OpenCode 1.18's ``opencode run`` over chat
completions, Claude Code 2.1's ``claude -p`` over the Messages API; `make test-agents` with ``AGENT_FIXTURES`` writes
them), sent as they came: each is answered, not refused. Codex's ``namespace`` tool offers its functions to the
model and a call comes back naming its namespace; its hosted ``web_search`` is left out and named in a header;
reasoning items carry ``encrypted_content`` when ``include`` asks and are taken back; Qwen Code's ``max_tokens`` of
the whole context is clamped to what the prompt leaves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.pipeline.reply import Reading
from app.pipeline.tools.syntax import HERMES
from app.wire.openai.response_events import ResponseEvents
from app.wire.openai.responses import SKIPPED_HEADER, conversation, parse_responses_request
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import ByteTokenizer
from tests.app_helpers import fake_client

FIXTURES = Path(__file__).parent / "fixtures" / "agents"


def recorded(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_codex_s_first_request_is_answered_as_a_stream() -> None:
    fixture = recorded("codex")
    body = {**fixture["body"], "model": "fake"}
    with fake_client(FakeEngine(max_model_len=40_000)) as client, \
            client.stream("POST", fixture["path"], json=body) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        assert response.headers[SKIPPED_HEADER] == "web_search"
        kinds = [json.loads(line[6:])["type"] for line in response.iter_lines() if line.startswith("data: ")]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_a_namespace_s_functions_are_offered_and_a_call_names_its_namespace() -> None:
    req = parse_responses_request(recorded("codex")["body"])
    assert req.tools is not None
    offered = [tool.function.name for tool in req.tools.tools]
    assert "exec_command" in offered and "multi_agent_v1__spawn_agent" in offered
    assert "web_search" not in offered and req.skipped == ("web_search",)
    assert req.namespaced["multi_agent_v1__spawn_agent"] == ("multi_agent_v1", "spawn_agent")
    events = ResponseEvents(ByteTokenizer(), Reading(HERMES), False, namespaced=req.namespaced)
    events.feed('<tool_call>{"name": "multi_agent_v1__spawn_agent", "arguments": {"task": "x"}}</tool_call>', None)
    events.finish("stop")
    [call] = [item for item in events.output if item["type"] == "function_call"]
    assert (call["namespace"], call["name"], json.loads(call["arguments"])) == ("multi_agent_v1", "spawn_agent",
                                                                               {"task": "x"})  # fmt: skip


def test_a_namespaced_call_sent_back_is_the_call_the_model_made() -> None:
    body = {"input": [{"type": "function_call", "call_id": "c1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "done"}]}  # fmt: skip
    messages = conversation(parse_responses_request(body).items)
    assert messages[0].tool_calls is not None
    assert messages[0].tool_calls[0].function.name == "multi_agent_v1__spawn_agent"


def test_reasoning_comes_with_encrypted_content_and_is_taken_back() -> None:
    req = parse_responses_request({"input": "hi", "include": ["reasoning.encrypted_content"], "store": False})
    events = ResponseEvents(ByteTokenizer(), Reading(reasons=True), False, encrypted_reasoning=req.encrypted_reasoning)
    events.feed("<think>plan it</think>answer", None)
    events.finish("stop")
    reasoning = events.output[0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    again = {"input": [reasoning, {"role": "user", "content": "next"}], "store": False}
    assert len(parse_responses_request(again).items) == 2  # another server's blob is taken back too


@pytest.mark.parametrize("room", [40, 2000])
def test_qwen_code_s_whole_context_max_tokens_is_clamped(room: int) -> None:
    """Qwen Code asks for 32,768 tokens on a 32,768-token model every turn: a 400 before."""
    fixture = recorded("qwen-code")
    body = {**fixture["body"], "model": "fake"}
    assert body["max_tokens"] == 32_768
    with fake_client(FakeEngine(max_model_len=1 << 17)) as probe:
        tokens = probe.post("/tokenize", json={"model": "fake", "messages": body["messages"],
                                               "tools": body["tools"]}).json()["count"]  # fmt: skip
    with fake_client(FakeEngine(max_model_len=tokens + room)) as client, \
            client.stream("POST", fixture["path"], json=body) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    finish = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"] if choice["finish_reason"]]
    usage = chunks[-1]["usage"]
    assert finish == ["length"] and usage["prompt_tokens"] == tokens and usage["completion_tokens"] <= room


#: Each API's field for the reply's budget, and how its stream ends.
_BUDGET = {"/v1/chat/completions": "max_tokens", "/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}
_LAST = {"/v1/chat/completions": "[DONE]", "/v1/messages": "message_stop", "/v1/responses": "response.completed"}


@pytest.mark.parametrize("agent", sorted(path.stem for path in FIXTURES.glob("*.json")))
def test_each_agent_s_first_turn_is_answered_as_it_came(agent: str) -> None:
    """Every recorded agent's turn (its system prompt, tools, and every field it sends), sent as it came over the
    model's whole context but 64 tokens: a whole stream, its budget clamped to what the prompt leaves."""
    fixture = recorded(agent)
    path, body = fixture["path"], {**fixture["body"], "model": "fake"}
    with fake_client(FakeEngine(max_model_len=1 << 17)) as probe:
        whole = {key: value for key, value in body.items() if key != "stream_options"}
        answer = probe.post(path, json={**whole, "stream": False, _BUDGET[path]: 1})
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
    prompt = usage.get("prompt_tokens") or usage["input_tokens"]
    assert prompt > 1000  # its system prompt and tools
    with fake_client(FakeEngine(max_model_len=prompt + 64)) as client, \
            client.stream("POST", path, json={**body, "stream": True}) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    last = lines[-1].removeprefix("data: ")
    assert last == _LAST[path] or json.loads(last)["type"] in (_LAST[path], "response.incomplete")
