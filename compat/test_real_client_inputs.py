"""What real clients send, through the official openai client against the real model: long prompts on an idle
server and under load, special tokens in echoed logprobs, OpenAI's logprobs counts, model retrieval, lm-eval's
remote tokenizer, and greedy answers that do not change with the load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from compat.conftest import MODEL

pytestmark = pytest.mark.real_model
# ~12 tokens a sentence: prompts of several hundred tokens, as RAG, chat history and few-shot prompts are.
SENTENCE = "The harbour was quiet that morning, and the boats rocked gently in the grey water. "


@pytest.mark.parametrize("sentences", [25, 90])  # ~300 and ~1100 tokens: over one and several step budgets
def test_a_long_prompt_on_an_idle_server_completes_plain_streamed_and_as_chat(
    invariant_client: OpenAI, sentences: int
) -> None:
    """Plain and streamed must agree: on a batch-invariant server, since the second finds the first's prompt in the
    prefix cache and computes its last rows in a step of another size (on AMX machines ``auto`` runs many-row steps
    on dense weights, and a greedy near-tie can then go the other way)."""
    client = invariant_client
    prompt = SENTENCE * sentences
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert plain.usage.prompt_tokens > 256 and plain.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt + "Summarize."}], max_tokens=4
    )
    assert chat.usage.prompt_tokens > 256 and chat.choices[0].message.content is not None


def test_long_and_short_prompts_arriving_together_all_complete(client: OpenAI) -> None:
    prompts = [SENTENCE * n for n in (1, 30, 2, 60, 25, 3, 45, 1)]

    def complete(prompt: str) -> int:
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        return result.usage.completion_tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(complete, prompts)) == [6] * len(prompts)


def test_greedy_text_and_logprobs_are_the_same_alone_and_under_load(invariant_client: OpenAI) -> None:
    """What batch invariance promises, so on a server with it on (``auto`` turns it off on AMX machines)."""
    client = invariant_client

    def probe() -> tuple[str, list[float]]:
        result = client.completions.create(
            model=MODEL, prompt=SENTENCE * 30 + "Then", max_tokens=12, temperature=0, logprobs=3
        )
        return result.choices[0].text, result.choices[0].logprobs.token_logprobs

    def load(i: int) -> None:
        client.completions.create(model=MODEL, prompt=SENTENCE * (i % 7 + 1), max_tokens=24 + i, temperature=0.8)

    alone = probe()
    with ThreadPoolExecutor(12) as pool:
        others = [pool.submit(load, i) for i in range(11)]
        busy = pool.submit(probe).result()
        for other in others:
            other.result()
    assert busy == alone  # the same text and bitwise the same logprobs


def test_echoed_special_tokens_keep_their_text_and_top_logprobs_hold_the_token(client: OpenAI) -> None:
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = result.choices[0].logprobs
    assert result.choices[0].text == prompt
    assert lp.tokens[0] == "<|im_start|>" and "".join(lp.tokens) == prompt
    assert lp.text_offset == [prompt.index(lp.tokens[i], lp.text_offset[i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2  # logprobs + 1 at most, the token always


def test_logprobs_zero_gives_the_sampled_token_alone(client: OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, logprobs=0)
    lp = result.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_models_retrieve(client: OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_lm_eval_remote_tokenizer_flow(server_url: str) -> None:
    """lm-eval's `local-completions` with `tokenizer_backend=remote`: /tokenizer_info, then /tokenize without
    special tokens, whose first id of the EOS text is the EOS id."""
    info = httpx.get(f"{server_url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    tokenize = httpx.post(f"{server_url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert tokenize.json()["tokens"] == [2]


def test_lm_eval_loglikelihoods_do_not_depend_on_the_batch(server_url: str) -> None:
    """lm-eval's ``loglikelihood`` through ``local-completions``: echo, logprobs, no new tokens; its token-id prompts
    in batches, or one string prompt each. With the default flags (``--batch-invariant auto``: on for the bundled
    GGUF on every CPU class) each continuation's logprobs are the same either way (with one path for small steps and
    another for large ones they had moved by up to 0.87 nats on AMD Zen 4)."""
    pairs = [(f"Question {i}: what is {i} plus {i + 1}? Answer:", f" {2 * i + 1}") for i in range(10)]
    pairs += [(SENTENCE * (i + 1), " The end.") for i in range(6)]
    texts = [context + continuation for context, continuation in pairs]

    def tokens(text: str) -> list[int]:
        return httpx.post(f"{server_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    def scored(prompt: str | list) -> list[list[float | None]]:
        body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
        answer = httpx.post(f"{server_url}/v1/completions", json=body, timeout=300).json()
        return [choice["logprobs"]["token_logprobs"] for choice in answer["choices"]]

    ids = [tokens(text) for text in texts]
    batched = scored(ids[:8]) + scored(ids[8:])
    alone = [scored(text)[0] for text in texts]
    assert batched == alone
