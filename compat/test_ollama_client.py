"""Ollama's official Python client (``ollama``) against the session's server on the bundled model: chat and its
stream, generate with the context sent back, structured output, tools, the listings, embeddings, errors; and the
same conversation's greedy text and token count through ``/api/chat`` and ``/v1/chat/completions``."""

from __future__ import annotations

import contextlib
import json

import httpx
import ollama
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name a color."}]


@pytest.fixture
def client(server_url: str) -> ollama.Client:
    return ollama.Client(host=server_url, timeout=300)


def test_chat_whole_and_streamed_give_the_same_text(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=f"{MODEL}:latest", messages=ASK, options=options)
    parts = list(client.chat(model=MODEL, messages=ASK, options=options, stream=True))
    assert whole.message.content and "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == whole.done_reason == "length"
    assert whole.eval_count == 12 and whole.prompt_eval_count > 0 and whole.total_duration > whole.eval_duration > 0


def test_generate_continues_from_the_context_it_returned(client: ollama.Client) -> None:
    first = client.generate(model=MODEL, prompt="Count: one, two,", raw=True, options={"temperature": 0,
                                                                                       "num_predict": 4})  # fmt: skip
    assert first.response and first.context
    again = client.generate(model=MODEL, prompt=" and", raw=True, context=first.context,
                            options={"temperature": 0, "num_predict": 4})  # fmt: skip
    assert again.prompt_eval_count == len(first.context) + len(client.generate(
        model=MODEL, prompt=" and", raw=True, options={"num_predict": 1}).context) - 1  # fmt: skip


def test_format_holds_the_reply_to_a_schema(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"],
              "additionalProperties": False}  # fmt: skip
    reply = client.chat(model=MODEL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40})
    assert set(json.loads(reply.message.content)) == {"color"}


def test_a_tool_call_comes_back_with_object_arguments_and_its_result_goes_back(client: ollama.Client) -> None:
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": city}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # tool_choice is not Ollama's: the model chooses; the server's parser and grammar hold any call it makes.
    reply = client.chat(model=MODEL, messages=messages, tools=[tool], options={"temperature": 0, "num_predict": 60})
    for call in reply.message.tool_calls or []:
        assert call.function.name == "get_weather" and call.function.arguments["city"] in ("Paris", "Lyon")
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_name": "get_weather", "content": "18 C, sunny"}]  # fmt: skip
    answer = client.chat(model=MODEL, messages=turn, tools=[tool], options={"temperature": 0, "num_predict": 8})
    assert answer.done


def test_the_listings_name_the_served_model(client: ollama.Client) -> None:
    assert f"{MODEL}:latest" in [m.model for m in client.list().models]
    assert f"{MODEL}:latest" in [m.model for m in client.ps().models]
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and shown.modelinfo["llama.context_length"] > 0
    # SmolLM2-135M: a llama of 134.5M weights, its file's blocks Q4_1 (with the types llama.cpp keeps some in)
    assert shown.details.family == "llama" and shown.details.parameter_size.endswith("M")
    assert "Q4_1" in shown.details.quantization_level.split("/")
    # the file's own keys, as Ollama lists them: SmolLM2-135M's 30 layers of width 576, 9 heads
    info = shown.modelinfo
    assert (info["llama.block_count"], info["llama.embedding_length"], info["llama.attention.head_count"]) == (
        30,
        576,
        9,
    )
    assert info["general.architecture"] == "llama" and "tokenizer.ggml.tokens" not in info
    (listed,) = [m for m in client.list().models if m.model == f"{MODEL}:latest"]
    assert listed.details.family == "llama"


def test_a_model_made_by_create_answers_with_its_parameters_until_deleted(client: ollama.Client) -> None:
    """``create`` from the served model with a system prompt and options, ``copy``, ``delete``, as the client sends
    them; the made model answers under its own name and is listed with the served one as its parent."""
    assert client.create(model="terse", from_=MODEL, system="Answer in one word.",
                         parameters={"num_predict": 3, "temperature": 0}).status == "success"  # fmt: skip
    try:
        answer = client.chat(model="terse", messages=ASK)
        assert answer.model == "terse" and answer.eval_count == 3
        (made,) = [m for m in client.list().models if m.model == "terse:latest"]
        assert made.details.parent_model == f"{MODEL}:latest"
        shown = client.show("terse")
        assert 'SYSTEM "Answer in one word."' in shown.modelfile and "num_predict 3" in shown.parameters
        assert client.copy("terse", "terse-copy").status == "success"
        assert client.chat(model="terse-copy", messages=ASK).eval_count == 3
    finally:
        for name in ("terse", "terse-copy"):
            with contextlib.suppress(ollama.ResponseError):  # (not made: the failure above is the one to see)
                client.delete(name)
    with pytest.raises(ollama.ResponseError) as gone:
        client.chat(model="terse", messages=ASK)
    assert gone.value.status_code == 404


def test_embeddings_are_unit_vectors(client: ollama.Client) -> None:
    vectors = client.embed(model="all-MiniLM-L6-v2", input=["a cat", "a dog"]).embeddings
    assert len(vectors) == 2 and all(abs(sum(x * x for x in v) - 1) < 1e-3 for v in vectors)
    assert client.embeddings(model="all-MiniLM-L6-v2", prompt="a cat").embedding == pytest.approx(vectors[0], abs=1e-5)


def test_errors_are_ollama_s(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="no-such-model", messages=ASK)
    assert missing.value.status_code == 404 and "not found" in missing.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=MODEL, messages=ASK, options={"mirostat": 2})
    assert refused.value.status_code == 400 and "mirostat" in refused.value.error


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=60))
def test_api_chat_and_chat_completions_give_the_same_greedy_text(server_url: str, text: str) -> None:
    messages = [{"role": "user", "content": text}]
    native = httpx.post(f"{server_url}/api/chat", json={"model": MODEL, "messages": messages, "stream": False,
                        "options": {"temperature": 0, "num_predict": 10}}, timeout=300).json()  # fmt: skip
    openai = httpx.post(f"{server_url}/v1/chat/completions", json={"model": MODEL, "messages": messages,
                        "temperature": 0, "max_tokens": 10}, timeout=300).json()  # fmt: skip
    assert native["message"]["content"] == openai["choices"][0]["message"]["content"]
    assert native["eval_count"] == openai["usage"]["completion_tokens"]
    assert native["prompt_eval_count"] == openai["usage"]["prompt_tokens"]
