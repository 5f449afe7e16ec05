"""Reasoning split out of replies (``app/pipeline/reasoning.py``): the parser in any split, which templates reason, and
over HTTP on a tiny model with Qwen3's and an R1 distill's templates and ``<think>`` tokens: ``reasoning_content``
in the message and in stream deltas, ``chat_template_kwargs`` reaching the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.pipeline.reasoning import CHANNEL, THINK, ReasoningParser, Tags, budget_grammar, reasons, starts_inside
from tests.app_helpers import LOCAL

TEMPLATES = Path(__file__).parent / "templates"


def split_feed(text: str, splits: list[int], inside: bool = False, tags: Tags = THINK) -> tuple[str, str]:
    parser, thought, said, start = ReasoningParser(inside, tags), "", "", 0
    for end in [*sorted(splits), len(text)]:
        more_thought, more_said = parser.feed(text[start:end])
        thought, said, start = thought + more_thought, said + more_said, max(start, end)
    rest_thought, rest_said = parser.finish()
    assert (parser.text or "") == thought + rest_thought
    return thought + rest_thought, said + rest_said


words = st.text(alphabet=st.sampled_from("ab <>/\nthink"), max_size=20)


@settings(max_examples=300, deadline=None)
@given(thought=words, answer=words, data=st.data())
def test_any_split_gives_the_same_reasoning_and_answer(thought: str, answer: str, data: st.DataObject) -> None:
    thought, answer = thought.replace("</think>", ""), answer
    text = f"<think>\n{thought}\n</think>\n\n{answer}"
    splits = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert split_feed(text, splits) == split_feed(text, []) == (thought.strip(), answer.lstrip())
    inside = text.removeprefix("<think>")  # the template opened it
    assert split_feed(inside, splits, inside=True) == (thought.strip(), answer.lstrip())


@settings(max_examples=200, deadline=None)
@given(thought=words, answer=words, data=st.data())
def test_gemma_4_s_thought_channel_in_any_split(thought: str, answer: str, data: st.DataObject) -> None:
    """Gemma 4 reasons in its thought channel: ``<|channel>thought``, a line, the reasoning, ``<channel|>``."""
    thought = thought.replace("<channel|>", "")
    text = f"<|channel>thought\n{thought}<channel|>{answer}"
    splits = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert split_feed(text, splits, tags=CHANNEL) == (thought.strip(), answer.lstrip())
    assert split_feed(answer + "x", splits, tags=CHANNEL)[0] == ""  # no channel: all answer


def test_a_reply_without_the_tag_is_all_answer_and_one_cut_short_all_reasoning() -> None:
    assert split_feed("Paris is sunny. <think>x</think>", [3]) == ("", "Paris is sunny. <think>x</think>")
    assert split_feed("  <thi", []) == ("", "  <thi")
    assert split_feed("<think>\nLet me see, the us", [9]) == ("Let me see, the us", "")
    assert split_feed("<think>\n</think>\n\nHi", [3]) == ("", "Hi")


def test_which_templates_reason_and_where_the_reply_starts() -> None:
    assert reasons((TEMPLATES / "qwen3.jinja").read_text())
    assert reasons((TEMPLATES / "r1-distill-qwen.jinja").read_text())
    assert not reasons((TEMPLATES / "qwen2.5.jinja").read_text()) and not reasons(None)
    assert starts_inside("<|im_start|>assistant\n<think>\n") and not starts_inside("<think>\n\n</think>\n\n")
    gemma = (TEMPLATES / "gemma-4.jinja").read_text()
    assert reasons(gemma) is CHANNEL and reasons((TEMPLATES / "qwen3.jinja").read_text()) is THINK
    # thinking off, Gemma 4's generation prompt closes an empty channel: the reply starts at the answer
    assert not starts_inside("<|turn>model\n<|channel>thought\n<channel|>", CHANNEL)


# -- over HTTP -------------------------------------------------------------------------------------------------

THINKERS = {  # SmolLM2's special tokens renamed as the family's (1: BOS, 2: EOS)
    "qwen3": {1: "<|im_start|>", 2: "<|im_end|>", 3: "<think>", 4: "</think>", 5: "<tool_call>", 6: "</tool_call>"},
    "r1-distill-qwen": {1: "<\uff5cbegin\u2581of\u2581sentence\uff5c>", 2: "<\uff5cend\u2581of\u2581sentence\uff5c>",
                        3: "<think>", 4: "</think>", 5: "<\uff5cUser\uff5c>", 6: "<\uff5cAssistant\uff5c>"},
}  # fmt: skip


@pytest.fixture(scope="module", params=list(THINKERS))
def thinker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from gguf import GGMLQuantizationType as T
    from gguf_files import tiny_model, write_gguf
    from starlette.testclient import TestClient

    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine.chooser import build
    from engine.core.config import EngineConfig
    from engine.runtime import loader

    name = request.param
    root = tmp_path_factory.mktemp(name)
    path = root / f"tiny-{name}.gguf"
    types = {kind: T.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    template = (TEMPLATES / f"{name}.jinja").read_text()
    write_gguf(tiny_model("llama", vocab=49152, seed=5, positions=2048), "llama", path, loader._default_gguf(), types,
               renamed=THINKERS[name], template=template)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
        served = build(EngineConfig(model=str(path), kv_cache_gib=0.25, max_model_len=2048, embedding_model="none"))
    with TestClient(create_app(served, ServerConfig()), base_url=LOCAL) as client:
        yield client, name


ASK = [{"role": "user", "content": "Is 17 prime?"}]


def chat(client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_reply_s_reasoning_is_reasoning_content_not_content(thinker) -> None:
    """Qwen3 opens ``<think>`` itself (here pushed up: a random model would not), the R1 distill's template opens
    it in the prompt: either way what follows is reasoning, and the message's content holds none of it."""
    client, name = thinker
    bias = {"3": 100} if name == "qwen3" else {"3": -100, "4": -100}
    got = chat(client, max_tokens=12, logit_bias=bias, logprobs=True)
    message = got["message"]
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert not message["content"] and "<think>" not in (message["content"] or "")
    if name == "qwen3":
        assert got["logprobs"]["content"][0]["token"] == "<think>"
    streamed = ""
    body = {"messages": ASK, "temperature": 0, "max_tokens": 12, "logit_bias": bias, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                assert not delta.get("content")
                streamed += delta.get("reasoning_content") or ""
    assert streamed == message["reasoning_content"]


def test_chat_template_kwargs_reach_the_template(thinker) -> None:
    """Qwen3's ``enable_thinking: false`` closes an empty reasoning in the prompt, and the reply has none; the
    variables the server sets are a 400 on either template."""
    client, name = thinker
    for bad in ({"tools": []}, {"add_generation_prompt": False}, "yes", {"conversation": 1}, {"return_tensors": "pt"}):
        response = client.post("/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": bad})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("chat_template_kwargs")
    off = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    tokens = client.post("/tokenize", json=off).json()["tokens"]
    plain = client.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    if name == "r1-distill-qwen":  # its template has no such variable: the prompt opens the reasoning either way
        assert tokens == plain and tokens[-2:] == [3, 198]
        return
    assert (tokens[-4], tokens[-2]) == (3, 4) and 4 not in plain  # "<think>\n\n</think>\n\n" ends the prompt
    got = chat(client, max_tokens=6, logit_bias={"3": -100}, chat_template_kwargs={"enable_thinking": False})
    assert got["message"]["reasoning_content"] is None and got["message"]["content"]


