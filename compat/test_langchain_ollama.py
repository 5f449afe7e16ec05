"""langchain-ollama's ``ChatOllama`` and ``OllamaEmbeddings`` against the session's server (the bundled models):
invoke and stream alike, tools bound, structured output through ``format``, embeddings."""

from __future__ import annotations

import pytest
from langchain_ollama import ChatOllama, OllamaEmbeddings
from pydantic import BaseModel

MODEL = "SmolLM2-135M-Instruct"


class Color(BaseModel):
    color: str


def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture
def llm(server_url: str) -> ChatOllama:
    return ChatOllama(model=MODEL, base_url=server_url, temperature=0, num_predict=16)


def test_invoke_and_stream_give_the_same_text_and_usage(llm: ChatOllama) -> None:
    reply = llm.invoke("Name a color.")
    assert reply.content and reply.response_metadata["done_reason"] == "length"
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] == 16
    assert "".join(str(chunk.content) for chunk in llm.stream("Name a color.")) == reply.content


def test_bound_tools_reach_the_model_and_any_call_parses(llm: ChatOllama) -> None:
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert all(call["name"] == "get_weather" and isinstance(call["args"], dict) for call in reply.tool_calls)
    assert reply.tool_calls or reply.content


def test_structured_output_is_the_schema_s(server_url: str) -> None:
    structured = ChatOllama(model=MODEL, base_url=server_url, temperature=0, num_predict=40)
    assert isinstance(structured.with_structured_output(Color).invoke("Name a color."), Color)


def test_embeddings(server_url: str) -> None:
    embeddings = OllamaEmbeddings(model="all-MiniLM-L6-v2", base_url=server_url)
    documents = embeddings.embed_documents(["a cat", "a dog"])
    assert len(documents) == 2 and len(documents[0]) == 384
    assert embeddings.embed_query("a cat") == pytest.approx(documents[0], abs=1e-5)
