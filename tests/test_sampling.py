"""Sampling inside a shared batch: per-request parameters, seeds that reproduce alone or in a busy batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.hf_engine import HFEngine
from engine.sampler import select_tokens
from engine.types import GREEDY, GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str) -> HFEngine:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    return HFEngine(
        model, eos_token_ids=frozenset({7}), capacity=8, max_model_len=256, kv_cache_bytes=1 << 26,
        max_num_batched_tokens=64,
    )  # fmt: skip


def run(engine: HFEngine, requests: list[GenerationRequest], stagger: int = 0) -> list[list[int]]:
    """Admit request i at step i * stagger; return each request's tokens."""
    tokens: dict[int, list[int]] = {}
    index_of: dict[int, int] = {}
    step = 0
    while len(index_of) < len(requests) or engine.num_active():
        for i, request in enumerate(requests):
            if i * stagger == step:
                index_of[engine.admit([request])[0]] = i
                tokens[i] = []
        for out in engine.step():
            tokens[index_of[out.seq_id]].extend(out.token_ids)
        step += 1
    return [tokens[i] for i in range(len(requests))]


def request(seed: int | None, temperature: float = 1.0, prompt: int = 5, **kw: float) -> GenerationRequest:
    params = SamplingParams(temperature=temperature, seed=seed, **kw)
    return GenerationRequest(tuple(range(20, 20 + prompt)), 24, ignore_eos=True, sampling=params)


def test_a_seed_reproduces_alone_and_in_a_busy_batch(engine: HFEngine) -> None:
    mine = request(seed=1234, temperature=0.9, top_p=0.95)
    alone = run(engine, [mine])[0]
    busy = [request(None), request(7, temperature=1.5), mine, request(None, top_k=5), request(None, prompt=40)]
    assert run(engine, busy, stagger=3)[2] == alone
    assert run(engine, [mine, *busy], stagger=1)[0] == alone


def test_different_seeds_differ_and_temperature_zero_is_greedy(engine: HFEngine) -> None:
    a, b = run(engine, [request(seed=1), request(seed=2)])
    assert a != b
    greedy = run(engine, [GenerationRequest(tuple(range(20, 25)), 24, ignore_eos=True)])[0]
    assert run(engine, [request(seed=3, temperature=0.0)])[0] == greedy
    assert run(engine, [request(seed=4, top_k=1)])[0] == greedy


def test_greedy_rows_are_unaffected_by_sampled_batchmates(engine: HFEngine) -> None:
    greedy = GenerationRequest(tuple(range(30, 42)), 20, ignore_eos=True)
    alone = run(engine, [greedy])[0]
    mixed = run(engine, [request(None, temperature=2.0), greedy, request(5, top_p=0.5)], stagger=2)
    assert mixed[1] == alone


def test_top_k_and_top_p_restrict_the_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]] * 2)
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    top_k = SamplingParams(temperature=5.0, top_k=2)
    top_p = SamplingParams(temperature=1.0, top_p=0.5)  # token 0 alone holds ~0.66 of the mass
    for _ in range(200):
        a, b = select_tokens(logits, [top_k, top_p], generators).tolist()
        assert a in (0, 1)
        assert b == 0
    assert select_tokens(logits, [GREEDY, GREEDY], [None, None]).tolist() == [0, 0]
