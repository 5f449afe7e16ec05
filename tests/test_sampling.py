"""Sampling inside a shared batch: per-request parameters, seeds that reproduce alone or in a busy batch."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.types import GREEDY, GenerationRequest, SamplingParams
from engine.runtime import sampler
from engine.runtime.batch_engine import HFEngine
from engine.runtime.sampler import Row, select_tokens


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


def tokens_of(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    return select_tokens(logits, rows)[0].tolist()


def test_top_k_top_p_and_min_p_restrict_the_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]] * 3)
    seen = [set() for _ in range(3)]
    for n in range(300):  # seeded rows at their n-th token: each draws its own number
        rows = [
            Row(SamplingParams(temperature=5.0, top_k=2), 0, output_ids=[0] * n),
            Row(SamplingParams(temperature=1.0, top_p=0.5), 1, output_ids=[0] * n),  # token 0 holds ~0.66
            Row(SamplingParams(temperature=2.0, min_p=0.5), 2, output_ids=[0] * n),  # 0 and 1 survive
        ]
        for chosen, token in zip(seen, tokens_of(logits, rows), strict=True):
            chosen.add(token)
    assert seen == [{0, 1}, {0}, {0, 1}]
    assert tokens_of(logits[:2], [Row(GREEDY), Row(GREEDY)]) == [0, 0]


def test_draws_follow_the_distribution() -> None:
    """20,000 rows of one distribution in one call: each token's share within 1.5 points of its probability."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 1.5]]).expand(20000, -1).contiguous()
    tokens = torch.tensor(tokens_of(logits, [Row(SamplingParams(temperature=1.0))] * 20000))
    shares = torch.bincount(tokens, minlength=5).float() / 20000
    assert (shares - logits[0].softmax(-1)).abs().max() < 0.015


def test_a_seeded_rows_token_depends_on_its_seed_and_index_alone() -> None:
    """Where the row stands in the batch, and what its batchmates draw, change nothing; its seed and the index of
    the token it draws change its number; the numbers are uniform (seeded draws follow the distribution)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 1.5]])
    mine = Row(SamplingParams(temperature=1.0), 7, output_ids=[1, 2, 3])
    others = [Row(SamplingParams(temperature=1.0)), Row(SamplingParams(temperature=1.0), 8, output_ids=[1])]
    alone = tokens_of(logits, [mine])[0]
    assert tokens_of(logits.expand(3, -1).contiguous(), [*others, mine])[2] == alone
    assert sampler.keyed_uniform(7, 3) == sampler.keyed_uniform(7, 3) != sampler.keyed_uniform(7, 4)
    assert sampler.keyed_uniform(7, 3) != sampler.keyed_uniform(8, 3)
    assert sampler.keyed_uniform(-1, 0) == sampler.keyed_uniform(2**64 - 1, 0)  # the API's seeds, taken mod 2**64
    rows = [Row(SamplingParams(temperature=1.0), 5, output_ids=[0] * n) for n in range(20000)]
    tokens = torch.tensor(tokens_of(logits.expand(20000, -1).contiguous(), rows))
    shares = torch.bincount(tokens, minlength=5).float() / 20000
    assert (shares - logits[0].softmax(-1)).abs().max() < 0.015


def test_tokens_without_weight_are_never_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5000, -1).contiguous()
    rows = [Row(SamplingParams())] * 5000
    assert set(sampler._draw(probs, rows).tolist()) == {1, 3}
    # The largest float32 below 1 can round u * total up to the total: still the last token with weight.
    monkeypatch.setattr(sampler.torch, "rand", lambda n, **_: torch.full((n,), 1 - 2**-24))
    assert sampler._draw(probs[:2], rows[:2]).tolist() == [3, 3]


@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_draws_from_the_sorted_nucleus(top_p: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peaked row draws from its top candidates without sorting, a flat one sorts its whole row; both draw the
    nucleus that sorting the whole row gives, in its proportions."""
    torch.manual_seed(1)
    sorts: list[int] = []
    real_sort = sampler._top_p_sorted
    monkeypatch.setattr(sampler, "_top_p_sorted", lambda x, p: sorts.append(len(x)) or real_sort(x, p))
    for logits, sorted_rows in ((torch.randn(1, 2048) * 8, []), (torch.randn(1, 2048) * 0.1, [4000])):
        want = real_sort(logits, torch.tensor([top_p])).softmax(dim=-1)[0]
        sorts.clear()
        rows = [Row(SamplingParams(temperature=1.0, top_p=top_p))] * 4000
        tokens = torch.tensor(tokens_of(logits.expand(4000, -1).contiguous(), rows))
        assert sorts == sorted_rows
        assert bool((want[tokens] > 0).all())  # nothing outside the nucleus
        shares = torch.bincount(tokens, minlength=2048).float() / 4000
        assert (shares - want).abs().max() < 0.025


