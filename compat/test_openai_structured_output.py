"""Structured output on the real model, through the official client: `client.chat.completions.parse` with a
pydantic model (what instructor and LangChain's `with_structured_output` do), JSON mode, and vLLM's choice. A
135M model passes these only because decoding cannot produce anything else."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)  # a bounded number: a free float can run on digit by digit
    kind: Literal["capital", "other"]


def test_parse_into_a_pydantic_model(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    result = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, temperature=0, max_tokens=120
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)  # the SDK validated it against the schema


FRUITS = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["fruits"],
    "additionalProperties": False,
}


def test_sampled_n_and_streamed_json(client: OpenAI) -> None:
    """Sampled choices each conform, and so does a stream (a bounded schema ends within the budget; an unbounded
    one, like plain JSON mode, may run a small model on to its max_tokens)."""
    messages = [{"role": "user", "content": "List two fruits as a JSON object."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": FRUITS}}
    result = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=response_format, n=2, seed=3, max_tokens=100
    )
    for choice in result.choices:
        value = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and len(value["fruits"]) <= 2
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=response_format, stream=True, temperature=0, max_tokens=100
    )
    assert len(json.loads("".join(c.choices[0].delta.content or "" for c in chunks))["fruits"]) <= 2


def test_a_budget_cut_leaves_a_valid_prefix(client: OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": FRUITS}}
    messages = [{"role": "user", "content": "List two fruits as a JSON object."}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=response_format, temperature=0, max_tokens=3
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length" and '{"fruits": ['.startswith(choice.message.content)


def test_choice_on_completions(client: OpenAI) -> None:
    result = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=5,
        logprobs=2,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
    )
    choice = result.choices[0]
    assert choice.text in (" yes", " no") and choice.finish_reason == "stop"
    assert "".join(choice.logprobs.tokens) == choice.text
