"""Sampled verification keeps the distribution: on a small vocabulary, many verifications of a fixed draft give
first tokens distributed as the row's own distribution, and second tokens (after an accepted first) as the next
row's: chi-square against the exact probabilities, with temperature, top-k, top-p, min-p and penalties. A seeded
sequence's verified tokens are the ones it draws decoding one token at a time."""

from __future__ import annotations

import pytest
import torch

from engine.core.types import SamplingParams
from engine.runtime import sampler
from engine.runtime.sampler import Row, select_tokens
from engine.runtime.speculative import accept, accepted_prefix

DRAWS = 6000
#: Chi-square's 0.999 quantile by degrees of freedom (the tests are seeded: a fixed outcome, not a flaky one).
CRITICAL = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """The statistic over the tokens with any probability, and its degrees of freedom; no count outside them."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the distribution excludes was drawn"
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5),
    ],
    ids=["plain", "top-k", "top-p", "min-p-penalty"],
)
def test_first_and_second_tokens_keep_their_distributions(params: SamplingParams) -> None:
    torch.manual_seed(0)
    vocab = 8
    logits = torch.randn(3, vocab) * 1.5
    draft = [int(logits[0].argsort()[-2]), int(logits[1].argsort()[-1])]  # a likely, not the likeliest, first
    rows = [Row(params, output_ids=[3, *draft[:i]]) for i in range(3)]
    probs = distribution(logits, rows)
    firsts = torch.zeros(vocab)
    seconds = torch.zeros(vocab)
    lengths = []
    for _ in range(DRAWS):
        tokens = [token for token, _ in accept(logits, rows, [(draft, 3)])[0]]
        lengths.append(len(tokens))
        firsts[tokens[0]] += 1
        if tokens[0] == draft[0]:
            seconds[tokens[1]] += 1
    for counts, expected in ((firsts, probs[0]), (seconds, probs[1])):
        statistic, freedom = chi_square(counts, expected)
        assert statistic < CRITICAL.get(freedom, 30.0), (statistic, freedom, counts.tolist(), expected.tolist())
    assert set(lengths) <= {1, 2, 3} and 3 in lengths  # a whole accepted draft gives the next row's token too


def distribution(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Each row's exact sampling distribution, ``[rows, vocab]``: what the sampler draws from, computed directly
    (penalties and bias, temperature, top-k, top-p over the whole sorted row, min-p)."""
    out = []
    for i, row in enumerate(rows):
        adjusted = sampler._adjust(logits[i : i + 1], [row]) / row.params.temperature
        if row.params.top_k:
            adjusted = sampler._top_k(adjusted, [row.params.top_k])
        if row.params.top_p < 1.0:
            adjusted = sampler._top_p_sorted(adjusted, torch.tensor([row.params.top_p]))
        probs = sampler._min_p(adjusted.softmax(dim=-1), [row])
        out.append((probs / probs.sum())[0])
    return torch.stack(out)


def test_a_seeded_sequence_verifies_the_tokens_it_draws_one_at_a_time() -> None:
    """Decoded one token at a time, a seeded row draws t0, t1, t2; verifying a draft of [t0, t1] emits exactly
    those three, and a draft whose second token differs emits t0 and t1: the text is the one without drafts."""
    torch.manual_seed(3)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.2, top_p=0.95)
    for seed in range(40):
        rows = [Row(params, seed, output_ids=[9]) for _ in range(3)]
        decoded: list[int] = []
        for i in range(3):
            rows[i] = Row(params, seed, output_ids=[9, *decoded])
            decoded.append(int(select_tokens(logits[i : i + 1], [rows[i]])[0][0]))
        assert [t for t, _ in accept(logits, rows, [(decoded[:2], 3)])[0]] == decoded
        wrong = (decoded[1] + 1) % 50
        rows[2] = Row(params, seed, output_ids=[9, decoded[0], wrong])
        assert [t for t, _ in accept(logits, rows, [([decoded[0], wrong], 3)])[0]] == decoded[:2]


def test_greedy_rows_accept_the_matching_prefix_and_the_model_s_next_token() -> None:
    logits = torch.full((4, 6), -5.0)
    for row, token in enumerate([2, 4, 1, 5]):
        logits[row, token] = 5.0  # row i's argmax
    greedy = Row(SamplingParams(), num_logprobs=0)
    picked = accept(logits, [greedy] * 4, [([2, 4, 0], 4)])
    assert [token for token, _ in picked[0]] == [2, 4, 1]  # 2 and 4 accepted, 0 rejected: the model's 1 instead
    assert all(entry is not None and entry.token_id == token for token, entry in picked[0])
    assert accepted_prefix([2, 4, 1], [2, 4, 1, 5]) == 3
    whole = accept(logits, [greedy] * 4, [([2, 4, 1], 4)])
    assert [token for token, _ in whole[0]] == [2, 4, 1, 5]
