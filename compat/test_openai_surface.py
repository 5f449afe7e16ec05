"""The official openai client against the real model: every parameter of the wider API surface."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model
PROMPT = "The capital of France is"


def greedy(client: OpenAI, **kw: object) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kw)  # type: ignore[arg-type]


def test_n_and_prompt_lists_order_choices_and_usage(client: OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=["Hello", "Once upon a time"], n=2, max_tokens=5, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.prompt_tokens == 1 + 4
    assert result.usage.completion_tokens == 4 * 5
    token_prompts = client.completions.create(model=MODEL, prompt=[[504, 3575], [504]], max_tokens=2, temperature=0)
    assert token_prompts.usage.prompt_tokens == 3


def test_stop_string_spanning_tokens_streamed_and_not(client: OpenAI) -> None:
    full = greedy(client, max_tokens=12).choices[0].text  # " Paris.\n\nThe answer is: ..."
    stop = full[3:9]  # spans several tokens
    cut = greedy(client, max_tokens=12, stop=[stop]).choices[0]
    assert cut.text == full[:3] and cut.finish_reason == "stop"
    pieces = [c.choices[0].text for c in greedy(client, max_tokens=12, stop=stop, stream=True)]
    assert "".join(pieces) == full[:3]
    kept = greedy(client, max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == full[:9]


def test_stop_token_ids_and_min_tokens(client: OpenAI, server_url: str) -> None:
    tokens = httpx.post(f"{server_url}/tokenize", json={"model": MODEL, "prompt": " Paris"}).json()["tokens"]
    stopped = greedy(client, max_tokens=12, extra_body={"stop_token_ids": tokens[-1:]}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text.strip() == "Paris"
    chat = [{"role": "user", "content": "Say hi."}]
    short = client.chat.completions.create(model=MODEL, messages=chat, temperature=0, max_tokens=60)
    assert short.choices[0].finish_reason == "stop"
    forced = client.chat.completions.create(
        model=MODEL, messages=chat, temperature=0, max_tokens=60, extra_body={"min_tokens": 40}
    )
    assert forced.usage.completion_tokens >= 40 > short.usage.completion_tokens


def test_logprobs_plain_and_streamed(client: OpenAI) -> None:
    choice = greedy(client, max_tokens=6, logprobs=3).choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(len(top) <= 4 and max(top.values()) >= value - 1e-6 for top, value in pairs)
    assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs)
    streamed = [c.choices[0].logprobs for c in greedy(client, max_tokens=6, logprobs=3, stream=True)]
    streamed_values = [v for entry in streamed if entry for v in entry.token_logprobs]
    assert [round(v, 3) for v in streamed_values] == [round(v, 3) for v in lp.token_logprobs]


def test_logprobs_over_20_is_a_plain_400_also_when_streaming(client: OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            greedy(client, max_tokens=2, logprobs=21, stream=stream)


def test_echo(client: OpenAI) -> None:
    assert greedy(client, max_tokens=3, echo=True).choices[0].text.startswith(PROMPT)
    alone = greedy(client, max_tokens=0, echo=True)
    assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0


def test_echo_with_logprobs_scores_the_prompt(client: OpenAI) -> None:
    """What lm-eval does: echo + logprobs, with and without generated tokens."""
    scored = greedy(client, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == scored.usage.prompt_tokens == 5
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v < 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    both = greedy(client, max_tokens=3, echo=True, logprobs=1).choices[0]
    assert both.logprobs.token_logprobs[:5] == pytest.approx(lp.token_logprobs[:1] + lp.token_logprobs[1:5], abs=0.05)
    assert len(both.logprobs.tokens) == 8 and "".join(both.logprobs.tokens) == both.text
    streamed = list(greedy(client, max_tokens=3, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == both.text
    assert streamed[0].choices[0].logprobs.token_logprobs[0] is None


def test_best_of_returns_the_most_likely_samples(client: OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, best_of=4, n=2, seed=3)
    assert len(result.choices) == 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, best_of=2, stream=True)


def test_sampling_parameters_are_honoured(client: OpenAI, server_url: str) -> None:
    token = httpx.post(f"{server_url}/tokenize", json={"prompt": " banana"}).json()["tokens"][0]
    forced = greedy(client, max_tokens=3, logit_bias={str(token): 100})
    assert forced.choices[0].text == " banana" * 3
    plain = greedy(client, max_tokens=24).choices[0].text
    penalized = greedy(client, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert penalized != plain
    hot = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.5,
        top_p=0.9,
        seed=11,
        extra_body={"top_k": 20, "min_p": 0.05},
    )
    assert hot.choices[0].text


def test_seed_reproduces_in_a_busy_batch(client: OpenAI) -> None:
    """The same seed gives the same samples for the same request, n=4 sharing one batch."""
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, seed=99, n=4)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, seed=99, n=4)
    assert [c.text for c in alone.choices] == [c.text for c in again.choices]


def test_chat_completion_surface(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_completion_tokens=12)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    with_lp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = with_lp.choices[0].logprobs.content
    assert len(content) == with_lp.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and not math.isnan(entry.logprob) for entry in content)
    many = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=4, seed=1)
    assert [c.index for c in many.choices] == [0, 1]
    for bad in ([], [{"role": "nobody", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=bad)  # type: ignore[arg-type]


def test_tokenize_counts_match_usage(client: OpenAI, server_url: str) -> None:
    tokens = httpx.post(f"{server_url}/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert tokens["count"] == greedy(client, max_tokens=1).usage.prompt_tokens
    assert tokens["max_model_len"] == 8192
    text = httpx.post(f"{server_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}
