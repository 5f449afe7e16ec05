"""The OpenAI surface beyond the basics, over the fake engine: choices, stop strings, echo, chat, tokenize."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from app_helpers import fake_client, sse_chunks
from starlette.testclient import TestClient

from app.wire.openai.chat import ChatBody
from app.wire.openai.completions import CompletionBody
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import ByteTokenizer


@pytest.fixture
def client() -> Iterator[TestClient]:
    with fake_client(FakeEngine(capacity=16, max_model_len=128)) as c:
        yield c


def post(client: TestClient, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def events(client: TestClient, body: dict[str, Any], path: str = "/v1/completions") -> list[dict[str, Any]]:
    return sse_chunks(client, body, path)


def test_prompt_lists_and_n_order_choices_and_count_usage(client: TestClient) -> None:
    body = post(client, {"prompt": ["ab", "cde"], "n": 2, "max_tokens": 3, "temperature": 0})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "abc" for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 0}
    }  # fmt: skip
    ids = post(client, {"prompt": [[104, 105], [106]], "max_tokens": 2})
    assert ids["usage"]["prompt_tokens"] == 3 and len(ids["choices"]) == 2


def test_stream_with_n_gives_every_index_its_own_finish(client: TestClient) -> None:
    chunks = events(client, {"prompt": "x", "n": 3, "max_tokens": 4, "stream": True})
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(m["text"] for m in mine) == "abcd"
        assert [m["finish_reason"] for m in mine][-1] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])


def test_stop_strings_cut_the_text_streamed_and_not(client: TestClient) -> None:
    body = {"prompt": "x", "max_tokens": 20, "stop": ["ef", "zz"]}
    plain = post(client, body)["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == ("abcd", "stop")
    streamed = events(client, {**body, "stream": True})
    texts = [c["choices"][0]["text"] for c in streamed]
    assert "".join(texts) == "abcd"
    assert not any("e" in t for t in texts)  # no part of the stop string reaches the client
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
    kept = post(client, {**body, "stop": "ef", "include_stop_str_in_output": True})["choices"][0]
    assert kept["text"] == "abcdef"


def test_min_tokens_holds_stop_strings_back_until_reached(client: TestClient) -> None:
    body = {"prompt": "x", "max_tokens": 30, "stop": "b", "temperature": 0}
    assert post(client, body)["choices"][0]["text"] == "a"
    late = post(client, {**body, "min_tokens": 3})["choices"][0]  # the next "b" is the 28th letter
    assert (late["text"], late["finish_reason"]) == ("abcdefghijklmnopqrstuvwxyza", "stop")


def test_echo_prepends_the_prompt_and_max_tokens_zero_returns_it_alone(client: TestClient) -> None:
    assert post(client, {"prompt": "hey ", "max_tokens": 2, "echo": True})["choices"][0]["text"] == "hey ab"
    alone = post(client, {"prompt": "hey", "max_tokens": 0, "echo": True})
    assert alone["choices"][0]["text"] == "hey"
    assert alone["usage"]["completion_tokens"] == 0
    chunks = events(client, {"prompt": "hey ", "max_tokens": 2, "echo": True, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hey ab"


def test_continuous_usage_stats(client: TestClient) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(client, {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": options})
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_chat_completion_and_its_stream(client: TestClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = post(client, {"messages": messages, "max_tokens": 3}, "/v1/chat/completions")
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len(b"system: be brief\nuser: hi\nassistant: ")
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    chunks = events(client, {"messages": messages, "max_tokens": 3, "stream": True}, "/v1/chat/completions")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "abc"
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert (
        post(client, {"messages": parts, "max_completion_tokens": 2}, "/v1/chat/completions")["usage"][
            "completion_tokens"
        ]
        == 2
    )


def test_chat_without_max_tokens_may_fill_the_context(client: TestClient) -> None:
    body = post(client, {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions")
    usage = body["usage"]
    assert usage["total_tokens"] == 128  # the fake engine's max_model_len
    assert body["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_detokenize(client: TestClient) -> None:
    tokens = post(client, {"prompt": "héllo"}, "/tokenize")
    assert tokens["tokens"] == list("héllo".encode())
    assert tokens["count"] == 6 and tokens["max_model_len"] == 128
    assert post(client, {"tokens": tokens["tokens"]}, "/detokenize") == {"prompt": "héllo"}
    usage = post(client, {"prompt": "héllo", "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == tokens["count"]
    chat = post(client, {"messages": [{"role": "user", "content": "hi"}]}, "/tokenize")
    assert chat["count"] == len(b"user: hi\nassistant: ")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], []]}, "prompt"),
        ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21, "stream": True}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [999]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [300]}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {"prompt": "x", "model": 5}, "model"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": "7"}, "stop_token_ids"),
        ("/tokenize", {}, "prompt"),
    ],
)
def test_every_rejected_parameter_is_a_400_naming_it(client: TestClient, path: str, body: dict, param: str) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_user_and_unknown_fields_are_accepted(client: TestClient) -> None:
    assert post(client, {"prompt": "x", "max_tokens": 1, "user": "u-1", "whatever": {"a": 1}})["choices"]


SURROGATE = "\\udbff"  # as the JSON body spells it: valid JSON, no character


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", f'{{"prompt": "a{SURROGATE}b"}}', "prompt"),
        ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"]}}', "prompt[1]"),
        ("/v1/completions", f'{{"prompt": "x", "stop": ["{SURROGATE}"]}}', "stop[0]"),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "hi {SURROGATE}"}}]}}]}}',
            "messages[0].content[0].text",
        ),
        ("/tokenize", f'{{"prompt": "{SURROGATE}"}}', "prompt"),
        ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}]}}', "messages[0].content"),
        ("/v1/completions", f'{{"prompt": "x", "logit_bias": {{"{SURROGATE}": 1}}}}', "logit_bias"),
        ("/v1/completions", f'{{"prompt": "x", "user": "{SURROGATE}"}}', "user"),
    ],
)
def test_text_that_is_not_unicode_is_a_400_naming_its_field(client: TestClient, path: str, body: str, param: str):
    """An unpaired surrogate reached the tokenizer (500) or passed silently (stop); now every field is checked
    where the body enters."""
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"]


def test_a_surrogate_pair_is_a_character_like_any_other(client: TestClient) -> None:
    body = '{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # U+1F600, escaped as JSON must for UTF-16
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == len("😀".encode())


def test_a_deeply_nested_body_is_a_400(client: TestClient) -> None:
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nested" in response.json()["error"]["message"]


def test_tokenize_honours_add_special_tokens_and_tokenizer_info_describes_the_tokenizer(client: TestClient) -> None:
    """What lm-eval's remote tokenizer needs: /tokenizer_info's eos_token, and /tokenize without added tokens."""
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == ByteTokenizer.EOS_TEXT and info["model_max_length"] == 128
    assert post(client, {"prompt": "hi", "add_special_tokens": False}, "/tokenize")["tokens"] == [104, 105]
    assert client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": "no"}).status_code == 400


CHAT = {"messages": [{"role": "user", "content": "Reply in JSON."}]}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_fields_not_implemented_yet_are_a_400_not_ignored(client: TestClient, path: str, fields: dict, param: str):
    """A client asking for JSON, or for a tool call on the completions endpoint, got prose and a 200 and
    believed it."""
    body = {**(CHAT if "chat" in path else {"prompt": "x"}), **fields}
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_what_clients_send_by_default_is_accepted(client: TestClient) -> None:
    """Empty tools, tool_choice none/auto without tools, a text response_format, the text modality."""
    defaults = {"tools": [], "tool_choice": "auto", "response_format": {"type": "text"}, "modalities": ["text"]}
    assert post(client, {**CHAT, **defaults, "max_tokens": 2}, "/v1/chat/completions")["choices"]
    assert post(client, {**CHAT, "tool_choice": "none", "parallel_tool_calls": False, "max_tokens": 1},
                "/v1/chat/completions")["choices"]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "model"),
    [("/v1/completions", {"prompt": "x"}, CompletionBody), ("/v1/chat/completions", CHAT, ChatBody)],
)
def test_null_means_absent_for_every_field(client: TestClient, path: str, body: dict, model: type) -> None:
    """Clients (LangChain, litellm) send every field they know, unset ones as null: each is its default."""
    fields = {field.alias or name: None for name, field in model.model_fields.items() if name not in body}
    reply = post(client, {**body, **fields, "max_tokens": 2}, path)
    assert reply["usage"]["completion_tokens"] == 2


def test_a_model_without_a_chat_template_answers_chat_requests_with_a_400_in_each_api_s_shape() -> None:
    """A GGUF whose files carry no chat template (a base model's, a shaped benchmark file): a chat request is a 400
    that says so and where to send the text instead, in each API's own error shape, never a 500; text completions
    still answer."""
    from app_helpers import LOCAL
    from starlette.testclient import TestClient
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine.chooser import ServedModel
    from engine.core.tokenizer import HFTokenizer

    raw = RawTokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "there": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]"), frozenset({0}))
    served = ServedModel("base", FakeEngine(max_model_len=64), tokenizer)
    asked = [{"role": "user", "content": "hello there"}]
    with TestClient(create_app(served, ServerConfig()), base_url=LOCAL) as client:
        openai = client.post("/v1/chat/completions", json={"model": "base", "messages": asked})
        assert openai.status_code == 400 and "no chat template" in openai.json()["error"]["message"]
        anthropic = client.post("/v1/messages", json={"model": "base", "max_tokens": 4, "messages": asked})
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
        assert "/v1/completions" in anthropic.json()["error"]["message"]
        ollama = client.post("/api/chat", json={"model": "base", "messages": asked, "stream": False})
        assert ollama.status_code == 400 and "no chat template" in ollama.json()["error"]
        text = client.post("/v1/completions", json={"model": "base", "prompt": "hello", "max_tokens": 2})
        assert text.status_code == 200