def test_the_responses_api_gives_reasoning_an_item_of_its_own(thinker) -> None:
    """A ``reasoning`` item before the message, its text streamed as ``response.reasoning_text.delta``; sent back
    with the next input (as the SDK passes ``output`` on) it is accepted and listed, and the turn goes on."""
    client, name = thinker
    bias = {"3": 100} if name == "qwen3" else {"3": -100, "4": -100}
    body = {"input": "Is 17 prime?", "max_output_tokens": 12, "temperature": 0, "logit_bias": bias}
    whole = client.post("/v1/responses", json=body)
    assert whole.status_code == 200, whole.text
    output = whole.json()["output"]
    assert output[0]["type"] == "reasoning" and output[0]["content"][0]["text"]
    assert "<think>" not in json.dumps([item for item in output if item["type"] == "message"])
    events = []
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == output[0]["content"][0]["text"]
    turn = [{"role": "user", "content": "Is 17 prime?"}, *output, {"role": "user", "content": "And 18?"}]
    again = client.post("/v1/responses", json={"input": turn, "max_output_tokens": 2})
    assert again.status_code == 200, again.text
    listed = client.get(f"/v1/responses/{again.json()['id']}/input_items").json()["data"]
    assert "reasoning" in [item["type"] for item in listed]


def test_thinking_budget_tokens_ends_the_reasoning_in_time(thinker) -> None:
    """The Messages API's ``thinking.budget_tokens``: the reasoning closes after at most that many tokens and the
    answer follows; without a budget the same reply reasons on to ``max_tokens``. Anthropic's rules: a budget of at
    least 1,024, below ``max_tokens``."""
    client, name = thinker
    if name != "r1-distill-qwen":
        pytest.skip("the R1 distill's prompt opens the reasoning: a random model stays inside it")
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 1100, "messages": ASK, "temperature": 0}
    budget = {"type": "enabled", "budget_tokens": 1024}
    free = client.post("/v1/messages", json={**body, "thinking": {"type": "adaptive"}}).json()
    assert [block["type"] for block in free["content"]] == ["thinking"] and free["stop_reason"] == "max_tokens"
    held = client.post("/v1/messages", json={**body, "thinking": budget})
    assert held.status_code == 200, held.text
    blocks = held.json()["content"]
    assert [block["type"] for block in blocks] == ["thinking", "text"] and held.json()["usage"]["output_tokens"] == 1100
    assert "</think>" not in blocks[0]["thinking"] and blocks[1]["text"]
    for bad, param in (({"type": "enabled", "budget_tokens": 512}, "budget_tokens"),
                       ({"type": "enabled", "budget_tokens": 2000}, "max_tokens"),
                       ({"type": "adaptive", "budget": 1}, "budget")):  # fmt: skip
        refused = client.post("/v1/messages", json={**body, "thinking": bad})
        assert refused.status_code == 400 and param in refused.json()["error"]["message"]