def test_bias_bans_and_penalties_move_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.5]] * 5)
    rows = [
        Row(GREEDY),
        Row(SamplingParams(logit_bias=((3, 100.0),))),
        Row(GREEDY, banned=frozenset({0})),
        Row(SamplingParams(presence_penalty=0.5), output_ids=[0]),
        Row(SamplingParams(repetition_penalty=2.0), prompt_ids=(0,)),
    ]
    assert tokens_of(logits, rows) == [0, 3, 1, 1, 1]


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    token, (logprob,) = select_tokens(logits, [Row(GREEDY, num_logprobs=2)])
    expected = logits.log_softmax(-1)[0]
    assert token.tolist() == [0]
    assert logprob is not None
    assert logprob.token_id == 0 and abs(logprob.logprob - expected[0].item()) < 1e-6
    assert [t for t, _ in logprob.top] == [0, 1]
    assert select_tokens(logits, [Row(GREEDY)])[1] == [None]


@pytest.mark.parametrize("budget", [64, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_a_plain_forward(tiny_llama_dir: str, budget: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    engine = HFEngine(
        model, eos_token_ids=frozenset({7}), capacity=4, max_model_len=256, kv_cache_bytes=1 << 26,
        max_num_batched_tokens=budget,
    )  # fmt: skip
    prompt = tuple(range(40, 60))
    engine.admit([GenerationRequest((1, 2, 3), 5), GenerationRequest(prompt, 2, prompt_logprobs=2, logprobs=1)])
    outputs = [out for _ in range(12) for out in engine.step()]
    first = next(out for out in outputs if out.seq_id == 1)
    scored = first.prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for position, entry in enumerate(scored[1:], start=1):
        assert entry is not None and entry.token_id == prompt[position]
        assert abs(entry.logprob - expected[position - 1, prompt[position]].item()) < 1e-4
        assert [t for t, _ in entry.top] == expected[position - 1].topk(2).indices.tolist()
    assert all(out.prompt_logprobs is None for out in outputs if out is not first)


def test_equal_logprobs_list_the_lower_token_id_first_whatever_shares_the_call() -> None:
    """bfloat16 logits tie often; the alternatives of a row must not depend on its batchmates (torch's topk
    orders equal values as its implementation goes), and the greedy token (argmax: the lowest id) leads them."""
    from engine.runtime.sampler import token_logprobs

    row = torch.full((4096,), -5.0)
    row[[3000, 17, 2048, 900]] = 2.0  # four tokens tie for the top
    row[5] = 1.0
    batch = torch.stack([row] + [torch.randn(4096) for _ in range(63)])
    tokens = batch.argmax(dim=-1)
    alone = token_logprobs(row[None], tokens[:1], [5])[0]
    together = token_logprobs(batch, tokens, [5] * 64)[0]
    assert alone == together
    assert [token for token, _ in alone.top] == [17, 900, 2048, 3000, 5] and alone.token_id == 17
