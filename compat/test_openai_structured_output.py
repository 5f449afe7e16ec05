"""Structured output on the real model, through the official client: `client.chat.completions.parse` with a
pydantic model (what instructor and LangChain's `with_structured_output` do), JSON mode, and vLLM's choice. A
135M model passes these only because decoding cannot produce anything else."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
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


def test_json_mode_replies_are_objects(client: OpenAI) -> None:
    """JSON mode (any object) has no bound: a 135M model closes the object for most prompts (all four here in
    float32), and may run on to max_tokens for others, which then leaves a valid prefix ("length")."""
    prompts = (
        "Return JSON with your name.",
        "What is 2+2? Answer in JSON.",
        "Output a JSON object with a title and year for a movie.",
        "List three colors in JSON.",
    )
    finished = 0
    for prompt in prompts:
        result = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=200,
        )
        choice = result.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert finished >= len(prompts) // 2


PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 15},
        "species": {"enum": ["cat", "dog", "bird"]},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["name", "species", "vaccinated"],
    "additionalProperties": False,
}


def test_json_schema_replies_validate_greedy_sampled_and_streamed(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a pet as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    texts = {}
    for fields in ({"temperature": 0}, {"temperature": 1, "seed": 7}, {"temperature": 1, "seed": 8}):
        for stream in (False, True):
            request = dict(model=MODEL, messages=messages, response_format=response_format, max_tokens=80, **fields)
            if stream:
                chunks = client.chat.completions.create(**request, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                choice = client.chat.completions.create(**request).choices[0]
                assert choice.finish_reason == "stop"
                text = choice.message.content
            jsonschema.validate(json.loads(text), PET)
            texts.setdefault(json.dumps(fields), []).append(text)
    assert all(whole == streamed for whole, streamed in texts.values())  # seeded sampling streams alike


def test_constrained_and_free_requests_share_a_batch(invariant_client: OpenAI) -> None:
    """Eight at once, half constrained: the constrained conform, the free greedy ones are bitwise what they are
    alone (a mask applied to the wrong row would change them), on a batch-invariant server."""
    client = invariant_client
    free_prompts = [f"Tell me about the number {i}." for i in range(4)]

    def free(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
        return result.choices[0].message.content

    def constrained(i: int) -> str:
        messages = [{"role": "user", "content": f"Describe pet number {i} as JSON."}]
        response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}}
        result = client.chat.completions.create(
            model=MODEL, messages=messages, response_format=response_format, temperature=1, seed=i, max_tokens=80
        )
        return result.choices[0].message.content

    alone = [free(prompt) for prompt in free_prompts]
    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, prompt) for prompt in free_prompts]
        jsons = [pool.submit(constrained, i) for i in range(4)]
        together = [f.result() for f in frees]
        for j in jsons:
            jsonschema.validate(json.loads(j.result()), PET)
    assert together == alone