@pytest.mark.parametrize("budget", [1, 20])
def test_the_budget_s_grammar_closes_the_reasoning_at_its_token(thinker, budget: int) -> None:
    """The grammar behind ``budget_tokens`` (``budget_grammar``), token by token: the closing tag is the token
    right after the budget's last, then the answer; here through chat's ``structured_outputs``."""
    client, name = thinker
    if name != "r1-distill-qwen":
        pytest.skip("the R1 distill's prompt opens the reasoning: a random model stays inside it")
    grammar = budget_grammar(budget, True, (3, 4))
    got = chat(client, max_tokens=budget + 8, logprobs=True, structured_outputs={"grammar": grammar})
    tokens = [entry["token"] for entry in got["logprobs"]["content"]]
    assert tokens.index("</think>") == budget and got["message"]["content"]


def test_ollama_s_think_gives_the_reasoning_as_message_thinking(thinker) -> None:
    """``/api/chat`` with ``think``: the reasoning as ``message.thinking``, never in ``content`` (the R1 distill's
    prompt opens it; Qwen3's ``think: false`` reaches its template as ``enable_thinking`` and closes it empty)."""
    client, name = thinker
    body = {"model": f"tiny-{name}", "messages": ASK, "stream": False, "options": {"temperature": 0, "num_predict": 12}}
    if name == "qwen3":
        off = client.post("/api/chat", json={**body, "think": False}).json()
        prompt = client.post("/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
        assert off["prompt_eval_count"] == prompt.json()["count"] and "thinking" not in off["message"]
        return
    reply = client.post("/api/chat", json={**body, "think": True}).json()
    assert reply["message"]["thinking"] and not reply["message"]["content"]
    lines = [json.loads(line) for line in client.post("/api/chat", json={**body, "think": True, "stream": True}).text
             .splitlines()]  # fmt: skip
    assert "".join(line["message"].get("thinking", "") for line in lines) == reply["message"]["thinking"]
